"""The pipeline's vectors against sentence-transformers' own, model by model.

For every architecture family, module stack and tokenizer setting in
tests/model_zoo.py (random-weight models built here, no network): the pipeline's
vectors equal `SentenceTransformer(folder).encode(texts, prompt=<the document
prompt>)` row by row at fp32, in value and in norm (pipeline.model.check.compare:
values and norms within 1e-4, cosine >= 0.9999), texts past the model's limit
included, and stay within the precision gate at the reduced precisions; every
module or option the pipeline does not reproduce is refused with one line naming
it. Then the same through a real worker (`pipeline run --until-end`), and the
multilingual model as a real one beyond the default.

The reference is sentence-transformers REFERENCE_VERSION (pinned in pyproject.toml;
docs/models.md says which versions give the same vectors): the pipeline mirrors
its specifics (texts not stripped, a prompt's length less a trailing special token).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ConfigError, ModelError
from pipeline.model import check
from pipeline.model.embedder import TOKENIZER_ENV, Embedder
from pipeline.model.precision import DEFAULT_MIN_COSINE
from pipeline.model.spec import ModelSpec
from pipeline.model.tokenize import fast_path
from tests import model_zoo
from tests.helpers import publish_json, run_until_end

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

PARITY = check.PARITY_MIN_COSINE
REFERENCE_VERSION = "6.3.0"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("zoo")
    return lambda name: model_zoo.build(name, root)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return model_zoo.texts(extra=30)


def reference(folder: Path, texts: list[str], prompt: str, truncate_dim: int | None = None) -> Any:
    model = st.SentenceTransformer(
        str(folder), device="cpu", local_files_only=True, truncate_dim=truncate_dim
    )
    return model.encode(texts, prompt=prompt, convert_to_numpy=True, show_progress_bar=False)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    assert a.shape == b.shape
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def assert_equal_vectors(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal at fp32: values, norms and cosines (pipeline.model.check.compare)."""
    found = check.compare(got, np.asarray(expected))
    assert found.passed, f"{found.failures()}: {found.summary()}"


def test_the_reference_is_the_pinned_version() -> None:
    """The tests hold the pipeline to one sentence-transformers release: the one
    installed, the one pyproject.toml pins."""
    assert st.__version__ == REFERENCE_VERSION
    pins = re.findall(r'"sentence-transformers([^"]*)"', (REPO / "pyproject.toml").read_text())
    assert pins and set(pins) == {f"=={REFERENCE_VERSION}"}


@pytest.fixture
def loaded(zoo: Callable[[str], Path]) -> Iterator[Callable[..., Embedder]]:
    made: list[Embedder] = []

    def load(name: str, precision: str = "fp32", **kwargs: Any) -> Embedder:
        """A model of the zoo by name, or any folder."""
        folder = zoo(name) if name in model_zoo.CASES else name
        embedder = Embedder.load(str(folder), precision, "cpu", **kwargs)
        made.append(embedder)
        return embedder

    yield load
    for embedder in made:
        embedder.close()


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", model_zoo.ACCEPTED)
def test_vectors_equal_sentence_transformers(
    name: str, loaded: Callable[..., Embedder], texts: list[str]
) -> None:
    embedder = loaded(name)
    expected = reference(Path(embedder.info.path), texts, embedder.info.document_prompt)
    got = embedder.embed(texts)
    assert got.shape == expected.shape
    assert embedder.info.dim == expected.shape[1]
    assert_equal_vectors(got, expected)


