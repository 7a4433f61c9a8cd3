"""Tokenizing in a child process: the same ids as in the worker's own process, and
a child that dies ends the worker with one line, nothing committed past the outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from consumers.tokenize_process import TokenizerPool, TokenizerProcess
from pipeline.core.errors import PipelineError
from pipeline.core.records import GoodRecord, RecordParser, SourceRecord
from pipeline.model.embedder import Embedder
from tests.helpers import (
    REPO,
    committed_offsets,
    corpus_records,
    duplicates,
    index_rows,
    output_rows,
    publish_raw,
    run_until_end,
    start_worker,
    worker_args,
    worker_env,
)
from tests.test_wordpiece import _SPECIALS, ascii_fuzz, unicode_fuzz


def start_child(embedder: Embedder) -> TokenizerProcess:
    child = TokenizerProcess.start(
        embedder.tokenizer_json(),
        embedder.info.max_length,
        prompt=embedder.info.document_prompt or "",
    )
    assert child is not None
    return child


def child_ids(child: TokenizerProcess, texts: list[str]) -> tuple[list[str], list[Any], int]:
    """What the worker does with a poll of records holding these texts: the texts the
    child's parse keeps (blank ones are bad records), their ids and how many were
    truncated (the child tokenizes what its fast path leaves with the Rust tokenizer)."""
    values = [json.dumps({"text": text}, ensure_ascii=False).encode() for text in texts]
    child.submit_values(values)
    sources = [SourceRecord("t", 0, n, 0, None, v) for n, v in enumerate(values)]
    records, ids, truncated = child.parsed_result(sources)
    good = [r.text for r in records if isinstance(r, GoodRecord)]
    return good, ids, truncated


def test_the_child_gives_the_ids_the_worker_would(embedder: Embedder) -> None:
    child = start_child(embedder)
    try:
        prose = [r["text"] for r in corpus_records(2000)]
        long = [" ".join(prose[i : i + 40]) for i in range(0, 800, 40)]  # truncated
        batches = [
            prose,
            long,
            ascii_fuzz(500),  # control characters: the child's one-at-a-time path
            unicode_fuzz(500),  # some left to the Rust tokenizer, in the child
            [f"a {special} b" for special in _SPECIALS],
            [],
        ]
        for texts in batches:
            good, ids, truncated = child_ids(child, texts)
            assert len(good) >= 0.9 * len(texts)  # all but blank fuzz
            want = embedder.tokenize(good)
            assert [list(map(int, one)) for one in ids] == want.ids
            assert truncated == want.truncated
            assert all(isinstance(one, memoryview) for one in ids)
        assert want.truncated == 0 and embedder.tokenize(long).truncated == len(long)
    finally:
        child.close()
    assert child._child.poll() is not None  # closed: the child is gone


def test_vectors_from_the_childs_ids_equal_the_in_process_ones(embedder: Embedder) -> None:
    child = start_child(embedder)
    try:
        texts = [r["text"] for r in corpus_records(64)] + unicode_fuzz(64, seed=3)
        texts, ids, _ = child_ids(child, texts)
    finally:
        child.close()
    from pipeline.model.embedder import Tokenized

    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    vectors, _ = embedder.embed_tokens(Tokenized(ids, lengths, 0))
    np.testing.assert_allclose(vectors, embedder.embed(texts), atol=1e-5)


@pytest.mark.parametrize("bad_share", [0.0, 0.2])
def test_the_child_parses_values_as_the_worker_would(embedder: Embedder, bad_share: float) -> None:
    """Values parsed there give the records RecordParser.parse gives here (good and
    bad, in order, on the same sources), and the good ones' ids after the prompt."""
    import random

    from tests.test_worker import BAD_VALUES

    parser = RecordParser("body", "key", max_text_bytes=4096)
    prompt = "passage: "
    rng = random.Random(bad_share)
    texts = [r["text"] for r in corpus_records(300)] + unicode_fuzz(100, seed=4)
    values: list[bytes | None] = []
    for n, text in enumerate(texts):
        if rng.random() < bad_share:
            values.append(rng.choice(BAD_VALUES)[1])
        else:
            fields = {"body": text, "key": n if n % 3 else f"k{n}", "x": [n, None, 1.5]}
            values.append(json.dumps(fields, ensure_ascii=False).encode())
    sources = [SourceRecord("t", 1, n, 0, None, v) for n, v in enumerate(values)]
    child = TokenizerProcess.start(
        embedder.tokenizer_json(), embedder.info.max_length, parser, prompt
    )
    assert child is not None
    try:
        child.submit_values(values)
        records, ids, truncated = child.parsed_result(sources)
    finally:
        child.close()
    expected = [parser.parse(s) for s in sources]
    assert records == expected
    assert all(r.source is s for r, s in zip(records, sources, strict=True))
    good = [r.text for r in expected if isinstance(r, GoodRecord)]
    assert (bad_share == 0) == (len(good) == len(values))
    want = embedder.tokenize(embedder.prompted(good, prompt))
    assert [list(map(int, one)) for one in ids] == want.ids
    assert truncated == want.truncated


