"""The embedding model as sentence-transformers defines it, read from a model's files.

`stack` reads the module stack (modules.json and each module's config) into a
frozen description, refusing what the pipeline does not reproduce; `tokenizer`
resolves the tokenizer exactly as transformers builds it; `head` runs the modules
after the transformer (pooling, dense, layer norm, normalisation, truncation);
`spec` joins them into what a worker will run, with its identity, before any
weights are loaded.
"""
