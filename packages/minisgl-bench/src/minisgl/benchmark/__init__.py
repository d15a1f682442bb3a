"""Benchmarks: the harness (`python -m minisgl.benchmark.harness`), token parity, micro benches."""
