"""WorkerConfig validation and the CLI's layering of flags > PIPELINE_* env vars >
TOML file, observed through the WorkerConfig `pipeline run` would start with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pipeline import cli
from pipeline.core.config import KafkaSettings, WorkerConfig
from pipeline.core.errors import ConfigError

RUN = ["run", "--topic", "docs", "--group", "g1", "--output", "/tmp/out"]


def worker(**overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = {"topics": ("docs",), "group": "g", "output": Path("/tmp/o")}
    values.update(overrides)
    return WorkerConfig.of(**values)


# ------------------------------------------------------------------ WorkerConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"topics": ()}, "at least one --topic"),
        ({"topics": ("bad topic",)}, "not a valid Kafka topic"),
        ({"topics": ("ok", "sl/ash")}, "not a valid Kafka topic"),
        ({"topics": ("..",)}, "not a valid Kafka topic"),
        ({"topics": ("x" * 250,)}, "not a valid Kafka topic"),
        ({"group": "  "}, "--group"),
        ({"batch_size": 0}, "batch size"),
        ({"poll_timeout_ms": -5}, "poll timeout"),
        ({"max_batch_tokens": 0}, "max batch tokens"),
        ({"sub_batch_tokens": -1}, "sub-batch tokens"),
        ({"max_in_flight": 0}, "max in flight"),
        ({"max_text_bytes": 0}, "max text bytes"),
        ({"max_poll_interval_ms": 0}, "max poll interval"),
        ({"precision": "fp8"}, "precision"),
        ({"device": "tpu"}, "device"),
        ({"dlq_topic": "docs"}, "dead-letter topic"),
        ({"dlq_topic": "has space"}, "not a valid Kafka topic"),
        ({"metrics_port": 70000}, "not a TCP port"),
        ({"metrics_port": -1}, "not a TCP port"),
        ({"text_field": "id"}, "must differ"),
    ],
)
def test_worker_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        worker(**overrides)


def test_worker_config_accepts_valid_values() -> None:
    config = worker(topics=("a.b-c_1", "d"), batch_size=1, metrics_port=0, dlq_topic="dead")
    assert config.topics == ("a.b-c_1", "d")
    assert config.dead_letter_topic == "dead"


def test_dead_letter_topic_defaults_to_first_topic_dot_dlq() -> None:
    assert worker(topics=("first", "second")).dead_letter_topic == "first.dlq"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bootstrap_servers": ""}, "empty"),
        ({"bootstrap_servers": " , "}, "empty"),
        ({"bootstrap_servers": "localhost"}, "HOST:PORT"),
        ({"bootstrap_servers": "h:1,h2:port"}, "HOST:PORT"),
        ({"bootstrap_servers": ":9092"}, "HOST:PORT"),
        ({"security_protocol": "TLS"}, "security protocol"),
        ({"security_protocol": "SASL_SSL"}, "sasl-mechanism"),
        ({"sasl_mechanism": "MD5"}, "SASL mechanism"),
        ({"ssl_cafile": "/nonexistent/ca.pem"}, "does not exist"),
    ],
)
def test_kafka_settings_rejects_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KafkaSettings(**kwargs)


def test_kafka_client_kwargs_split_servers_and_skip_unset() -> None:
    kwargs = KafkaSettings("h1:9092,h2:9093", "SASL_PLAINTEXT", "PLAIN", "u", "pw").client_kwargs()
    assert kwargs["bootstrap_servers"] == ["h1:9092", "h2:9093"]
    assert kwargs["sasl_plain_password"] == "pw"
    assert "ssl_cafile" not in kwargs


def test_redacted_hides_secrets() -> None:
    kafka = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="PLAIN",
        sasl_plain_username="alice",
        sasl_plain_password="s3cret-pw",
        ssl_password="key-pass",
    )
    redacted = worker(kafka=kafka).redacted()
    text = json.dumps(redacted)  # serialisable as is, for the start-up log
    assert "s3cret-pw" not in text and "key-pass" not in text
    assert redacted["kafka"]["sasl_plain_password"] == "***"
    assert redacted["kafka"]["ssl_password"] == "***"
    assert redacted["kafka"]["sasl_plain_username"] == "alice"
    assert redacted["output"] == "/tmp/o"
    assert redacted["topics"] == ["docs"]


def test_redacted_leaves_unset_secrets_unset() -> None:
    assert worker().redacted()["kafka"]["sasl_plain_password"] is None


# ------------------------------------------------------------------ CLI layering


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[WorkerConfig]:
    for name in list(os.environ):
        if name.startswith("PIPELINE_"):
            monkeypatch.delenv(name)
    configs: list[WorkerConfig] = []
    monkeypatch.setattr(cli.run, "run_worker", configs.append)
    return configs


def invoke(args: list[str], env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.main, args, env=env)


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return path


def test_flags_build_the_worker_config(captured: list[WorkerConfig]) -> None:
    result = invoke([*RUN, "--batch-size", "64", "--precision", "fp32", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (config,) = captured
    assert config.topics == ("docs",)
    assert config.group == "g1"
    assert config.output == Path("/tmp/out")
    assert (config.batching.batch_size, config.model.precision, config.model.device) == (
        64,
        "fp32",
        "cpu",
    )
    assert config.dead_letter_topic == "docs.dlq"
    assert config.kafka.bootstrap_servers == "127.0.0.1:9092"


def test_repeated_topic_flags(captured: list[WorkerConfig]) -> None:
    result = invoke(["run", "--topic", "a", "--topic", "b", "--group", "g", "--output", "/o"])
    assert result.exit_code == 0, result.output
    assert captured[0].topics == ("a", "b")
    assert captured[0].dead_letter_topic == "a.dlq"


def test_file_sets_run_options_and_global_bootstrap(
    captured: list[WorkerConfig], tmp_path: Path
) -> None:
    path = toml(
        tmp_path,
        'bootstrap_servers = "file-host:9092"\n'
        '[run]\nbatch_size = 32\npoll-timeout-ms = 250\nprecision = "int8"\n',
    )
    result = invoke(["--config", str(path), *RUN])
    assert result.exit_code == 0, result.output
    (config,) = captured
    assert config.kafka.bootstrap_servers == "file-host:9092"
    assert config.batching.batch_size == 32
    assert config.batching.poll_timeout_ms == 250  # dashed keys work too
    assert config.model.precision == "int8"


def test_file_groups_run_options_as_the_config_groups_them(
    captured: list[WorkerConfig], tmp_path: Path
) -> None:
    path = toml(
        tmp_path,
        "[run]\nmax-in-flight = 3\n"
        "[run.batching]\nbatch-size = 64\npoll_timeout_ms = 100\n"
        '[run.model]\nmodel = "/models/e5"\nprecision = "fp32"\ndimensions = 128\n'
        '[run.cache]\ncache = "off"\n[run.liveness]\nsession-timeout-ms = 20000\n',
    )
    result = invoke(["--config", str(path), *RUN])
    assert result.exit_code == 0, result.output
    (config,) = captured
    assert (config.batching.batch_size, config.batching.poll_timeout_ms) == (64, 100)
    assert config.batching.max_in_flight == 3
    assert (config.model.name, config.model.precision, config.model.dimensions) == (
        "/models/e5",
        "fp32",
        128,
    )
    assert config.cache.spec == "off"
    assert config.liveness.session_timeout_ms == 20000


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[run.batches]\nbatch-size = 1\n", "[run.batches] is not one of input, batching"),
        ("[run.model]\nbatch-size = 1\n", "'batch_size' is not an option of [run.model]"),
        ("[run]\nbatch-size = 2\n[run.batching]\nbatch-size = 1\n", "given both in [run]"),
    ],
)
def test_file_groups_refuse_what_is_not_theirs(
    captured: list[WorkerConfig], tmp_path: Path, text: str, named: str
) -> None:
    result = invoke(["--config", str(toml(tmp_path, text)), *RUN])
    assert result.exit_code == ConfigError.exit_code
    assert named in result.output
    assert captured == []


def test_env_beats_file(captured: list[WorkerConfig], tmp_path: Path) -> None:
    path = toml(tmp_path, 'bootstrap_servers = "file-host:1"\n[run]\nbatch_size = 32\n')
    env = {"PIPELINE_BATCH_SIZE": "48", "PIPELINE_BOOTSTRAP_SERVERS": "env-host:2"}
    result = invoke(["--config", str(path), *RUN], env=env)
    assert result.exit_code == 0, result.output
    assert captured[0].batching.batch_size == 48
    assert captured[0].kafka.bootstrap_servers == "env-host:2"


def test_flag_beats_env_and_file(captured: list[WorkerConfig], tmp_path: Path) -> None:
    path = toml(tmp_path, 'bootstrap_servers = "file-host:1"\n[run]\nbatch_size = 32\n')
    env = {"PIPELINE_BATCH_SIZE": "48", "PIPELINE_BOOTSTRAP_SERVERS": "env-host:2"}
    args = ["--bootstrap-servers", "flag-host:3", "--config", str(path), *RUN, "--batch-size", "8"]
    result = invoke(args, env=env)
    assert result.exit_code == 0, result.output
    assert captured[0].batching.batch_size == 8
    assert captured[0].kafka.bootstrap_servers == "flag-host:3"


def test_config_file_from_environment(captured: list[WorkerConfig], tmp_path: Path) -> None:
    path = toml(tmp_path, "[run]\nmax_batch_tokens = 1000\n")
    result = invoke(RUN, env={"PIPELINE_CONFIG": str(path)})
    assert result.exit_code == 0, result.output
    assert captured[0].batching.max_batch_tokens == 1000


def test_secret_from_env_reaches_kafka_settings(captured: list[WorkerConfig]) -> None:
    env = {
        "PIPELINE_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "PIPELINE_SASL_MECHANISM": "PLAIN",
        "PIPELINE_SASL_USERNAME": "bob",
        "PIPELINE_SASL_PASSWORD": "hunter2",
    }
    result = invoke(RUN, env=env)
    assert result.exit_code == 0, result.output
    kafka = captured[0].kafka
    assert (kafka.sasl_plain_username, kafka.sasl_plain_password) == ("bob", "hunter2")
    assert "hunter2" not in json.dumps(captured[0].redacted())


def test_unknown_global_key_in_file_is_a_one_line_error(
    captured: list[WorkerConfig], tmp_path: Path
) -> None:
    path = toml(tmp_path, 'bootstrap_server = "typo:9092"\n')
    result = invoke(["--config", str(path), *RUN])
    assert result.exit_code == ConfigError.exit_code
    assert captured == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error:") and "bootstrap_server" in lines[0]
    assert "Traceback" not in result.output


def test_invalid_toml_is_a_clear_error(captured: list[WorkerConfig], tmp_path: Path) -> None:
    path = toml(tmp_path, "[run\nbatch_size = = 3\n")
    result = invoke(["--config", str(path), *RUN])
    assert result.exit_code == ConfigError.exit_code
    assert captured == []
    assert "not valid TOML" in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.output


def test_missing_config_file_is_a_clear_error(captured: list[WorkerConfig], tmp_path: Path) -> None:
    result = invoke(["--config", str(tmp_path / "nope.toml"), *RUN])
    assert result.exit_code == ConfigError.exit_code
    assert "does not exist" in result.stderr
    assert captured == []


def test_run_without_topic_is_a_usage_error(captured: list[WorkerConfig]) -> None:
    result = invoke(["run", "--group", "g", "--output", "/tmp/o"])
    assert result.exit_code == 64  # click's usage errors, outside 0-4 too
    assert "--topic" in result.stderr
    assert captured == []


def test_invalid_value_is_a_config_error_exit_64(captured: list[WorkerConfig]) -> None:
    result = invoke([*RUN, "--batch-size", "0"])
    assert result.exit_code == ConfigError.exit_code == 64
    assert result.stderr.strip() == "error: batch size must be positive, got 0"
    assert captured == []


def test_invalid_bootstrap_is_a_config_error(captured: list[WorkerConfig]) -> None:
    result = invoke(["--bootstrap-servers", "no-port", *RUN])
    assert result.exit_code == ConfigError.exit_code
    assert "HOST:PORT" in result.stderr
    assert captured == []


def test_dlq_topic_same_as_input_is_rejected(captured: list[WorkerConfig]) -> None:
    result = invoke([*RUN, "--dlq-topic", "docs"])
    assert result.exit_code == ConfigError.exit_code and "dead-letter" in result.stderr
    assert captured == []


def test_file_can_set_the_run_topic(captured: list[WorkerConfig], tmp_path: Path) -> None:
    path = toml(tmp_path, '[run]\ntopic = ["docs", "more"]\ngroup = "g"\noutput = "/tmp/o"\n')
    result = invoke(["--config", str(path), "run"])
    assert result.exit_code == 0, result.output
    assert captured[0].topics == ("docs", "more")


def test_unknown_key_in_run_table_is_an_error(captured: list[WorkerConfig], tmp_path: Path) -> None:
    path = toml(tmp_path, "[run]\nbatch_sise = 64\n")
    result = invoke(["--config", str(path), *RUN])
    assert result.exit_code == ConfigError.exit_code
    assert "batch_sise" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["index", "check", "--output", "gs://bucket/x"],
        ["run", "--topic", "t", "--group", "g", "--output", "file:///tmp/x"],
    ],
)
def test_other_urls_are_refused_in_one_line_not_written_locally(
    args: list[str], tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(args)
    assert result.exit_code == 64
    assert "give a local directory or s3://bucket/prefix" in result.output
    assert not any(tmp_path.iterdir())  # no local folder named "gs:"


def test_an_s3_output_becomes_an_object_store(captured: list[WorkerConfig], tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["run", "--topic", "t", "--group", "g", "--output", "s3://bucket/some/prefix"])
    assert result.exit_code == 0, result.output
    output = captured[0].output
    assert not isinstance(output, Path)
    assert output.url == "s3://bucket/some/prefix/"
    assert captured[0].redacted()["output"] == "s3://bucket/some/prefix"
    assert not any(tmp_path.iterdir())
