"""fp8plug inside other training stacks: Accelerate, the Trainer, DeepSpeed, launchers, torchao/OLMo-core shapes."""
