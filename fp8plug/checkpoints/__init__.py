"""Checkpoints and exports: plain state dicts, FP8 state, whole directories, hand-off."""
