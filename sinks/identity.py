"""The model identity of an output, and the worker's refusal to mix two.

Vectors of two models are not comparable, even at the same dimension: an index
holding both returns nonsense, silently. Every segment's footer records the model
(`embedding.*`, ModelInfo.as_metadata), and a worker starting on an output that
already holds vectors compares that record with its own model before it consumes
anything; a difference exits with one line (OutputError, exit 73) saying what
differs and what to do.

What has to match (the identity):

- the weights (`model_revision`, a hash of the safetensors files) and so the
  dimension; the model's name is shown, not compared: the same weights under
  another path or hub id make the same vectors;
- `pooling`, `normalization` and `max_length` (texts longer than it are cut);
- the document prompt (e5's "passage: "): the same text with and without it gives
  different vectors;
- the module stack (pipeline.model.stack: pooling modes, Dense and LayerNorm
  modules, normalisation), the Matryoshka truncation (and how it was stored:
  earlier releases normalised a normalising model's cut vectors again, recorded as
  `normalization` "l2"; now they are sentence-transformers' own cut,
  "l2-before-truncation"), the similarity the index searches by, and `model_identity`, a hash
  of all of it with the tokenizer's files and every module's weights
  (pipeline.model.spec): outputs written before these were recorded skip them;
- the precision's kind: int8, as it was made (`calibration`: the recipe of
  pipeline.model.openvino_engine; an int8 output of earlier releases, torch's dynamic
  quantisation, records none and is a kind of its own), against float. The gate
  admits int8 (cosine >= 0.995 to fp32), but an index of one kind answers queries
  of one: an output holds one. fp32, bf16 and fp16 of the same
  weights are one identity: `--precision auto` admits them only above a cosine of
  0.995 (measured 1.0000 mean, 0.9999 min), and the fleet of one output may well
  mix a GPU worker in bf16 with CPU workers in fp32. Each segment records its own
  precision all the same.

The query prompt is recorded (search uses it) but not compared: it changes no
stored vector.

The tokenizer as transformers builds it (`tokenizer`, ModelSpec.tokenizer_fingerprint:
a transformers upgrade may change the ids under the same files) is compared and is
part of `model_identity`. Outputs of releases before it record none: they are
compared with the identity those releases computed (ModelInfo.legacy_identity), and
the worker's own segments record the fingerprint from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.core.chunks import CHUNK, CHUNKED, FLAGGED, PLAIN, TRUNCATED, Chunking
from pipeline.core.errors import OutputError
from pipeline.core.model_info import NORMALIZED, NORMALIZED_THEN_CUT, ModelInfo

log = logging.getLogger(__name__)

META_PREFIX = "embedding."
DEFAULT_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# Compared, in the order a refusal names them. Keys an older output lacks are skipped,
# but for the document prompt: outputs before prompts were embedded without one.
COMPARED = (
    ("model_revision", "weights"),
    ("dim", "dimension"),
    ("pooling", "pooling"),
    ("normalization", "normalisation"),
    ("max_length", "max length"),
    ("document_prompt", "document prompt"),
    ("modules", "module stack"),
    ("truncate_dim", "Matryoshka dimensions"),
    # How the index compares the vectors (the model's similarity_fn_name).
    ("similarity", "similarity"),
    # The tokenizer as built (its ids), where the output recorded it.
    ("tokenizer", "tokenizer"),
    # Everything that decides a vector, hashed (tokenizer files, module weights, ...):
    # named last, it speaks for what the items above do not show.
    ("model_identity", "model identity"),
)
ABSENT_MEANS = {"document_prompt": ""}
# A worker reads at most this many footers before giving up on finding one (damaged
# or vanished segments are skipped: a worker repairs the former, compaction the latter).
_FOOTERS_TRIED = 5


def recorded_model(output: Any) -> dict[str, str] | None:
    """The model an output's vectors were made with: the `embedding.*` metadata of
    one segment's footer (the last by name), or None when the output holds none.

    The one place that reads it: one footer, through sinks.segments.read_schema
    (a local file, or one ranged GET on an object store)."""
    from pipeline.core.layout import iter_segments
    from sinks.segments import DamagedSegment, read_schema

    segments = list(iter_segments(output))
    for segment in reversed(segments[-_FOOTERS_TRIED:]):
        try:
            schema = read_schema(segment)
        except FileNotFoundError:
            continue  # merged away by a compaction meanwhile
        except (DamagedSegment, OSError, ValueError, pa.ArrowException) as exc:
            log.debug("model identity: skipping %s (%s)", segment.path, exc)
            continue
        raw = schema.metadata or {}
        found = {
            k.decode("utf-8", "replace")[len(META_PREFIX) :]: v.decode("utf-8", "replace")
            for k, v in raw.items()
            if k.startswith(META_PREFIX.encode())
        }
        if found:
            return found
    return None


def check_output_mode(output: Any, upsert: bool) -> None:
    """Refuses (OutputError) to write one write mode's segments into an output that
    holds the other's: upsert-mode segments carry the document columns
    (pipeline.core.documents), append-mode ones do not, and one output holds one kind."""
    from pipeline.core.documents import APPEND, DOC_KEY, UPSERT
    from pipeline.core.layout import describe, iter_segments
    from sinks.segments import DamagedSegment, read_schema

    for segment in reversed(list(iter_segments(output))[-_FOOTERS_TRIED:]):
        try:
            names = read_schema(segment).names
        except (FileNotFoundError, DamagedSegment, OSError, ValueError, pa.ArrowException):
            continue
        if (DOC_KEY in names) == upsert:
            return
        held, asked = (APPEND, UPSERT) if upsert else (UPSERT, APPEND)
        raise OutputError(
            f"{describe(output)} holds {held}-mode segments and this worker writes "
            f"--write-mode {asked}: one output holds one mode; give a new --output and a new "
            f"--group, or run with --write-mode {held}"
        )


def check_output_rows(output: Any, chunking: Chunking | None) -> str:
    """The row columns to write into `output` (pipeline.core.chunks): those its segments
    hold (PLAIN in outputs made before rows said what was cut); a new output's: FLAGGED,
    or CHUNKED with `chunking`. Refuses (OutputError) chunks into an output of whole
    records, whole records into a chunked one, and chunks cut otherwise than its own."""
    from pipeline.core.layout import describe, iter_segments
    from sinks.segments import DamagedSegment, read_schema

    for segment in reversed(list(iter_segments(output))[-_FOOTERS_TRIED:]):
        try:
            held = read_schema(segment)
        except (FileNotFoundError, DamagedSegment, OSError, ValueError, pa.ArrowException):
            continue
        recorded = {
            k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
            for k, v in (held.metadata or {}).items()
            if k.startswith(b"chunking.")
        }
        where = describe(output)
        if CHUNK in held.names:
            asked = chunking.as_metadata() if chunking is not None else None
            if asked == recorded:
                return CHUNKED
            made = f"--chunk-tokens {recorded.get('chunking.tokens')} --chunk-overlap " + str(
                recorded.get("chunking.overlap")
            )
            raise OutputError(
                f"{where} holds records cut into chunks with {made}: run with those, or give "
                "a new --output and a new --group"
            )
        if chunking is not None:
            raise OutputError(
                f"{where} holds whole records: chunks go to a new --output (and a new --group)"
            )
        return FLAGGED if TRUNCATED in held.names else PLAIN
    return CHUNKED if chunking is not None else FLAGGED


def differences(recorded: Mapping[str, str], model: ModelInfo) -> list[str]:
    """What differs between an output's recorded model and `model`, as phrases."""
    ours = {**model.as_metadata(), "model_identity": comparable_identity(recorded, model)}
    found = []
    for key, label in COMPARED:
        theirs = recorded.get(key, ABSENT_MEANS.get(key))
        if theirs is not None and theirs != ours[key]:
            found.append(f"{label} {_show(key, theirs)} -> {_show(key, ours[key])}")
    theirs_kind = _precision_kind(recorded.get("precision"), recorded.get("calibration"))
    ours_kind = _precision_kind(model.precision, model.calibration)
    if theirs_kind is not None and theirs_kind != ours_kind:
        found.append(f"precision {theirs_kind} -> {ours_kind}")
    return found


