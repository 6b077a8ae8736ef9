"""What conversion applies to Hugging Face transformers models: the attention switch, FP8 attention."""