def test_a_pool_of_children_gives_one_childs_records_and_ids(embedder: Embedder) -> None:
    """Several children, a slice of the poll each: the same records, in order, the
    same ids and truncation count as one child, also for polls smaller than the pool."""
    from tests.test_worker import BAD_VALUES

    texts = [r["text"] for r in corpus_records(200)] + unicode_fuzz(50, seed=6)
    values: list[bytes | None] = [json.dumps({"text": t}).encode() for t in texts]
    values[5::37] = [bad for _, bad in BAD_VALUES[: len(values[5::37])]]
    values.append(json.dumps({"text": " ".join(texts[:60])}).encode())  # truncated
    args = (embedder.tokenizer_json(), embedder.info.max_length)
    one, pool = TokenizerPool(1, *args), TokenizerPool(3, *args)
    try:
        assert one.ready() and pool.ready() and len(pool) == 3
        first = None
        for poll in (values, values[:2], []):
            sources = [SourceRecord("t", 0, n, 0, None, v) for n, v in enumerate(poll)]
            results = []
            for children in (one, pool):
                children.submit_values(poll)
                results.append(children.parsed_result(sources))
            (records, ids, cut), (pool_records, pool_ids, pool_cut) = results
            assert pool_records == records and cut == pool_cut
            assert [bytes(i) for i in pool_ids] == [bytes(i) for i in ids]
            first = first or (records, cut)
        assert first is not None
        records, cut = first
        assert cut == 1 and len(records) == len(values)
        assert sum(not isinstance(r, GoodRecord) for r in records) == len(values[5:-1:37])
    finally:
        one.close()
        pool.close()


def test_a_tokenizer_without_the_fast_path_runs_on_the_rust_tokenizer_there() -> None:
    other = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    other.normalizer = normalizers.Lowercase()
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.enable_truncation(3)
    child = TokenizerProcess.start(other.to_str(), 3)
    try:
        texts = ["A b c", "b", "a a a a a"]
        good, ids, truncated = child_ids(child, texts)
    finally:
        child.close()
    assert good == texts
    assert [list(map(int, one)) for one in ids] == [e.ids for e in other.encode_batch(texts)]
    assert [list(map(int, one)) for one in ids] == [[1, 2, 0], [2], [1, 1, 1]]
    assert truncated == 1


def test_the_rust_tokenizer_in_the_child_gives_the_fast_paths_ids(embedder: Embedder) -> None:
    """PIPELINE_TOKENIZER=rust: the child tokenizes every text with the Rust tokenizer."""
    texts = [r["text"] for r in corpus_records(300)] + unicode_fuzz(100, seed=5)
    results = []
    for fast_path in (True, False):
        child = TokenizerProcess.start(
            embedder.tokenizer_json(), embedder.info.max_length, fast_path=fast_path
        )
        try:
            results.append(child_ids(child, texts))
        finally:
            child.close()
    (good, fast_ids, fast_cut), (good_again, rust_ids, rust_cut) = results
    assert good == good_again
    assert [bytes(one) for one in fast_ids] == [bytes(one) for one in rust_ids]
    assert fast_cut == rust_cut


