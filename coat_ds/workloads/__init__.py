"""Workloads: what examples/ and benchmarks/ train (a Llama causal LM and its engine in causal_lm.py, the
corpus, tokenizer and batches in data.py, the public shapes by name in shapes.py, command-line config
reading in cli.py).

The top layer, above coat_ds.deepspeed: it uses the rest of coat_ds as a user would; within coat_ds only
plan.py imports it (the shapes and sizes). Import the modules themselves (`from coat_ds.workloads import data`):
each imports its heavy dependencies (transformers, deepspeed, tokenizers) only where it needs them."""
