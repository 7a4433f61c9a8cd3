"""The OpenVINO engine (int8's): converted once and cached per model, recipe and
release; a damaged cache converted again; workers converting at once; the engine
and recipe in the outputs' metadata; its layouts giving the same vectors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.corpus import sample_texts
from pipeline.core.errors import ModelError
from pipeline.model import openvino_engine
from pipeline.model.embedder import Embedder, _check_precision
from pipeline.model.precision import cosine_rows

pytestmark = pytest.mark.skipif(not openvino_engine.available(), reason="no OpenVINO")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One converted and compressed int8 model (seconds of NNCF) that the tests
    below copy into their own caches."""
    home = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(home))
        Embedder.load("default", "int8", "cpu").close()
    return home / "embedding-pipeline" / "openvino"


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "embedding-pipeline" / "openvino"


@pytest.fixture
def cache_home(empty_cache: Path, converted: Path) -> Path:
    """A cache holding the int8 model as a first start left it."""
    shutil.copytree(converted, empty_cache)
    return empty_cache


@pytest.fixture
def texts() -> list[str]:
    return sample_texts(96)


@pytest.fixture
def int8(cache_home: Path) -> Iterator[Embedder]:
    embedder = Embedder.load("default", "int8", "cpu")
    yield embedder
    embedder.close()


def test_int8_runs_on_openvino_and_the_outputs_say_how(int8: Embedder) -> None:
    meta = int8.info.as_metadata()
    assert (int8.engine, meta["precision"], meta["engine"]) == ("openvino", "int8", "openvino")
    assert meta["calibration"] == openvino_engine.RECIPE
    fp32 = Embedder.load("default", "fp32", "cpu")
    try:
        assert (fp32.info.engine, fp32.info.as_metadata()["calibration"]) == ("torch", "")
    finally:
        fp32.close()


def test_a_cached_model_is_not_converted_again(
    int8: Embedder, cache_home: Path, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (folder,) = cache_home.iterdir()
    assert (folder / "model.xml").is_file() and (folder / "model.bin").is_file()
    assert not [p for p in cache_home.iterdir() if p.name.startswith(".converting")]

    def no_conversion(*_args: object) -> None:
        raise AssertionError("converted although cached")

    monkeypatch.setattr(openvino_engine, "_convert", no_conversion)
    again = Embedder.load("default", "int8", "cpu")
    try:
        np.testing.assert_array_equal(again.embed(texts), int8.embed(texts))
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["truncate-bin", "garble-xml"])
def test_a_damaged_cache_is_converted_again(
    int8: Embedder, cache_home: Path, texts: list[str], damage: str
) -> None:
    (folder,) = cache_home.iterdir()
    # Damaged as a worker that is not running would find it: replaced, not written in
    # place (the running model maps the file; a file cut under a mapping is SIGBUS).
    name, damaged = (
        ("model.bin", (folder / "model.bin").read_bytes()[:1000])
        if damage == "truncate-bin"
        else ("model.xml", b"<net><layers>")
    )
    (folder / "new").write_bytes(damaged)
    os.replace(folder / "new", folder / name)
    again = Embedder.load("default", "int8", "cpu")
    try:
        np.testing.assert_allclose(again.embed(texts), int8.embed(texts), atol=1e-6)
    finally:
        again.close()


def test_replicas_give_the_same_vectors(int8: Embedder, texts: list[str]) -> None:
    """Two replicas taking turns on the one infer request: the same vectors as one."""
    two = int8.with_replicas(2)
    try:
        assert cosine_rows(two.embed(texts), int8.embed(texts)).min() > 0.99999
    finally:
        two.close()


def test_workers_converting_at_once_share_one_cached_model(empty_cache: Path) -> None:
    """Two processes on an empty cache: both load, one model folder is left."""
    code = (
        "from pipeline.model.embedder import Embedder;"
        "e = Embedder.load('default', 'int8', 'cpu'); print(e.embed(['a test']).shape)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    for proc in started:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert b"(1, 384)" in out
    assert [p.name for p in empty_cache.iterdir() if p.is_dir()] and all(
        not p.name.startswith(".converting") for p in empty_cache.iterdir()
    )
    assert len(list(empty_cache.iterdir())) == 1


def test_int8_is_for_the_cpu_and_openvino_for_fp32_and_int8() -> None:
    with pytest.raises(ModelError, match="runs on the CPU only"):
        _check_precision("int8", "cuda", "openvino")
    with pytest.raises(ModelError, match="runs fp32 and int8, not bf16"):
        _check_precision("bf16", "cpu", "openvino")
    with pytest.raises(ModelError, match="int8 runs on the OpenVINO engine"):
        _check_precision("int8", "cpu", "torch")


def test_no_telemetry_without_consent(tmp_path: Path) -> None:
    """OpenVINO's converter and NNCF would send usage statistics where no consent file
    says no: a worker converting a model sends none, and writes no client id."""
    code = (
        "from pipeline.model.embedder import Embedder;"
        "Embedder.load('default', 'int8', 'cpu');"
        "import openvino_telemetry, nncf.telemetry.wrapper as w;"
        "print(openvino_telemetry.Telemetry().consent, w.telemetry._impl.consent)"
    )
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI", "NNCF_DEV")},
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.split() == [b"False", b"False"]
    assert not (tmp_path / "intel").exists()
