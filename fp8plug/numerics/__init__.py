"""FP8 numerics while a job runs: the watch (watch.py), the guard that acts on it (guard.py), and
the FP8 quantization they emulate (emulate.py). docs/numerics.md says how to read them."""
