"""Benchmarks of distckpt (run as modules, e.g. ``python -m benchmarks.bench_save``)."""
