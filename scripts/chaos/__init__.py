"""Seeded chaos against a real broker: does every record land exactly once?

Each seed runs one scenario on its own topic, group and output directory:

1. publish a backlog: JSON records from kafka-python with every codec (none,
   gzip, snappy, lz4, zstd), a few bad records (invalid JSON or UTF-8, empty or
   missing text, not an object, tombstones, oversize text) that must go to the
   dead-letter topic, and, when scripts/java/ForeignProducer.java exists,
   records from the official Java producer with codecs and transactions,
   aborted ones included (`records`);
2. run a seeded schedule of events on real `pipeline run` processes while more
   records trickle in (`plans`, `fleet`): several workers starting at the same
   moment, workers joining, SIGTERM, SIGKILL at a random moment, SIGSTOP past the
   session timeout then SIGCONT, broker restarts (and a freshly wiped broker,
   `broker`), bursts from both producers, published segments damaged on disk with
   a dead host's temp file beside them;
3. finish with `pipeline run --until-end` (one or two workers, alone or beside
   running workers, sometimes through a broker restart) (`seeds`);
4. check the outputs independently of the worker (`check`): every committed record
   of the topic (read with a read_committed consumer) is in exactly one Parquet
   row, or, if it is a bad record, exactly once in the dead-letter topic (counted
   per source offset); no row or dead letter
   names an offset that holds no committed record (aborted records, transaction
   markers); the FAISS index holds every row once; the group's commits reach the
   end. `pipeline audit` runs too, and its verdict is compared with this one.

With `--write-mode upsert` every worker runs `--write-mode upsert` and the records
are versions of a bounded pool of documents (`records.Documents`): inserts, updates
(some twice or more), tombstones of published documents (deletions, not bad
records) and re-adds, each keyed by its document id and sent to the partition that
key hashes to; bad records stay, with upsert mode's own (no usable document key). The
check (`upsert`) also computes, from the topic, each document's latest version
(highest offset in its partition) and requires DIR/current (read with `lance`) to
hold exactly the live ones, at those offsets and texts; tombstones must be rows
with `deleted=true`; the index's shard files must hold every non-deleted row once
and serve only the live versions. Each seed then runs `pipeline compact --purge`
(unless `--no-purge`) and checks again: offsets rows, dead letters or purged, no
superseded or deleted text left, and `pipeline audit` exits 0. The Java producer's
records (unique ids) are documents published once.

Scenarios (by default seed N runs the ((N-1) mod 10)th): together, join, sigkill,
stall, broker-restart, foreign, storm (a random mix), slow-batches (a slower
random model and long texts, so that rebalances find batches in flight), damage
and dead-letters (one record in eight bad, a worker stalled past its session
timeout, others SIGKILLed, each worker pausing between a batch's dead letters and
its publish so that the signals land there: each bad record exactly once in the
dead-letter topic). Workers embed with scripts/tiny_model.py's random models, so
that a run's time goes to Kafka and to the worker's protocol, not to the model.

The harness runs its own broker (scripts/dev-kafka.sh with another port and home),
so it never disturbs the shared one on 9092:

    .venv/bin/python scripts/chaos --seeds 1-50 [--scenario NAME[,NAME...]]
        [--write-mode append|upsert [--no-purge]]
        [--keep-going] [--json FILE] [--port 19092] [--work-dir DIR]

One line per seed (scenario, events, records, lost, doubled, phantom, seconds),
then a summary. Exit 0 only when every seed passed: nothing lost, doubled or
phantom, and no worker exited non-zero unless the harness SIGKILLed it. Worker
logs and the harness's own event log stay under the work directory.
"""
