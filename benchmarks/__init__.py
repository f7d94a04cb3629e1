"""Benchmarks: cost model (roofline.py), GPU harness (run_all.py + bench_*.py), plot, gpu_check.sh."""