def test_a_child_that_dies_is_one_clear_error(embedder: Embedder) -> None:
    child = start_child(embedder)
    try:
        os.kill(child._child.pid, signal.SIGKILL)
        child._child.wait(timeout=10)
        with pytest.raises(PipelineError, match=r"tokenizer process .*exited with code -9"):
            child_ids(child, ["a text"])
    finally:
        child.close()


def test_the_child_leaves_interrupts_to_the_worker(embedder: Embedder) -> None:
    """Ctrl-C or a unit's stop reaches every process of the group: the worker drains,
    and needs the child for the poll it has out."""
    child = start_child(embedder)
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.kill(child._child.pid, signum)
        time.sleep(0.5)
        _, ids, _ = child_ids(child, ["still here"])
        assert [list(map(int, one)) for one in ids] == embedder.tokenize(["still here"]).ids
    finally:
        child.close()


# -- in the worker, against the real broker -------------------------------------------


def _mixed_items(count: int) -> list[tuple[bytes | None, bytes | None]]:
    """English, Chinese and mixed texts, special tokens, and bad records among them."""
    texts = [r["text"] for r in corpus_records(count)]
    texts[1::5] = unicode_fuzz(len(texts[1::5]), seed=21)
    texts[2::17] = [f"see [MASK] {t}" for t in texts[2::17]]
    items: list[tuple[bytes | None, bytes | None]] = []
    for i, text in enumerate(texts):
        value = json.dumps({"id": f"r{i}", "text": text}, ensure_ascii=False).encode()
        items.append((None, b"not json" if i % 97 == 5 else value))
    return items


def _published(
    broker: str, topic: str, count: int, partitions: int
) -> tuple[str, list[tuple[bytes | None, bytes | None]]]:
    items = _mixed_items(count)
    publish_raw(broker, topic, items, partitions=partitions)
    return topic, items


