"""A broker of its own for this module, to format it fresh and to restart it
under a running worker without disturbing the broker the other tests share.

- a freshly formatted broker (no __consumer_offsets yet): a newcomer's first
  commands, as scripts/demo.sh runs them, all succeed;
- a broker restart in the middle of a bulk job: the worker rides it out and
  every record still lands exactly once.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    PIPELINE,
    REPO,
    committed_offsets,
    corpus_records,
    duplicates,
    output_rows,
    publish_json,
    worker_args,
    worker_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PORT = int(os.environ.get("PIPELINE_TEST_PRIVATE_KAFKA_PORT", "29092"))
BOOTSTRAP = f"127.0.0.1:{PORT}"
DEV_KAFKA = REPO / "scripts" / "dev-kafka.sh"


def _shared_libs() -> Path:
    """The jars scripts/dev-kafka.sh fetched for the shared broker (fetched if missing)."""
    subprocess.run([str(DEV_KAFKA), "start"], check=True, capture_output=True)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embedding-pipeline"
    libs = sorted(cache.glob("kafka-*/libs/.complete"))
    assert libs, f"no Kafka jars under {cache}"
    return libs[-1].parent


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    home = tmp_path_factory.mktemp("private-kafka")
    (home / "libs").symlink_to(_shared_libs())  # no second download
    env = dict(
        os.environ,
        PIPELINE_KAFKA_HOME=str(home),
        PIPELINE_KAFKA_PORT=str(PORT),
        PIPELINE_KAFKA_CONTROLLER_PORT=str(PORT + 1),
    )
    subprocess.run([str(DEV_KAFKA), "wipe"], env=env, check=True, capture_output=True)
    subprocess.run([str(DEV_KAFKA), "start"], env=env, check=True, capture_output=True)
    try:
        yield env
    finally:
        subprocess.run([str(DEV_KAFKA), "stop"], env=env, capture_output=True)


def pipeline(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PIPELINE, *args],
        env=worker_env(BOOTSTRAP),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_first_run_on_a_freshly_formatted_broker(private_broker, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(
            f'{{"id": "d{i}", "text": "paragraph number {i} of the demo"}}' for i in range(90)
        )
        + "\n"
    )
    out = tmp_path / "out"

    steps = [
        ("topics", "create", "demo", "--partitions", "3"),
        ("produce", "demo", str(corpus), "--no-progress"),
        tuple(worker_args("demo", "demo-group", out, "--until-end")[len(PIPELINE) :]),
        ("status", "--group", "demo-group", "--output", str(out)),
    ]
    for step in steps:
        result = pipeline(*step)
        assert result.returncode == 0, f"{' '.join(step)}:\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr
    assert len(output_rows(out)) == 90


def test_a_bulk_job_rides_out_a_broker_restart(
    private_broker, tmp_path: Path, tiny_model: str
) -> None:
    topic = "restart"
    assert pipeline("topics", "create", topic, "--partitions", "3").returncode == 0
    publish_json(BOOTSTRAP, topic, corpus_records(1500), partitions=3)
    out = tmp_path / "out"
    log = tmp_path / "worker.log"
    args = worker_args(
        topic, "restart-group", out, "--until-end", "--batch-size", "32", "--model", tiny_model
    )
    with open(log, "wb") as sink:
        worker = subprocess.Popen(
            args, env=worker_env(BOOTSTRAP), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 180
        while not any(committed_offsets(BOOTSTRAP, "restart-group", topic).values()):
            assert worker.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no commit within 180 s"
            time.sleep(0.5)
        restarted = subprocess.run(
            [str(DEV_KAFKA), "restart"], env=private_broker, capture_output=True, text=True
        )
        assert restarted.returncode == 0, restarted.stderr
        code = worker.wait(timeout=600)

    assert code == 0, log.read_text()[-4000:]
    rows = output_rows(out)
    assert duplicates(rows) == []
    assert set(rows) == {(topic, p, o) for p in range(3) for o in range(500)}
    assert committed_offsets(BOOTSTRAP, "restart-group", topic) == {0: 500, 1: 500, 2: 500}