@pytest.mark.parametrize(
    "name", ["bert-dense-identity-gelu", "bert-prompt-excluded", "xlm-roberta-unigram",
             "t5-encoder-dense", "qwen2-lasttoken-left"],
)  # fmt: skip
def test_openvino_at_fp32_equals_sentence_transformers(
    name: str, loaded: Callable[..., Embedder], texts: list[str]
) -> None:
    """The OpenVINO engine (int8's) at fp32 computes the same function: parity, as
    torch's, whatever the encoder it was converted from (native or transformers')."""
    embedder = loaded(name, "fp32", engine="openvino")
    assert embedder.engine == "openvino"
    expected = reference(Path(embedder.info.path), texts, embedder.info.document_prompt)
    assert_equal_vectors(embedder.embed(texts), expected)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize(
    "name", ["bert-dense-identity-gelu", "bert-prompt-excluded", "xlm-roberta-unigram",
             "t5-encoder-dense", "qwen2-lasttoken-left"],
)  # fmt: skip
def test_reduced_precisions_stay_within_the_gate(
    name: str, precision: str, loaded: Callable[..., Embedder], texts: list[str]
) -> None:
    embedder = loaded(name, precision)
    expected = reference(Path(embedder.info.path), texts, embedder.info.document_prompt)
    assert cosines(embedder.embed(texts), expected).min() >= DEFAULT_MIN_COSINE


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "name", ["bert-dense-identity-gelu", "bert-prompt-excluded", "xlm-roberta-unigram",
             "modernbert", "t5-encoder-dense", "qwen2-lasttoken-left"],
)  # fmt: skip
def test_on_cuda_within_the_gate(
    name: str, precision: str, zoo: Callable[[str], Path], texts: list[str]
) -> None:
    """Where a GPU is: each precision there against sentence-transformers at fp32 on
    the CPU (fp32 to parity, the half precisions within the gate)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    embedder = Embedder.load(str(zoo(name)), precision, "cuda")
    try:
        expected = reference(Path(embedder.info.path), texts, embedder.info.document_prompt)
        got = embedder.embed(texts)
    finally:
        embedder.close()
    if precision == "fp32":
        assert_equal_vectors(got, expected)
    else:
        assert cosines(got, expected).min() >= DEFAULT_MIN_COSINE


def test_the_checks_see_a_difference(loaded: Callable[..., Embedder], texts: list[str]) -> None:
    """The comparison is sharp enough: two stacks over the same weights differ."""
    mean = loaded("bert-mean-normalize").embed(texts)
    cls = loaded("bert-cls").embed(texts)
    assert cosines(mean, cls).min() < 0.99


def _wrong_stack(folder: Path, tmp_path: Path, wrong: str) -> Path:
    """A copy of `folder` that differs from it by a per-row scale alone."""
    copy = _copy(folder, tmp_path)
    if wrong == "no-normalize":
        modules = json.loads((copy / "modules.json").read_text())
        (copy / "modules.json").write_text(json.dumps(modules[:-1]))
    elif wrong == "mean-for-mean-sqrt":
        config = copy / "1_Pooling" / "config.json"
        config.write_text(config.read_text().replace("mean_sqrt_len_tokens", "mean"))
    return copy


@pytest.mark.parametrize(
    ("wrong", "right"),
    [
        ("no-normalize", "bert-mean-normalize"),
        ("mean-for-mean-sqrt", "bert-mean-sqrt"),
        ("row-scale", "bert-max"),
    ],
)
def test_the_parity_checks_see_what_a_cosine_does_not(
    wrong: str,
    right: str,
    loaded: Callable[..., Embedder],
    zoo: Callable[[str], Path],
    texts: list[str],
    tmp_path: Path,
) -> None:
    """A stack that differs from the model's by a factor per row (a missing Normalize,
    mean pooling for mean_sqrt_len_tokens, any scale) has the reference's cosines to
    the last digit: the comparison of values and norms, and `pipeline model check`,
    report it."""
    model = loaded(right)
    scale = 1 + 1e-3 * (np.arange(len(texts)) % 3 + 1)

    def scaled(batch: list[str]) -> np.ndarray:
        return model.embed(batch) * scale[: len(batch), None]

    embed = (
        scaled
        if wrong == "row-scale"
        else loaded(str(_wrong_stack(zoo(right), tmp_path, wrong))).embed
    )
    expected = reference(zoo(right), texts, "")
    found = check.compare(embed(texts), expected)
    assert found.cosine_min >= PARITY  # cosines alone: equal
    assert not found.passed and any("norms differ" in f for f in found.failures())
    parity = check.against_reference(SimpleNamespace(spec=model.spec, embed=embed), texts[:4])
    assert not parity.passed and parity.cosine_min >= PARITY
    assert "DIFFERENT (" in parity.describe() and "norms differ" in parity.describe()


def test_lower_casing_is_what_makes_the_legacy_case_equal(
    loaded: Callable[..., Embedder], texts: list[str], zoo: Callable[[str], Path]
) -> None:
    """do_lower_case in an old sentence_bert_config.json changes the ids (the tokenizer
    is cased): without it the vectors would differ."""
    embedder = loaded("bert-legacy-lower-case")
    assert embedder.spec.stack.transformer.do_lower_case
    assert embedder.info.max_length == 24
    cased = loaded("bert-cased")
    upper = ["UPPER CASE ONLY SENTENCE"]
    assert embedder.tokenize(upper).ids != cased.tokenize(upper).ids


def test_excluded_prompt_tokens_are_counted_as_sentence_transformers_counts(
    loaded: Callable[..., Embedder],
) -> None:
    embedder = loaded("bert-prompt-excluded")
    # [CLS] passage : -> 3 tokens; the trailing [SEP] of the prompt alone is not counted.
    assert embedder.excluded_tokens() == 3
    assert embedder.excluded_tokens("") == 0
    assert loaded("bert-mean-normalize").excluded_tokens("passage: ") == 0  # prompt included


@pytest.mark.parametrize("dimensions", [None, 8, 32])
def test_matryoshka_truncates_as_sentence_transformers_does(
    dimensions: int | None, loaded: Callable[..., Embedder], texts: list[str]
) -> None:
    """The first N values, in value and norm as SentenceTransformer(truncate_dim=N)
    gives them (not normalised again)."""
    embedder = loaded("bert-matryoshka", dimensions=dimensions)
    wanted = dimensions or 12  # the model's own truncate_dim
    expected = reference(Path(embedder.info.path), texts, "", truncate_dim=wanted)
    got = embedder.embed(texts)
    assert got.shape == (len(texts), wanted) == expected.shape
    assert_equal_vectors(got, expected)
    if wanted < 32:
        assert embedder.info.truncate_dim == wanted
    else:
        assert embedder.info.truncate_dim is None  # all of it: no truncation at all


# ------------------------------------------------------------------ tokenizer settings


@pytest.mark.parametrize(
    ("name", "fast_path_serves"),
    [
        ("bert-truncate-left", False),  # the fast path cuts on the right alone
        ("bert-truncate-left-2048", False),
        ("roberta-truncate-left", False),  # not WordPiece: the Rust tokenizer anyway
        ("bert-limit-2048", True),
        ("bert-keep-accents", True),
        ("bert-cased-strip-accents", True),
        ("bert-no-chinese-chars", True),
        ("bert-uncased-vocab-cased", True),
        ("bert-legacy-lower-case", False),  # a Lowercase normaliser in front of BERT's
    ],
)
def test_tokenizer_settings_give_the_rust_tokenizers_ids(
    name: str, fast_path_serves: bool, loaded: Callable[..., Embedder], texts: list[str]
) -> None:
    """Each setting that decides the ids is read by the fast path or leaves it: the
    ids are the Rust tokenizer's (sentence-transformers' own), texts past the model's
    limit included; their vectors are in test_vectors_equal_sentence_transformers."""
    embedder = loaded(name)
    assert (embedder._wordpiece is not None) == fast_path_serves
    got = embedder.tokenize(texts)
    want, truncated = embedder._encode(embedder.prompted(texts))
    assert got.ids == want and got.truncated == truncated > 0


def test_the_rust_tokenizer_forced_gives_the_same_vectors(
    loaded: Callable[..., Embedder], texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = loaded("bert-limit-2048")
    assert fast._wordpiece is not None
    monkeypatch.setenv(TOKENIZER_ENV, "rust")
    rust = loaded("bert-limit-2048")
    assert rust._wordpiece is None
    assert_equal_vectors(fast.embed(texts), rust.embed(texts))


def test_model_check_cuts_texts_past_the_limit_where_sentence_transformers_does(
    loaded: Callable[..., Embedder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipeline model check` adds texts past the model's own limit (2,048 here, ASCII
    and not): a fast path that cut the wrong end, as one that never read
    truncation_side did, is reported."""
    sample = model_zoo.TEXTS[:3]
    parity = check.against_reference(loaded("bert-truncate-left-2048"), sample)
    assert parity.passed, parity.describe()
    assert (parity.past_limit, parity.max_length, parity.texts) == (2, 2048, 5)
    monkeypatch.setattr(fast_path, "declined", lambda spec, max_length: None)
    monkeypatch.setattr(fast_path, "_agrees", lambda *args, **kwargs: True)
    wrong = loaded("bert-truncate-left-2048")
    assert wrong._wordpiece is not None
    parity = check.against_reference(wrong, sample)
    # Mean pooling over 2,046 tokens of like text: the cosine barely moves, the values do.
    assert not parity.passed and "values differ" in parity.describe()


