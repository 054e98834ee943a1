"""How a distributed job's processes live and end, whatever trains in them: the lost-rank watchdog (watchdog.py) and
the teardown of a process group, or a failure's own exit code (teardown.py). torch.distributed only: the examples,
the benchmarks and the tests' jobs use them, and `import coat_ds` installs teardown's exit hook."""
