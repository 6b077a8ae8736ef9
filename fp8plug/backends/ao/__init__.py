"""The `ao` engine: torchao float8 training."""