def test_dimensions_beyond_the_model_are_refused(zoo: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match="--dimensions 64: the model's vectors have 32"):
        ModelSpec.read(str(zoo("bert-mean-normalize")), dimensions=64)


def test_dimensions_are_part_of_the_identity(zoo: Callable[[str], Path]) -> None:
    folder = str(zoo("bert-mean-normalize"))
    full, cut = ModelSpec.read(folder), ModelSpec.read(folder, dimensions=16)
    assert full.identity != cut.identity
    assert cut.info("fp32", "cpu").as_metadata()["truncate_dim"] == "16"
    assert cut.info("fp32", "cpu").dim == 16


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("name", model_zoo.REFUSED)
def test_what_is_not_reproduced_is_refused_in_one_line(
    name: str, zoo: Callable[[str], Path]
) -> None:
    with pytest.raises(ModelError) as refused:
        Embedder.load(str(zoo(name)), "fp32", "cpu")
    message = str(refused.value)
    assert model_zoo.CASES[name].refused in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"pooling_mode": "median"}, "median"),
        ({"pooling_mode": "mean", "mystery": 1}, "mystery"),
    ],
)
def test_an_unknown_pooling_setting_is_refused(
    edit: dict[str, Any], named: str, zoo: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy(zoo("bert-cls"), tmp_path)
    config = folder / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"embedding_dimension": 32, **edit}))
    with pytest.raises(ModelError, match=named):
        ModelSpec.read(str(folder))