def comparable_identity(recorded: Mapping[str, str], model: ModelInfo) -> str:
    """`model`'s identity as the output that recorded `recorded` computed it: without
    the tokenizer fingerprint where it recorded none (an earlier release's)."""
    if "tokenizer" not in recorded and model.legacy_identity:
        return model.legacy_identity
    return model.identity


def check_output_model(output: Any, model: ModelInfo, where: str | None = None) -> None:
    """Refuses (OutputError) to add `model`'s vectors to an output made by another.

    `where` names the output in the message (default: the directory or s3:// URL)."""
    from pipeline.core.layout import describe

    check_recorded_model(recorded_model(output), model, where or describe(output))


def check_recorded_model(recorded: Mapping[str, str] | None, model: ModelInfo, where: str) -> None:
    """check_output_model on what the output records (recorded_model), read already."""
    if recorded is None:
        return
    found = differences(recorded, model)
    if not found:
        if "tokenizer" not in recorded:
            log.info(
                "output %s records no tokenizer fingerprint (an earlier release wrote it): "
                "matched on the rest of its identity; this worker's segments record %s",
                where,
                model.tokenizer or "none",
            )
        if recorded.get("precision") != model.precision:
            log.info(
                "output %s holds %s vectors; this worker adds %s ones of the same weights",
                where,
                recorded.get("precision"),
                model.precision,
            )
        return
    if _renormalised_cut(recorded, model, found):
        raise OutputError(
            f"{where} holds Matryoshka vectors normalised again after the cut to "
            f"{model.truncate_dim} dimensions, as releases before 'similarity' was recorded "
            "stored them; this release stores sentence-transformers' own (the cut of the "
            "normalised vector, not normalised again) and one output holds one kind: embed "
            "into a new --output with a new --group (docs/models.md: Matryoshka), or add to "
            "this one with the release that wrote it"
        )
    raise OutputError(
        f"{where} holds vectors of {recorded.get('model', 'another model')} and this worker "
        f"embeds with {model.name}: {'; '.join(found)}. One output holds one model's vectors: "
        f"to re-embed, give a new --output and a new --group (docs/operations.md: "
        f"re-embedding with a new model); to add to this output, run with "
        f"{_flags_for(recorded, model)}"
    )


