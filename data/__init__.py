"""Data preparation, a room of its own: the real corpora of the accuracy runs at scale (issue 46), prepared ahead
from Debian packages (the Linux kernel's sources and Documentation for pretraining, perl's documentation and the
manual pages for fine-tuning). Not a benchmark and not the library: the benchmarks read what it writes (.data/),
and it uses the library's tokenizer pipeline (coat_ds.workloads.data), not the other way round.

debian.py fetches and checks the .deb files and reads their members; sources.py says which members make each
corpus and which are held out; build.py splits, trains the BPE and tokenizes through the main job's own data
pipeline; carry.py packs the token files into the few MiB that travel to a machine without network and unpacks
them there. `python -m data.prepare_corpus` is the command; docs/benchmarks.md has the numbers.
"""
