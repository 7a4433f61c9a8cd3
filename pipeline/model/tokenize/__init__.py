"""Tokenizing: the tokenizer as transformers builds it (`resolve`), and the fast path
for BERT's WordPiece (`wordpiece` and its parts), checked against it at load
(`fast_path`) and run over whole batches (`batches`)."""
