"""Against a real secured broker (scripts/dev-kafka-secure.sh: SASL with SCRAM-SHA-512
and PLAIN, TLS from a private CA, mutual TLS, SASL over TLS, ACLs), started once per
test session: every wrong credential or certificate is one `error:` line that names
it, with an exit code of its own (76, 77, 78; 69 stays "no broker answered"), at
once rather than after the clients' bootstrap retries, and no secret is in any
output; a good configuration, from flags, environment variables or a TOML file,
works end to end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.core.errors import (
    AccessDenied,
    PipelineError,
    SecureConnectionFailed,
    SetupError,
)
from pipeline.kafka import cluster
from tests.helpers import PIPELINE, REPO, worker_env
from tests.test_errors import error_line

pytestmark = pytest.mark.integration

SCRIPT = REPO / "scripts" / "dev-kafka-secure.sh"
WRONG = "wrong-password-4e1d"  # what a user mistyped: never printed either
KAFKA_VARIABLES = (
    "PIPELINE_BOOTSTRAP_SERVERS",
    "PIPELINE_SECURITY_PROTOCOL",
    "PIPELINE_SASL_",
    "PIPELINE_SSL_",
    "PIPELINE_CONFIG",
)
Env = dict[str, str]
Flags = Callable[[Env], list[str]]


@pytest.fixture(scope="session")
def secured() -> Env:
    """Starts the secured broker once per session (idempotent, left running like the
    plain one) and returns what `dev-kafka-secure.sh env` prints: its listeners,
    users, passwords and TLS files."""
    if shutil.which("java") is None:
        pytest.skip("java is not installed: the secured broker needs Java 17")
    subprocess.run([str(SCRIPT), "start"], check=True)
    printed = subprocess.run([str(SCRIPT), "env"], capture_output=True, text=True, check=True)
    return dict(
        line.removeprefix("export ").split("=", 1)
        for line in printed.stdout.splitlines()
        if line.startswith("export ")
    )


def secrets(s: Env) -> list[str]:
    return [
        s["SECURE_KAFKA_PASSWORD"],
        s["SECURE_KAFKA_DENIED_PASSWORD"],
        s["SECURE_KAFKA_CLIENT_KEY_PASSWORD"],
        WRONG,
    ]


def pipeline(
    s: Env, flags: list[str], *args: str, env: Env | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """`python -m pipeline.cli FLAGS ARGS` (result, seconds); asserts that no secret
    is in its output."""
    # Nothing of this process's own Kafka settings: flags, `env` and files only.
    inherited = {k: v for k, v in worker_env("").items() if not k.startswith(KAFKA_VARIABLES)}
    started = time.monotonic()
    result = subprocess.run(
        [*PIPELINE, *flags, *args],
        env={**inherited, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert not [secret for secret in secrets(s) if secret in output], output
    return result, time.monotonic() - started


# ------------------------------------------------------------------ configurations


def sasl(
    listener: str, mechanism: str, user: str, password: str | None, tls: bool = False
) -> Flags:
    """SASL at `listener` as `user` with `password` (each a variable of the broker's
    env, or the value itself; no --sasl-password flag for None)."""

    def flags(s: Env) -> list[str]:
        given = [
            *("--bootstrap-servers", s[listener]),
            *("--security-protocol", "SASL_SSL" if tls else "SASL_PLAINTEXT"),
            *("--sasl-mechanism", mechanism),
            *("--sasl-username", s.get(user, user)),
        ]
        if password is not None:
            given += ["--sasl-password", s.get(password, password)]
        return [*given, "--ssl-cafile", s["SECURE_KAFKA_CA"]] if tls else given

    return flags


def tls(server: str, *, ca: str | None = "SECURE_KAFKA_CA", client: str | None = None) -> Flags:
    """SSL to `server` (a listener's variable, or HOST:PORT with the port of one),
    trusting `ca`, with the client certificate `client` ("CLIENT", "STRANGER")."""

    def flags(s: Env) -> list[str]:
        given = ["--bootstrap-servers", address(s, server), "--security-protocol", "SSL"]
        if ca:
            given += ["--ssl-cafile", s[ca]]
        if client == "CLIENT":
            given += ["--ssl-certfile", s["SECURE_KAFKA_CLIENT_CERT"]]
            given += ["--ssl-keyfile", s["SECURE_KAFKA_CLIENT_KEY"]]
        elif client:
            given += ["--ssl-certfile", s[f"SECURE_KAFKA_{client}_CERT"]]
            given += ["--ssl-keyfile", s[f"SECURE_KAFKA_{client}_KEY"]]
        return given

    return flags


def address(s: Env, server: str) -> str:
    """SECURE_KAFKA_SSL -> its HOST:PORT; "127.0.0.1@SECURE_KAFKA_SSL" -> that host
    with the listener's port."""
    host, _, listener = server.rpartition("@")
    found = s[listener]
    return f"{host}:{found.rpartition(':')[2]}" if host else found


def encrypted_key(password: str | None) -> Flags:
    def flags(s: Env) -> list[str]:
        given = [
            *tls("SECURE_KAFKA_MTLS")(s),
            "--ssl-certfile",
            s["SECURE_KAFKA_CLIENT_CERT"],
            "--ssl-keyfile",
            s["SECURE_KAFKA_CLIENT_ENCRYPTED_KEY"],
        ]
        return [*given, "--ssl-password", password] if password else given

    return flags


def plaintext(listener: str) -> Flags:
    return lambda s: ["--bootstrap-servers", s[listener]]


# Each wrong configuration: (flags, error, words its line must have).
FAILURES: dict[str, tuple[Flags, type[PipelineError], list[str]]] = {
    "wrong password": (
        sasl("SECURE_KAFKA_SASL_PLAINTEXT", "SCRAM-SHA-512", "SECURE_KAFKA_USER", WRONG),
        AccessDenied,
        ["authentication failed", "'alice'", "SCRAM-SHA-512"],
    ),
    "unknown user": (
        sasl("SECURE_KAFKA_SASL_PLAINTEXT", "PLAIN", "nobody", WRONG),
        AccessDenied,
        ["authentication failed", "'nobody'", "PLAIN"],
    ),
    "wrong password over TLS": (
        sasl("SECURE_KAFKA_SASL_SSL", "PLAIN", "SECURE_KAFKA_USER", WRONG, tls=True),
        AccessDenied,
        ["authentication failed", "'alice'"],
    ),
    "wrong mechanism": (
        sasl(
            "SECURE_KAFKA_SASL_PLAINTEXT",
            "SCRAM-SHA-256",
            "SECURE_KAFKA_USER",
            "SECURE_KAFKA_PASSWORD",
        ),
        AccessDenied,
        ["does not enable SASL mechanism SCRAM-SHA-256", "SCRAM-SHA-512", "--sasl-mechanism"],
    ),
    "no ACLs": (
        sasl(
            "SECURE_KAFKA_SASL_PLAINTEXT",
            "SCRAM-SHA-512",
            "SECURE_KAFKA_DENIED_USER",
            "SECURE_KAFKA_DENIED_PASSWORD",
        ),
        AccessDenied,
        ["not authorised", "'mallory'", "ACLs"],
    ),
    "no CA given": (
        tls("SECURE_KAFKA_SSL", ca=None),
        SecureConnectionFailed,
        ["certificate", "not trusted", "--ssl-cafile"],
    ),
    "another CA": (
        tls("SECURE_KAFKA_SSL", ca="SECURE_KAFKA_OTHER_CA"),
        SecureConnectionFailed,
        ["not trusted", "other-ca.pem"],
    ),
    "host name mismatch": (
        tls("127.0.0.1@SECURE_KAFKA_SSL"),
        SecureConnectionFailed,
        ["not valid for the host name", "127.0.0.1"],
    ),
    "no client certificate": (
        tls("SECURE_KAFKA_MTLS"),
        AccessDenied,
        ["asks for a client certificate", "--ssl-certfile"],
    ),
    "client certificate of another CA": (
        tls("SECURE_KAFKA_MTLS", client="STRANGER"),
        AccessDenied,
        ["refused the client certificate", "stranger.pem"],
    ),
    "wrong key password": (
        encrypted_key(WRONG),
        SetupError,
        ["client-encrypted.key", "cannot be decrypted", "--ssl-password"],
    ),
    "no key password": (
        encrypted_key(None),
        SetupError,
        ["client-encrypted.key", "is encrypted", "--ssl-password"],
    ),
    "SSL to a plaintext port": (
        tls("localhost@SECURE_KAFKA_PLAINTEXT"),
        SecureConnectionFailed,
        ["does not speak TLS", "--security-protocol SSL"],
    ),
    "plaintext to an SSL port": (
        plaintext("SECURE_KAFKA_SSL"),
        SecureConnectionFailed,
        ["speaks TLS", "--security-protocol SSL"],
    ),
    "plaintext to a SASL port": (
        plaintext("SECURE_KAFKA_SASL_PLAINTEXT"),
        SecureConnectionFailed,
        ["probably wants SASL"],
    ),
    "SASL to a plaintext port": (
        sasl("SECURE_KAFKA_PLAINTEXT", "PLAIN", "SECURE_KAFKA_USER", "SECURE_KAFKA_PASSWORD"),
        SecureConnectionFailed,
        ["does not take SASL"],
    ),
}
# Every command that talks to Kafka, each tried with a failure of each kind.
COMMANDS = {
    "run": "run --topic t --group g --output {out} --precision fp32 --until-end",
    "status": "status --group g",
    "produce": "produce t {input}",
    "audit": "audit --output {out} --group g --topic t",
    "offsets-reset": "offsets reset --group g --topic t --to-earliest",
}
COMMAND_FAILURES = ("wrong password", "another CA", "wrong key password")
# Past this, the clients' own bootstrap (10 s) would have been retrying the failure.
QUICK_S = cluster.BOOTSTRAP_TIMEOUT_MS / 1000


@pytest.fixture(scope="module")
def failed(
    secured: Env, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], float]]:
    """(result, seconds) of `topics create` with every wrong configuration, and of
    every other command with a few, run side by side."""
    tmp = tmp_path_factory.mktemp("secured-failures")
    (tmp / "in.jsonl").write_text('{"text": "hello"}\n')
    (tmp / "out" / "vectors").mkdir(parents=True)  # an (empty) output for audit
    runs = {(name, "topics-create"): "topics create t --partitions 1" for name in FAILURES}
    for command, args in COMMANDS.items():
        runs.update({(name, command): args for name in COMMAND_FAILURES})

    def attempt(key: tuple[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
        flags = FAILURES[key[0]][0](secured)
        args = runs[key].format(out=tmp / "out", input=tmp / "in.jsonl").split()
        return pipeline(secured, flags, *args)

    with ThreadPoolExecutor(3) as pool:
        futures = {key: pool.submit(attempt, key) for key in runs}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("case", list(FAILURES))
def test_each_wrong_credential_or_certificate_is_one_line_naming_it(
    case: str, failed: dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], float]]
) -> None:
    _, error, words = FAILURES[case]
    result, seconds = failed[(case, "topics-create")]
    line = error_line(result, error)
    assert all(word in line for word in words), line
    assert "no Kafka broker answered" not in line
    assert seconds < QUICK_S, f"{case}: {seconds:.1f}s"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", COMMAND_FAILURES)
