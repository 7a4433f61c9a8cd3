"""The core: what every layer above shares and that depends on nothing of the project.

Errors, input records, the validated configuration, the output layout (where
segments live and what their names claim), the model identity record, host and
process helpers, metrics, and small presentation helpers. See docs/architecture.md.
"""
