"""Storage: the Parquet segments and their two-phase publish, object stores, the
FAISS index, compaction, and the model identity an output records. Depends on the
core alone."""
