"""Benchmark harness for lightning_elan: adjustment pause, stop-and-restart, torchrun elastic, runtime overhead.

Run everything with ``python -m bench.run`` (see docs/benchmarks.md).
"""
