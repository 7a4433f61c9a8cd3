"""The lag monitor behind `pipeline status`.

`collect_status` reads, for one consumer group, the committed offset and the
end offset of every partition of its topics, the group's state and members, the
dead-letter topic's size and (with an output directory) what the worker wrote,
and returns one JSON-able dict; `render_table` is its human form and `watch`
refreshes it every few seconds. Verdicts and their exit codes (OK 0, LAGGING 1,
STALLED 2, STOPPED 3, MISMATCH 4) are described in `pipeline.status.verdicts`.

One module per concern:

    verdicts     verdicts, exit codes, rates and ETA (pure)
    history      StatusHistory: samples kept between refreshes
    kafka_reads  what is read from Kafka, through pipeline.kafka.cluster, fast
    outputs      what the output directory says per partition
    collect      collect_status: one report
    render       render_table: its human form
    watcher      watch: refreshes until Ctrl-C
"""

from pipeline.status.collect import collect_status
from pipeline.status.history import StatusHistory
from pipeline.status.kafka_reads import DEFAULT_TIMEOUT_S
from pipeline.status.render import render_table
from pipeline.status.verdicts import (
    IDLE_STATES,
    LAGGING,
    MISMATCH,
    OK,
    STALLED,
    STOPPED,
    VERDICTS,
    Point,
    commit_rate,
    drain_eta,
    end_rate,
    exit_code_for,
    judge_partition,
    partition_lag,
    worst,
)
from pipeline.status.watcher import watch

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "IDLE_STATES",
    "LAGGING",
    "MISMATCH",
    "OK",
    "STALLED",
    "STOPPED",
    "VERDICTS",
    "Point",
    "StatusHistory",
    "collect_status",
    "commit_rate",
    "drain_eta",
    "end_rate",
    "exit_code_for",
    "judge_partition",
    "partition_lag",
    "render_table",
    "watch",
    "worst",
]
