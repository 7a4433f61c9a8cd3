"""`pipeline search` ranks as `SentenceTransformer.similarity` ranks, model by model.

Models without a Normalize module (max pooling, mean pooling with a Dense head) are
searched by their own similarity (`similarity_fn_name`: cosine by default, dot,
euclidean, manhattan): the hits and their scores are sentence-transformers' own over
the same texts. Matryoshka vectors are stored as sentence-transformers stores them
(cut, not normalised again). Outputs and indexes of earlier releases keep working
where they can, and are refused in one line where they cannot.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import IndexStateError, OutputError
from pipeline.core.layout import INDEX_META_FILE, SegmentKey, index_dir, iter_segments
from pipeline.core.records import GoodRecord, SourceRecord
from pipeline.model.embedder import Embedder
from pipeline.model.spec import ModelSpec
from pipeline.search import search
from sinks.index.store import IndexStore
from sinks.parquet import ParquetSink
from tests import model_zoo

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

SIMILARITIES = ["cosine", "dot", "euclidean", "manhattan"]
K = 10
QUERIES = 12


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("zoo")
    return lambda name: model_zoo.build(name, root)


@pytest.fixture(scope="module")
def texts() -> tuple[list[str], list[str]]:
    """300 texts to search and queries apart from them, no two alike."""
    from pipeline.core.corpus import sample_texts

    distinct = list(dict.fromkeys(sample_texts(420)))
    return distinct[:300], distinct[300 : 300 + QUERIES]


def with_similarity(folder: Path, root: Path, similarity: Any) -> Path:
    """A copy of the model folder naming `similarity` (None: the key removed)."""
    copy = root / f"{folder.name}-{similarity}"
    if not copy.exists():
        shutil.copytree(folder, copy)
    path = copy / model_zoo.ST_CONFIG_NAME
    config = json.loads(path.read_text())
    config.pop("similarity_fn_name", None)
    if similarity is not None:
        config["similarity_fn_name"] = similarity
    path.write_text(json.dumps(config))
    return copy


def reference(folder: Path, **kwargs: Any) -> Any:
    return st.SentenceTransformer(str(folder), device="cpu", local_files_only=True, **kwargs)


def embed_into(output: Path, folder: Path, corpus: list[str], **kwargs: Any) -> np.ndarray:
    """An output holding the pipeline's vectors of `corpus` (offsets 0..n-1), indexed as a
    worker indexes it; returns the vectors."""
    embedder = Embedder.load(str(folder), "fp32", "cpu", **kwargs)
    try:
        vectors = embedder.embed(corpus)
        sink = ParquetSink(output, embedder.info)
        sink.prepare()
        records = [
            GoodRecord(SourceRecord("t", 0, o, 0, None, b"{}"), text, None, None)
            for o, text in enumerate(corpus)
        ]
        staged = sink.stage(SegmentKey("t", 0, 0), len(corpus) - 1, records, vectors, len(corpus))
        assert sink.publish(staged)
    finally:
        embedder.close()
    IndexStore(output).sync()
    return vectors


def top(scores: np.ndarray, k: int = K) -> list[int]:
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]


@pytest.fixture
def cli() -> Iterator[Callable[..., Any]]:
    from click.testing import CliRunner

    from pipeline import cli as pipeline_cli

    yield lambda *args: CliRunner().invoke(pipeline_cli.main, list(args))


# ------------------------------------------------------------------ the model's similarity


@pytest.mark.parametrize("named", [*SIMILARITIES, None, "maxsim"])
def test_the_similarity_is_read_as_sentence_transformers_reads_it(
    named: str | None, zoo: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = with_similarity(zoo("bert-max"), tmp_path, named)
    info = ModelSpec.read(str(folder)).info("fp32", "cpu")
    assert info.similarity == reference(folder).similarity_fn_name
    assert info.as_metadata()["similarity"] == info.similarity
    assert info.similarity == (named if named in SIMILARITIES else "cosine")


def test_a_plain_hugging_face_folder_compares_by_cosine(zoo: Callable[[str], Path]) -> None:
    assert ModelSpec.read(str(zoo("bert-plain"))).info("fp32", "cpu").similarity == "cosine"


# ------------------------------------------------------------------ search


@pytest.mark.parametrize("similarity", SIMILARITIES)
@pytest.mark.parametrize("name", ["bert-max", "bert-dense-residual"])
def test_search_ranks_and_scores_as_sentence_transformers(
    name: str,
    similarity: str,
    zoo: Callable[[str], Path],
    texts: tuple[list[str], list[str]],
    tmp_path: Path,
) -> None:
    """Max pooling, and mean pooling under a Dense head: no Normalize module."""
    corpus, queries = texts
    folder = with_similarity(zoo(name), tmp_path, similarity)
    output = tmp_path / "out"
    embed_into(output, folder, corpus)
    data = json.loads((index_dir(output) / INDEX_META_FILE).read_text())
    assert data["similarity"] == data["model"]["similarity"] == similarity
    model = reference(folder)
    assert model.similarity_fn_name == similarity
    expected = model.similarity(model.encode(queries), model.encode(corpus)).numpy()
    for query, scores in zip(queries, expected, strict=True):
        found = search(output, query, K, device="cpu")
        assert found.similarity == similarity
        assert [hit["offset"] for hit in found.hits] == top(scores)
        assert [hit["text"] for hit in found.hits] == [corpus[i] for i in top(scores)]
        got = [hit["score"] for hit in found.hits]
        np.testing.assert_allclose(got, scores[top(scores)], rtol=1e-4, atol=1e-4)


def test_the_check_sees_a_raw_inner_product(
    zoo: Callable[[str], Path], texts: tuple[list[str], list[str]]
) -> None:
    """Without the model's cosine (the inner product of earlier releases) the neighbours
    differ: the test above would fail on it."""
    corpus, queries = texts
    model = reference(zoo("bert-max"))
    documents, asked = model.encode(corpus), model.encode(queries)
    cosine, raw = model.similarity(asked, documents).numpy(), asked @ documents.T
    shared = [len(set(top(c)) & set(top(r))) / K for c, r in zip(cosine, raw, strict=True)]
    assert np.mean(shared) < 0.9


def test_search_json_names_the_similarity(
    zoo: Callable[[str], Path],
    texts: tuple[list[str], list[str]],
    tmp_path: Path,
    cli: Callable[..., Any],
) -> None:
    corpus, queries = texts
    folder = with_similarity(zoo("bert-max"), tmp_path, "euclidean")
    embed_into(tmp_path / "out", folder, corpus[:50])
    result = cli("search", "--output", str(tmp_path / "out"), "-k", "3", "--json", queries[0])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["similarity"] == "euclidean"
    assert all(hit["score"] <= 0 for hit in found["hits"])  # minus a distance


# ------------------------------------------------------------------ Matryoshka


@pytest.mark.parametrize("name", ["bert-matryoshka", "bert-mean-normalize", "bert-max"])
def test_matryoshka_vectors_are_sentence_transformers_own_in_value_and_norm(
    name: str, zoo: Callable[[str], Path], texts: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    corpus, queries = texts
    folder = zoo(name)
    output = tmp_path / "out"
    stored = embed_into(output, folder, corpus[:120], dimensions=8)
    model = reference(folder, truncate_dim=8)
    expected = model.encode(corpus[:120])
    assert stored.shape == expected.shape == (120, 8)
    np.testing.assert_allclose(stored, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        np.linalg.norm(stored, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-5
    )
    (segment,) = list(iter_segments(output))
    meta = pq.read_schema(segment.path).metadata
    normalised = ModelSpec.read(str(folder)).stack.normalized
    assert meta[b"embedding.normalization"] == (b"l2-before-truncation" if normalised else b"none")
    # Searched by the model's cosine of the cut vectors, as sentence-transformers compares them.
    scores = model.similarity(model.encode(queries[:3]), expected).numpy()
    for query, row in zip(queries[:3], scores, strict=True):
        assert [hit["offset"] for hit in search(output, query, K, device="cpu").hits] == top(row)


# ------------------------------------------------------------------ earlier releases


def as_earlier_release(output: Path) -> None:
    """The output as releases before similarities were recorded left it: no
    `embedding.similarity` in the segments, none in index.json."""
    for segment in iter_segments(output):
        table = pq.read_table(segment.path)
        metadata = dict(table.schema.metadata)
        metadata.pop(b"embedding.similarity")
        pq.write_table(table.replace_schema_metadata(metadata), segment.path)
    path = index_dir(output) / INDEX_META_FILE
    data = json.loads(path.read_text())
    del data["similarity"]
    del data["model"]["similarity"]
    path.write_text(json.dumps(data))


def test_an_earlier_index_of_a_normalising_model_is_searched_as_it_is(
    zoo: Callable[[str], Path], texts: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    corpus, queries = texts
    output = tmp_path / "out"
    embed_into(output, zoo("bert-mean-normalize"), corpus[:100])
    as_earlier_release(output)
    model = reference(zoo("bert-mean-normalize"))
    scores = model.similarity(model.encode(queries[:1]), model.encode(corpus[:100])).numpy()[0]
    found = search(output, queries[0], K, device="cpu")
    assert found.similarity == "cosine"
    assert [hit["offset"] for hit in found.hits] == top(scores)


def test_an_earlier_index_of_a_model_without_normalize_is_refused_until_rebuilt(
    zoo: Callable[[str], Path],
    texts: tuple[list[str], list[str]],
    tmp_path: Path,
    cli: Callable[..., Any],
) -> None:
    corpus, queries = texts
    output = tmp_path / "out"
    embed_into(output, zoo("bert-max"), corpus)
    as_earlier_release(output)
    with pytest.raises(IndexStateError) as refused:
        search(output, queries[0], K, device="cpu")
    message = str(refused.value)
    assert "\n" not in message and f"pipeline index rebuild --output {output}" in message
    assert "cosine" in message
    # The rebuild reads the similarity from the model the segments name.
    result = cli("index", "rebuild", "--output", str(output))
    assert result.exit_code == 0, result.output
    assert "cosine" in result.output
    model = reference(zoo("bert-max"))
    scores = model.similarity(model.encode(queries[:1]), model.encode(corpus)).numpy()[0]
    assert [hit["offset"] for hit in search(output, queries[0], K, device="cpu").hits] == top(
        scores
    )


def test_a_rebuild_without_the_model_at_hand_asks_for_the_similarity(
    zoo: Callable[[str], Path],
    texts: tuple[list[str], list[str]],
    tmp_path: Path,
    cli: Callable[..., Any],
) -> None:
    folder = tmp_path / "moved-away"
    shutil.copytree(zoo("bert-max"), folder)
    output = tmp_path / "out"
    embed_into(output, folder, texts[0][:40])
    as_earlier_release(output)
    shutil.rmtree(folder)
    result = cli("index", "rebuild", "--output", str(output))
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if "similarity" in line]
    assert errors and "--similarity" in errors[0]
    result = cli("index", "rebuild", "--output", str(output), "--similarity", "dot")
    assert result.exit_code == 0, result.output
    assert json.loads((index_dir(output) / INDEX_META_FILE).read_text())["similarity"] == "dot"


def test_ivf_pq_for_a_manhattan_model_is_refused_in_one_line(
    zoo: Callable[[str], Path],
    texts: tuple[list[str], list[str]],
    tmp_path: Path,
    cli: Callable[..., Any],
) -> None:
    folder = with_similarity(zoo("bert-max"), tmp_path, "manhattan")
    output = tmp_path / "out"
    embed_into(output, folder, texts[0])
    result = cli("index", "rebuild", "--output", str(output), "--index-type", "ivf-pq")
    assert result.exit_code != 0
    assert "cannot search by manhattan" in result.output


def test_a_worker_does_not_add_to_matryoshka_vectors_normalised_again(
    zoo: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier releases normalised a normalising model's cut vectors again and recorded
    them as "l2": this release's vectors of the same model are not those."""
    from sinks import identity

    info = ModelSpec.read(str(zoo("bert-matryoshka"))).info("fp32", "cpu")
    earlier = {**info.as_metadata(), "normalization": "l2"}
    del earlier["similarity"]
    monkeypatch.setattr(identity, "recorded_model", lambda output: earlier)
    with pytest.raises(OutputError) as refused:
        identity.check_output_model(tmp_path, info, "the output")
    message = str(refused.value)
    assert "\n" not in message and "normalised again" in message and "new --output" in message
    assert refused.value.exit_code == 73
    # Without a truncation, or for a model that does not normalise, nothing changed.
    full = ModelSpec.read(str(zoo("bert-mean-normalize"))).info("fp32", "cpu")
    before = {k: v for k, v in full.as_metadata().items() if k != "similarity"}
    monkeypatch.setattr(identity, "recorded_model", lambda output: before)
    identity.check_output_model(tmp_path, full, "the output")
