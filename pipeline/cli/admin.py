"""`pipeline offsets reset` and `pipeline model check`."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from pipeline.cli.main import main
from pipeline.cli.options import MODEL_HELP, env_option
from pipeline.core.config import (
    DEVICES,
    PRECISIONS,
    KafkaSettings,
)

# -- offsets --------------------------------------------------------------------------


@main.group()
def offsets() -> None:
    """Manage a consumer group's committed offsets."""


@offsets.command("reset")
@env_option("--group", required=True, help="Consumer group id.")
@env_option(
    "--topic",
    "topic",
    multiple=True,
    required=True,
    help="Topic to reset (repeatable); TOPIC:0,2 for some of its partitions.",
)
@click.option("--to-earliest", is_flag=True, help="The first offset still retained.")
@click.option(
    "--to-latest", is_flag=True, help="The end (last stable offset): skip what is there now."
)
@click.option(
    "--to-datetime",
    metavar="ISO",
    default=None,
    help="The first record at or after this ISO 8601 time (no timezone means UTC), "
    "e.g. 2024-05-01T12:00:00Z; the end where there is none.",
)
@click.option(
    "--to-offset",
    type=int,
    metavar="N",
    default=None,
    help="Offset N, clamped into [earliest, end].",
)
@click.option(
    "--shift-by",
    type=int,
    metavar="N",
    default=None,
    help="The committed offset plus N (negative: back), clamped into [earliest, end]; "
    "from earliest where nothing is committed.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (each partition's current and new offset, and the change) and "
    "change nothing; also while the group has members.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="A JSON list, one object per partition (the closing line goes to stderr).",
)
@click.pass_obj
def offsets_reset(
    kafka: KafkaSettings,
    group: str,
    topic: tuple[str, ...],
    to_earliest: bool,
    to_latest: bool,
    to_datetime: str | None,
    to_offset: int | None,
    shift_by: int | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Move GROUP's committed offsets on TOPIC, like kafka-consumer-groups.sh --reset-offsets.

    Give exactly one of --to-earliest, --to-latest, --to-datetime, --to-offset,
    --shift-by. New offsets are clamped into each partition's [earliest, end]
    range (the NOTE column says where). Refused while the group has members:
    stop its workers first (--dry-run still shows the plan, and the members).
    A group that does not exist yet gets its offsets.

    A worker starts each partition past what its --output already holds; the
    committed offsets decide only where it starts a partition that output holds
    nothing of. To re-embed, reset, then run with a fresh --output (adding
    --from-committed unless the reset was to the earliest offsets).

    Exit 0 when done (or shown, with --dry-run); 75 while the group has members
    (not with --dry-run), 66 for a missing topic, 69 when no broker answers.
    """
    from pipeline.kafka import offsets as resets

    mode = resets.choose_mode(to_earliest, to_latest, to_datetime, to_offset, shift_by)
    specs = [resets.parse_topic_spec(spec) for spec in topic]
    result = resets.reset_offsets(kafka, group, specs, mode, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in result.partitions], indent=2))
        click.echo(result.summary(), err=True)
    else:
        click.echo(resets.render_table(result))
        click.echo(result.summary())


# -- model ----------------------------------------------------------------------------


@main.group()
def model() -> None:
    """Inspect the embedding model."""


@model.command("check")
@env_option("--model", default="default", show_default=True, help=MODEL_HELP)
@env_option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Where the precisions are measured; auto: cuda when a GPU is available, else cpu "
    "(the comparison with sentence-transformers runs on the CPU).",
)
@env_option(
    "--dimensions",
    type=int,
    default=None,
    help="Matryoshka truncation, as for run [default: the model's own, or all].",
)
@env_option("--document-prompt", default=None, help="As for run [default: the model's own].")
@click.option(
    "--precision",
    "precisions",
    multiple=True,
    type=click.Choice([p for p in PRECISIONS if p != "auto"]),
    help="Precision to check (repeatable) [default: all the device supports].",
)
@click.option(
    "--samples",
    type=click.IntRange(min=20),
    default=512,
    show_default=True,
    help="Sample texts each precision embeds (English paragraphs from the stdlib).",
)
@click.option(
    "--min-cosine",
    type=float,
    default=0.995,
    show_default=True,
    help="Gate: the mean cosine to fp32's vectors a precision needs to pass.",
)
@click.option(
    "--min-recall",
    type=float,
    default=0.95,
    show_default=True,
    help="Gate: the neighbour recall@10 against fp32 a precision needs to pass.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
def model_check(
    model: str,
    device: str,
    dimensions: int | None,
    document_prompt: str | None,
    precisions: tuple[str, ...],
    samples: int,
    min_cosine: float,
    min_recall: float,
    as_json: bool,
) -> None:
    """What the worker will run for a model, its vectors against sentence-transformers'
    (where installed), and each precision against fp32: cosine, recall@10, texts/s.
    Exit 1 where the vectors differ from sentence-transformers'."""
    from dataclasses import asdict

    from pipeline.core.corpus import sample_texts
    from pipeline.model import check
    from pipeline.model.embedder import Embedder
    from pipeline.model.precision import Gate, check_precisions, choose, remember
    from pipeline.model.spec import ModelSpec

    spec = ModelSpec.read(model, document_prompt, None, dimensions)
    plan = check.plan(spec)
    if not as_json:
        click.echo("\n".join(check.render_plan(plan)))
    texts = sample_texts(samples)
    parity = None
    if check.reference_available():
        embedder = Embedder.load(device="cpu", spec=spec)
        try:
            parity = check.against_reference(embedder, [*texts[:59], *check.EXTRA_TEXTS])
        finally:
            embedder.close()
    if not as_json:
        click.echo(_parity_line(parity))
    gate = Gate(min_cosine, min_recall)
    reports = check_precisions(
        spec, device, texts, list(precisions) or None, gate, extra_engines=not precisions
    )
    remember(spec, reports[0].device, gate, reports)
    best = choose(reports)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": plan,
                    "sentence_transformers": None
                    if parity is None
                    else {**asdict(parity), "passed": parity.passed},
                    "gate": asdict(gate),
                    "choice": best.precision,
                    "reports": [asdict(r) for r in reports],
                },
                indent=2,
            )
        )
    else:
        _echo_precisions(reports, best, gate)
    if parity is not None and not parity.passed:
        sys.exit(1)


def _parity_line(parity: Any) -> str:
    if parity is None:
        return "parity       not checked: sentence-transformers is not installed"
    return f"parity       {parity.describe()}"


def _echo_precisions(reports: list[Any], best: Any, gate: Any) -> None:
    from pipeline.model.precision import layout_of

    click.echo(
        f"\n{'precision':<10}{'engine':<10}{'device':<8}{'cos mean':>10}{'cos min':>10}"
        f"{'recall@10':>11}{'texts/s':>10}  gate"
    )
    for r in reports:
        click.echo(
            f"{r.precision:<10}{r.engine:<10}{r.device:<8}{r.cosine_mean:>10.4f}"
            f"{r.cosine_min:>10.4f}{r.recall_at_10:>11.3f}{r.texts_per_s:>10.0f}  "
            f"{'pass' if r.passed else 'FAIL'}{'' if r.selectable else ' (compared only)'}"
        )
    click.echo(
        f"auto picks: {best.precision} on {best.engine} (gate: cosine mean >= "
        f"{gate.min_cosine_mean}, recall@10 >= {gate.min_recall_at_10}; each timed as a "
        f"worker here lays it out: {layout_of(best.device)})"
    )
