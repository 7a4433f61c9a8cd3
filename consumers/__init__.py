"""The worker: the poll loop, its flow control, batching, the stages that embed and
write, the commit protocol, the rebalance state machine and repairs. Uses every
layer below it (core, model, kafka, storage); see docs/architecture.md."""
