"""Test models: re-exported from fp8plug.bench.toy_model so tests, examples and benchmarks share one."""

from fp8plug.bench.toy_model import Block, DecoderConfig, TinyDecoder, lm_loss, synthetic_batches  # noqa: F401