def test_a_stack_that_does_not_start_with_transformer_then_pooling_is_refused(
    zoo: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy(zoo("bert-dense-tanh"), tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules[1], modules[2] = modules[2], modules[1]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelError, match="does not start with Transformer, then Pooling"):
        ModelSpec.read(str(folder))


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / folder.name))


# ------------------------------------------------------------------ a real model


def test_the_multilingual_model_equals_sentence_transformers(
    multilingual_model: str, texts: list[str]
) -> None:
    embedder = Embedder.load("multilingual-e5-small", "fp32", "cpu")
    try:
        expected = reference(Path(multilingual_model), texts, "passage: ")
        got = embedder.embed(texts)
    finally:
        embedder.close()
    assert got.shape == expected.shape == (len(texts), 384)
    assert_equal_vectors(got, expected)


# ------------------------------------------------------------------ through the worker


def stored_vectors(output: Path) -> dict[int, np.ndarray]:
    by_offset: dict[int, np.ndarray] = {}
    for path in sorted((output / "vectors").glob("*.parquet")):
        table = pq.read_table(path, columns=["offset", "embedding"])
        for offset, vector in zip(
            table["offset"].to_pylist(), table["embedding"].to_pylist(), strict=True
        ):
            assert offset not in by_offset
            by_offset[offset] = np.asarray(vector, dtype=np.float32)
    return by_offset


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("bert-prompt-excluded", ()),  # the tokenizer process, a prompt left out of pooling
        ("bert-legacy-lower-case", ()),  # lower-casing and truncation from an old config
        ("bert-dense-identity-gelu", ("--tokenizer-process", "off")),
        ("qwen2-lasttoken-left", ()),  # transformers' decoder, last token, left padding
        ("bert-matryoshka", ("--dimensions", "8")),
    ],
)
def test_worker_output_equals_sentence_transformers(
    name: str,
    extra: tuple[str, ...],
    zoo: Callable[[str], Path],
    broker: str,
    make_topic: Callable[..., str],
    group_id: str,
    tmp_path: Path,
) -> None:
    folder = zoo(name)
    corpus = model_zoo.texts(extra=300)
    topic = make_topic(partitions=1)
    publish_json(broker, topic, ({"text": t} for t in corpus))
    output = tmp_path / "out"
    done = run_until_end(broker, topic, group_id, output, "--model", str(folder), *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    vectors = stored_vectors(output)
    assert sorted(vectors) == list(range(len(corpus)))  # every offset once
    got = np.stack([vectors[i] for i in range(len(corpus))])
    spec = ModelSpec.read(
        str(folder), dimensions=int(extra[1]) if extra[:1] == ("--dimensions",) else None
    )
    expected = reference(folder, corpus, spec.prompts.document, spec.truncate_dim)
    assert_equal_vectors(got, expected)
    meta = pq.read_schema(next((output / "vectors").glob("*.parquet"))).metadata
    assert meta[b"embedding.model_identity"].decode() == spec.identity
    assert meta[b"embedding.modules"].decode() == spec.stack.describe()
    if spec.truncate_dim:
        # Search embeds the query as the output recorded: the same truncation.
        from pipeline.search import search_output

        hits = search_output(output, corpus[1], 3, device="cpu")
        assert len(hits) == 3 and hits[0]["text"] == corpus[1]


@pytest.mark.integration
def test_worker_refuses_an_unreproduced_model_at_start(
    zoo: Callable[[str], Path],
    broker: str,
    make_topic: Callable[..., str],
    group_id: str,
    tmp_path: Path,
) -> None:
    folder = zoo("refused-custom-module")
    topic = make_topic(partitions=1)
    publish_json(broker, topic, [{"text": "never embedded"}])
    started = time.monotonic()
    done = run_until_end(broker, topic, group_id, tmp_path / "out", "--model", str(folder))
    assert done.returncode == 72
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "my_package.modules.Custom" in errors[0]
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "out" / "vectors").exists() or not list(
        (tmp_path / "out" / "vectors").glob("*.parquet")
    )


