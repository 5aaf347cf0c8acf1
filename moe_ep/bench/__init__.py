"""Standalone benchmarks: ``python -m moe_ep.bench {kernels,model,dispatch}``.

A benchmark is not a test: it prints a table and writes CSV, JSON and a PNG plot under
``./bench-results/`` (git-ignored; ``--out-dir`` elsewhere, the GPU gate to the committed
``benchmarks/results/``), named with the device and the date; tests only smoke-run it."""
