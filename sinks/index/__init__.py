"""The FAISS index of an output: its store (what readers and the worker call),
its shards and their files, flat and trained index kinds, and the check against
the Parquet rows."""
