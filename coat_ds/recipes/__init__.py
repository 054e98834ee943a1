"""Recipes: what examples/ and benchmarks/ build a training job from (a Llama causal LM and its engine in
causal_lm.py, the corpus, tokenizer and batches in data.py, command-line config reading in cli.py).

The top layer, above coat_ds.deepspeed: it uses the rest of coat_ds as a user would; nothing in coat_ds
imports it. Import the modules themselves (`from coat_ds.recipes import data`): each imports its heavy
dependencies (transformers, deepspeed, tokenizers) only where it needs them."""
