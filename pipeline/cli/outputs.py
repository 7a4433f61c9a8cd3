"""`pipeline search`, `pipeline compact` and `pipeline index`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.main import main
from pipeline.cli.options import OUTPUT_HELP, env_option, output_option
from pipeline.core.config import (
    DEVICES,
)
from pipeline.core.model_info import SIMILARITIES

# -- search ---------------------------------------------------------------------------


@main.command()
@output_option(help=f"{OUTPUT_HELP} Its index is searched, with the model it records.")
@click.option(
    "-k",
    "k",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="How many nearest records to print (with --chunks: chunks).",
)
@click.option(
    "--chunks",
    "chunks",
    is_flag=True,
    help="In an output of chunks (pipeline run --chunk-tokens): print the nearest chunks, "
    "each on its own, rather than the best chunk of each of the nearest records.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
@env_option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Where QUERY is embedded; auto: cuda when a GPU is available, else cpu.",
)
@env_option(
    "--query-prompt",
    default=None,
    help="Prepended to QUERY [default: the query prompt recorded in the output; '' for none].",
)
@click.argument("query")
def search(
    output: Path,
    k: int,
    chunks: bool,
    as_json: bool,
    device: str,
    query_prompt: str | None,
    query: str,
) -> None:
    """Embed QUERY with the output's model and print its nearest records.

    Ranked and scored by the model's similarity as sentence-transformers computes it
    (cosine by default; dot; euclidean and manhattan: minus the distance), named in
    the JSON as `similarity`. In an output of chunks, each record's best chunk is its
    hit, with its span: `chunk` (0-based), `chunk_count`, `char_start`, `char_end` in
    the JSON; `chunk 3/12 chars 4120-5033` (1-based) in print.
    """
    from pipeline.search import search as search_index

    found = search_index(output, query, k, device, query_prompt, chunks)
    hits = found.hits
    if as_json:
        body = {"query": query, "similarity": found.similarity, "hits": hits}
        click.echo(json.dumps(body, indent=2, ensure_ascii=False))
        return
    for rank, hit in enumerate(hits, 1):
        text = " ".join(hit["text"].split())
        text = text if len(text) <= 160 else text[:157] + "..."
        span = (
            f"  chunk {hit['chunk'] + 1}/{hit['chunk_count']} chars "
            f"{hit['char_start']}-{hit['char_end']}"
            if "chunk" in hit
            else ""
        )
        click.echo(
            f"{rank:>2}. {hit['score']:.4f}  {hit['topic']}[{hit['partition']}]@"
            f"{hit['offset']}{span}  id={hit['id']}\n    {text}"
        )


# -- compact --------------------------------------------------------------------------


@main.command()
@output_option()
@click.option(
    "--target-mb",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="MiB merged files grow up to; files of half of it or more stay as they are.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be merged; change nothing.")
@click.option(
    "--purge",
    is_flag=True,
    help="Upsert mode: also erase superseded and deleted documents from every file of OUTPUT "
    "(segments, index, the current view's older versions).",
)
@click.option(
    "--view-retention-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="With --purge: versions of the current view younger than this stay readable.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
def compact(
    output: Path, target_mb: int, dry_run: bool, purge: bool, view_retention_s: float,
    as_json: bool,
) -> None:  # fmt: skip
    """Merge runs of small Parquet segments in OUTPUT into large ones.

    Safe while workers run: readers listing OUTPUT/vectors see the sources or
    the merged files, never both and never neither; ranges, restart points and
    the index do not change. In upsert mode the current view's small files are merged
    and its versions older than an hour removed too. With --purge, superseded and deleted
    documents are erased from every file; their offsets stay accounted for.
    """
    import json

    from sinks.compaction import compact as compact_output
    from sinks.compaction import settle

    if purge:
        if dry_run:
            raise click.UsageError("--purge changes files; it has no --dry-run")
        from sinks.purge import purge as purge_output

        purged = purge_output(output, target_mb << 20, view_retention_s)
        if as_json:
            click.echo(json.dumps(purged.as_dict(), indent=1, sort_keys=True))
            return
        click.echo(
            f"purged {purged.erased_rows} row(s) from {purged.rewritten_segments} segment(s); "
            f"{purged.live_documents} live document(s), {purged.index_vectors} vector(s) in "
            f"the index, {purged.seconds:.1f}s"
        )
        return

    report = compact_output(output, target_bytes=target_mb << 20, dry_run=dry_run)
    if not dry_run and isinstance(output, Path):
        settle(output)  # the old files go once readers listing them are done (seconds)
        _tidy_view(output)
    if as_json:
        click.echo(json.dumps(dict(report.as_dict(), dry_run=dry_run), indent=1, sort_keys=True))
        return
    verb = "would merge" if dry_run else "merged"
    click.echo(
        f"{verb} {report.merged_files} segment(s) into {report.runs} "
        f"({report.rows} rows): {report.files_before} -> {report.files_after} files "
        f"in {output}/vectors, {report.seconds:.1f}s"
    )
    for line in report.skipped:
        click.echo(f"skipped {line}", err=True)


def _tidy_view(output: Path) -> None:
    """Upsert mode: the current view's small files merged, old versions removed."""
    from sinks.view import ViewStore, has_view

    if has_view(output) and not ViewStore(output).maintain():
        click.echo("view: another worker holds it; its upkeep is left to that one", err=True)