def _flags_for(recorded: Mapping[str, str], model: ModelInfo) -> str:
    name = recorded.get("model", "its model")
    flags = f"--model {'default' if name == DEFAULT_NAME else name}"
    prompt = recorded.get("document_prompt", "")
    if prompt != model.document_prompt:
        flags += f" --document-prompt {prompt!r}"
    dimensions = recorded.get("truncate_dim", "")
    if dimensions and dimensions != str(model.truncate_dim or ""):
        flags += f" --dimensions {dimensions}"
    held = _precision_kind(recorded.get("precision"), recorded.get("calibration"))
    ours = _precision_kind(model.precision, model.calibration)
    if held is not None and held != ours:
        if recorded.get("precision") == model.precision == "int8":
            # int8 of another recipe: only the release that made it makes it.
            return f"{flags}, with the release whose int8 recipe it holds"
        flags += " --precision auto"  # auto follows the kind an output holds
    return flags


def _renormalised_cut(recorded: Mapping[str, str], model: ModelInfo, found: list[str]) -> bool:
    """Whether the same weights' vectors differ by the Matryoshka convention of earlier
    releases: a normalising model's cut vectors normalised again (recorded as "l2")."""
    return (
        bool(found)
        and recorded.get("model_revision") == model.revision
        and recorded.get("normalization") == NORMALIZED
        and model.normalization == NORMALIZED_THEN_CUT
        and recorded.get("truncate_dim", "") == str(model.truncate_dim)
    )


FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")


def _precision_kind(precision: str | None, calibration: str | None = None) -> str | None:
    """float, or int8 as it was made: an int8 output recorded before the calibration
    was (torch's dynamic quantisation) is its own kind."""
    if precision is None:
        return None
    if precision != "int8":
        return "float"
    return f"int8 ({calibration or 'torch dynamic quantisation'})"


def precision_held(recorded: Mapping[str, str] | None) -> str | None:
    """The precision an output's vectors record (`recorded_model`; None: it holds none)."""
    return None if recorded is None else recorded.get("precision")


def int8_recipe_held(recorded: Mapping[str, str] | None) -> str | None:
    """The recipe (`calibration`) an output's int8 vectors record (`recorded_model`);
    None where it holds none, or float ones."""
    if recorded is None or recorded.get("precision") != "int8":
        return None
    return recorded.get("calibration") or None


def precisions_of_kind(precision: str) -> tuple[str, ...]:
    """The precisions whose vectors may join vectors of `precision`."""
    return ("int8",) if precision == "int8" else FLOAT_PRECISIONS


def _show(key: str, value: str) -> str:
    return repr(value) if key == "document_prompt" else value
