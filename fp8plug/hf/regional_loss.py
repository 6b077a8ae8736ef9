"""Under Accelerate's regional compilation, a transformers model's loss is compiled too.

Why: regional compilation (`TorchDynamoPlugin(use_regional_compilation=True)`) compiles each
decoder layer and each module outside the repeated blocks (the embedding, the final norm, the
head), but a transformers model works its loss out in its own forward, between those regions, so
the loss runs eagerly: the logits upcast to float32, a log-softmax and the loss as separate
kernels over [tokens, vocab]. On the benchmark Llama (vocab 32000, 8192 tokens a step) that took
4.4 ms a step against 0.5 ms where the whole model is compiled, and it is what left FP8's regional
rows behind their whole-model ones (docs/performance.md). Compiling the model's own loss function
with the same settings gives the loss one fused graph, and costs one more small compilation.

Only transformers' own loss is compiled: a loss function the user set (`model.loss_function =
...`) is theirs and is left as it is. The compiled function is set on the models Accelerate
returns: on one process or under DDP shallow copies whose `_orig_mod` is the model given to
prepare (`unwrap_model(keep_torch_compile=False)` hands that back, its loss uncompiled); under
FSDP2 and DeepSpeed, which Accelerate compiles in place, the model itself, as its layers are.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fp8plug.hf.attention import transformers_models

logger = logging.getLogger("fp8plug")
_logged = set()


def compile_losses(models: list, dynamo_plugin) -> None:
    """Where Accelerate's `dynamo_plugin` compiles by regions, compile the loss of each of
    `models` (as prepare() returned them) with the plugin's settings; else nothing."""
    from accelerate.utils import DynamoBackend

    if (dynamo_plugin is None or dynamo_plugin.backend == DynamoBackend.NO
            or not getattr(dynamo_plugin, "use_regional_compilation", False)):
        return
    for model in models:
        _compile_loss(model, dynamo_plugin.to_kwargs())


def _compile_loss(model: nn.Module, compile_kwargs: dict) -> None:
    """Compile the loss of every transformers model in `model` whose loss is transformers' own,
    with `compile_kwargs` (the dynamo plugin's); logs once per model class."""
    for hf_model in transformers_models(model):
        if "_loss_function" in vars(hf_model) or not isinstance(getattr(type(hf_model), "loss_function", None),
                                                                 property):
            continue
        hf_model.loss_function = torch.compile(hf_model.loss_function, **compile_kwargs)
        name = type(hf_model).__name__
        if name not in _logged:
            _logged.add(name)
            logger.info("fp8plug: %s: its loss compiled too under regional compilation (Accelerate compiles "
                        "the decoder layers and the head, and the loss between them would run eagerly).", name)
