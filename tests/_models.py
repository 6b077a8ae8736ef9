"""Test models: re-exported from fp8plug.models so tests, examples and benchmarks share one."""

from fp8plug.models import Block, DecoderConfig, TinyDecoder, lm_loss, synthetic_batches  # noqa: F401