def _good(items: list[tuple[bytes | None, bytes | None]], partitions: int) -> list[int]:
    """The indices of the items the parser takes (the others are dead-lettered)."""
    parser = RecordParser()
    return [
        i
        for i, (key, value) in enumerate(items)
        if isinstance(
            parser.parse(SourceRecord("t", i % partitions, i // partitions, 0, key, value)),
            GoodRecord,
        )
    ]


def _vectors(output: Path) -> dict[tuple[int, int], np.ndarray]:
    found = {}
    for path in (output / "vectors").glob("*.parquet"):
        table = pq.read_table(path, columns=["partition", "offset", "embedding"])
        for row in table.to_pylist():
            found[(row["partition"], row["offset"])] = np.asarray(row["embedding"])
    return found


@pytest.mark.integration
def test_the_worker_writes_the_same_vectors_with_and_without_the_child(
    broker, make_topic, group_id, tmp_path
):
    topic, items = _published(broker, make_topic(partitions=2), 600, 2)
    outputs = {}
    for choice in ("on", "off"):
        out = tmp_path / choice
        result = run_until_end(
            broker, topic, f"{group_id}-{choice}", out,
            "--batch-size", "50", "--tokenizer-process", choice,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        said = "tokenizer process: on" in result.stderr
        assert said == (choice == "on"), result.stderr
        assert committed_offsets(broker, f"{group_id}-{choice}", topic) == {0: 300, 1: 300}
        outputs[choice] = _vectors(out)
    assert len(outputs["on"]) == len(_good(items, 2))  # the bad ones dead-lettered
    assert outputs["on"].keys() == outputs["off"].keys()
    for position, vector in outputs["on"].items():
        np.testing.assert_allclose(vector, outputs["off"][position], atol=1e-5)


def _child_of(pid: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = subprocess.run(
            ["pgrep", "-P", str(pid), "-f", "consumers.tokenize_process"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        if found:
            return int(found[0])
        time.sleep(0.2)
    raise AssertionError("the worker started no tokenizer process")


@pytest.mark.integration
def test_a_killed_tokenizer_process_stops_the_worker_and_a_restart_loses_nothing(
    broker, make_topic, group_id, tmp_path
):
    topic, items = _published(broker, make_topic(partitions=3), 3000, 3)
    out, log = tmp_path / "out", tmp_path / "worker.log"
    worker = start_worker(
        broker, topic, group_id, out,
        "--batch-size", "20", "--tokenizer-process", "on", "--index-sync-interval-s", "1",
        log=log,
    )  # fmt: skip
    try:
        child = _child_of(worker.pid)
        deadline = time.monotonic() + 120
        while not output_rows(out) and time.monotonic() < deadline:
            time.sleep(0.2)  # mid-run: some batches written, most to come
        os.kill(child, signal.SIGKILL)
        code = worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    said = log.read_text()
    assert code != 0, said
    assert "tokenizer process exited with code -9" in said
    assert "Traceback" not in said
    written = len(output_rows(out))
    assert 0 < written < 3000 - 31

    result = run_until_end(broker, topic, group_id, out, "--batch-size", "200")

    assert result.returncode == 0, result.stderr
    rows = output_rows(out)
    assert duplicates(rows) == []
    expected = {(topic, i % 3, i // 3) for i in _good(items, 3)}
    assert set(rows) == expected
    assert sorted(index_rows(out)) == sorted(rows)


@pytest.mark.integration
def test_a_signal_to_the_whole_process_group_drains_the_worker(
    broker, make_topic, group_id, tmp_path
):
    """Ctrl-C, or a service manager stopping the unit, signals the child too: the
    worker still drains and exits 0 (the child leaves such signals to it)."""
    topic, items = _published(broker, make_topic(partitions=2), 3000, 2)
    out = tmp_path / "out"
    args = worker_args(topic, group_id, out, "--batch-size", "20", "--tokenizer-process", "on")
    worker = subprocess.Popen(
        args, env=worker_env(broker), cwd=REPO, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _child_of(worker.pid)
        deadline = time.monotonic() + 120
        while not output_rows(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(worker.pid, signal.SIGINT)
        said, _ = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, said
    assert "tokenizer process exited" not in said and "Traceback" not in said
    assert "finishing the batches in flight" in said

    result = run_until_end(broker, topic, group_id, out, "--batch-size", "200")

    assert result.returncode == 0, result.stderr
    rows = output_rows(out)
    assert duplicates(rows) == []
    assert set(rows) == {(topic, i % 2, i // 2) for i in _good(items, 2)}


def test_split_special_tokens_reaches_the_child(tiny_model: str, tmp_path: Path) -> None:
    """`split_special_tokens` is not in the tokenizer's serialised form: the child is told
    it, and reads a special token's text in a record as the worker's own process does."""
    import shutil

    folder = tmp_path / "split"
    shutil.copytree(tiny_model, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "split_special_tokens": True}))
    embedder = Embedder.load(str(folder), precision="fp32", device="cpu")
    assert embedder.split_special_tokens
    texts = ["a text that names [SEP] and [CLS] in its words", "[PAD] [MASK] [UNK] here"]
    child = TokenizerProcess.start(
        embedder.tokenizer_json(),
        embedder.info.max_length,
        split_special_tokens=embedder.split_special_tokens,
    )
    try:
        _, ids, _ = child_ids(child, texts)
    finally:
        child.close()
    expected = embedder.tokenize(texts).ids
    assert [list(i) for i in ids] == [list(i) for i in expected]
    specials = {embedder._fast.token_to_id(t) for t in ("[SEP]", "[CLS]", "[PAD]", "[MASK]")}
    inside = {int(t) for one in expected for t in one[1:-1]}
    assert not specials & inside  # split: none of them read as its special token