# -- index ----------------------------------------------------------------------------


@main.group()
def index() -> None:
    """Manage the FAISS index of an output directory."""


@index.command("rebuild")
@output_option()
@click.option(
    "--index-type",
    type=click.Choice(["flat", "ivf", "ivf-pq"]),
    default="flat",
    show_default=True,
    help="flat: exact search; ivf / ivf-pq: trained on a sample, faster on large "
    "corpora (ivf-pq also 32x smaller; not for manhattan), recall@10 against exact search "
    "reported.",
)
@click.option(
    "--similarity",
    type=click.Choice(list(SIMILARITIES)),
    default=None,
    help="What the index ranks by [default: the similarity the output records; outputs "
    "from before it was recorded: its model's similarity_fn_name].",
)
def index_rebuild(output: Path, index_type: str, similarity: str | None) -> None:
    """Rebuild the index from the Parquet files in OUTPUT."""
    from pipeline.core.errors import IndexStateError
    from sinks.index.metric import describe as describe_similarity
    from sinks.index.store import IndexStore

    store = IndexStore(output, index_type=index_type, similarity=_similarity(output, similarity))
    count = store.rebuild()
    meta = store.meta
    recall = (
        "" if meta is None or meta.recall_at_10 is None else f", recall@10 {meta.recall_at_10:.3f}"
    )
    shards = 0 if meta is None else len(meta.shards)
    ranked = "" if meta is None else f", {describe_similarity(meta.similarity)}"
    click.echo(
        f"index rebuilt: {count} vectors ({index_type}{ranked}, {shards} file(s){recall}) "
        f"in {output}/index, {store.last_sync.seconds:.1f}s"
    )
    if store.damaged:
        for damaged in store.damaged:
            click.echo(f"warning: skipped {damaged.segment.path} ({damaged.reason})", err=True)
        raise IndexStateError(
            f"{len(store.damaged)} damaged segment(s) left out of the index, with the rest of "
            "their partitions; start a worker (pipeline run) on this output: it moves them "
            "to quarantine/, reads their records again from Kafka, and the index catches up"
        )


def _similarity(output: Path, given: str | None) -> str | None:
    """The similarity to rebuild for: `given`, else None where the segments record one
    (the store reads it), else the recorded model's own (outputs from before it was
    recorded), read from its folder's configs without loading it."""
    from pipeline.core.errors import IndexStateError, ModelError
    from sinks.identity import recorded_model

    if given is not None:
        return given
    recorded = recorded_model(output) or {}
    if recorded.get("similarity") or not recorded:
        return None
    from pipeline.model.spec import DEFAULT_MODEL_NAME, resolve_model_path
    from pipeline.model.stack import folder_similarity

    name = recorded.get("model", "default")
    try:
        return folder_similarity(
            resolve_model_path("default" if name == DEFAULT_MODEL_NAME else name)[1]
        )
    except ModelError as exc:
        raise IndexStateError(
            f"the segments of {output} do not record their similarity (written before it was "
            f"recorded) and their model is not at hand ({exc}); give --similarity, the "
            "model's similarity_fn_name (cosine when it names none)"
        ) from None


@index.command("check")
@output_option()
@click.option(
    "--recall",
    is_flag=True,
    help="Also measure recall@10 against exact search now (reads every vector once).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
def index_check(output: Path, recall: bool, as_json: bool) -> None:
    """Check the index against the Parquet files: every covered row once, nothing else.

    Exit 0 when it holds, 65 when rows are missing, extra or doubled.
    """
    import json

    from pipeline.core.errors import IndexStateError
    from sinks.index.check import check_index
    from sinks.view import ViewStore, has_view

    judged = ViewStore(output).snapshot() if has_view(output) else None  # upsert mode
    report = check_index(output, recall=recall, judged=judged)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=1, sort_keys=True))
    else:
        from sinks.index.metric import describe as describe_similarity

        noted = "" if report.recall_at_10 is None else f", recall@10 {report.recall_at_10:.3f}"
        if report.measured_recall_at_10 is not None:
            noted += f", recall@10 measured now {report.measured_recall_at_10:.3f}"
        click.echo(
            f"{report.index_type} index by {describe_similarity(report.similarity)}, "
            f"generation {report.generation}: {report.vectors} "
            f"vectors in {report.shards} file(s), {report.bytes / 1e6:.1f} MB{noted}\n"
            f"missing {report.missing}, extra {report.extra}, doubled {report.doubled}; "
            f"{report.uncovered_rows} Parquet row(s) not synced yet"
        )
    if not report.ok:
        raise IndexStateError(
            f"the index of {output} does not match its Parquet files; run: "
            f"pipeline index rebuild --output {output}"
        )