def test_every_command_names_them_alike(
    command: str,
    case: str,
    failed: dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], float]],
) -> None:
    _, error, words = FAILURES[case]
    result, seconds = failed[(case, command)]
    line = error_line(result, error)
    assert all(word in line for word in words), line
    assert seconds < QUICK_S + (5 if command == "run" else 0), f"{seconds:.1f}s"


def test_the_exit_codes_are_their_own() -> None:
    codes = {AccessDenied: 77, SecureConnectionFailed: 76, SetupError: 78}
    assert {error: error.exit_code for error in codes} == codes
    assert not set(codes.values()) & {0, 1, 2, 3, 4, 64, 65, 66, 69, 70, 72, 73, 75}


def test_the_wrong_password_from_a_variable_or_a_file_is_named_too(
    secured: Env, tmp_path: Path
) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'bootstrap_servers = "{secured["SECURE_KAFKA_SASL_SSL"]}"\n'
        'security_protocol = "SASL_SSL"\n'
        'sasl_mechanism = "SCRAM-SHA-512"\n'
        'sasl_username = "alice"\n'
        f'sasl_password = "{WRONG}"\n'
        f'ssl_cafile = "{secured["SECURE_KAFKA_CA"]}"\n'
    )
    from_file, _ = pipeline(secured, ["--config", str(config)], "status", "--group", "g")
    from_variable, _ = pipeline(
        secured,
        sasl("SECURE_KAFKA_SASL_PLAINTEXT", "SCRAM-SHA-512", "SECURE_KAFKA_USER", None)(secured),
        "status",
        "--group",
        "g",
        env={"PIPELINE_SASL_PASSWORD": WRONG},
    )
    for result in (from_file, from_variable):
        assert "authentication failed for user 'alice'" in error_line(result, AccessDenied)


