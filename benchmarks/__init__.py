"""The benchmarks, run as modules from the repository root (`python -m benchmarks.e2e --smoke --out /tmp/e2e`), so
that they import this checkout's coat_ds and share benchmarks/common.py; docs/benchmarks.md says what each measures."""
