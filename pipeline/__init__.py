"""embedding-pipeline: Kafka to Parquet and FAISS, every record exactly once.

Layers, bottom up (docs/architecture.md; tests/test_layers.py keeps them true):
`pipeline.core`; then `pipeline.model`, `pipeline.kafka` and `sinks`, each on the
core alone; `consumers`, the worker, on all of these; and the applications on top:
`pipeline.cli`, `pipeline.status`, `pipeline.audit`, `pipeline.search`.
"""
