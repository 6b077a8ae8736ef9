"""The `te` engine: NVIDIA TransformerEngine."""