# ------------------------------------------------------------------ pipeline model check


def model_check(*args: str) -> Any:
    from click.testing import CliRunner

    from pipeline import cli

    return CliRunner().invoke(cli.main, ["model", "check", "--precision", "fp32", *args])


def test_model_check_prints_the_plan_and_the_parity(zoo: Callable[[str], Path]) -> None:
    folder = zoo("bert-prompt-excluded")
    result = model_check("--model", str(folder), "--device", "cpu", "--dimensions", "16")
    assert result.exit_code == 0, result.output
    spec = ModelSpec.read(str(folder), dimensions=16)
    for line in (
        "architecture BertModel (model_type bert)",
        "encoder      native",
        f"modules      {spec.stack.describe()}",
        "pooling      mean, prompt excluded",
        "normalised   yes (L2), before the cut, as truncate_dim does",
        "similarity   cosine (search ranks by it)",
        "dimensions   16 (Matryoshka: the first of 32, not normalised again)",
        "max length   128 tokens",
        "prompts      document 'passage: ', query 'query: '",
        f"tokenizer    {spec.tokenizer_fingerprint}",
        f"identity     {spec.identity}",
        f"parity       PASS: to sentence-transformers {REFERENCE_VERSION} on 65 texts, 2 past "
        "the 128-token limit (fp32, CPU): cosine min 1.000000",
    ):
        assert line in result.output, result.output


def test_model_check_json_and_a_difference_exits_1(
    zoo: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = str(zoo("qwen2-lasttoken-left"))
    result = model_check("--model", folder, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["model"]["encoder"] == "transformers"
    assert report["model"]["pooling"] == "lasttoken" and report["model"]["padding_side"] == "left"
    assert report["sentence_transformers"]["passed"] is True
    assert report["sentence_transformers"]["cosine_min"] >= PARITY
    assert report["sentence_transformers"]["value_error"] <= check.VALUE_RTOL
    assert report["sentence_transformers"]["norm_error"] <= check.NORM_RTOL
    assert report["sentence_transformers"]["past_limit"] == 2
    # A head that pools otherwise than the model says: the check notices, exit 1.
    from pipeline.model import head

    pool = head._pool
    monkeypatch.setattr(head, "_pool", lambda h, m, mode: pool(h, m, "mean"))
    different = model_check("--model", folder, "--device", "cpu")
    assert different.exit_code == 1, different.output
    assert "parity       DIFFERENT" in different.output
