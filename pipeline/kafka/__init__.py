"""The Kafka layer: the cluster (clients, retries, topics, offsets), the producer
behind `pipeline produce`, the offsets reset, the dead-letter sink, and the fast
decoder of record batches the worker and the audit read with. Depends on the core
alone. (Absolute imports keep `kafka` itself kafka-python's.)"""