# ------------------------------------------------------------------ a good configuration


def test_a_good_configuration_works_end_to_end(
    secured: Env, tmp_path: Path, tiny_model: str
) -> None:
    """SASL_SSL with SCRAM-SHA-512 from a TOML file and the password from the
    environment: topics create, produce, run --until-end, status, audit; then mutual
    TLS with an encrypted client key from flags: status and offsets reset. No secret
    is printed (`pipeline` checks every output) or written to the output."""
    topic, group = f"secure-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    output = tmp_path / "out"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"text {n}"}) + "\n" for n in range(20)))
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'bootstrap_servers = "{secured["SECURE_KAFKA_SASL_SSL"]}"\n'
        'security_protocol = "SASL_SSL"\n'
        'sasl_mechanism = "SCRAM-SHA-512"\n'
        'sasl_username = "alice"\n'
        f'ssl_cafile = "{secured["SECURE_KAFKA_CA"]}"\n'
    )
    by_file = ["--config", str(config)]
    password = {"PIPELINE_SASL_PASSWORD": secured["SECURE_KAFKA_PASSWORD"]}

    steps = [
        ["topics", "create", topic, "--partitions", "2"],
        ["produce", topic, str(corpus)],
        ["run", "--topic", topic, "--group", group, "--output", str(output), "--until-end",
         "--model", tiny_model, "--precision", "fp32", "--no-progress"],
        ["status", "--group", group, "--json"],
        ["audit", "--output", str(output), "--group", group, "--topic", topic],
    ]  # fmt: skip
    for step in steps:
        result, _ = pipeline(secured, by_file, *step, env=password)
        assert result.returncode == 0, (step, result.stdout, result.stderr)
    assert (
        json.loads(pipeline(secured, by_file, *steps[3], env=password)[0].stdout)["total_lag"] == 0
    )

    mutual = [
        *tls("SECURE_KAFKA_MTLS")(secured),
        "--ssl-certfile",
        secured["SECURE_KAFKA_CLIENT_CERT"],
        "--ssl-keyfile",
        secured["SECURE_KAFKA_CLIENT_ENCRYPTED_KEY"],
    ]
    key_password = {"PIPELINE_SSL_PASSWORD": secured["SECURE_KAFKA_CLIENT_KEY_PASSWORD"]}
    status, _ = pipeline(secured, mutual, *steps[3], env=key_password)
    assert status.returncode == 0 and json.loads(status.stdout)["total_lag"] == 0
    reset, _ = pipeline(
        secured,
        mutual,
        *["offsets", "reset", "--group", group, "--topic", topic, "--to-earliest", "--dry-run"],
        env=key_password,
    )
    assert reset.returncode == 0, reset.stderr

    written = b"".join(path.read_bytes() for path in output.rglob("*") if path.is_file())
    assert not [secret for secret in secrets(secured) if secret.encode() in written]
