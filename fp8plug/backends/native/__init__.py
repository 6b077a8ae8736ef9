"""The `native` engine: fp8plug's own FP8 Linear, needing nothing but torch."""
