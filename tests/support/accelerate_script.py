"""An Accelerate user's FP8 script, written against `accelerate.utils` as Accelerate 1.15 documents
it: convert the model to TransformerEngine by hand, then train it under FP8 autocast three ways
(apply_fp8_autowrap with a TERecipeKwargs, TE's own fp8_autocast, contextual_fp8_autocast with a
TE recipe object), and convert it back.

tests/cpu/test_accelerate_meaning.py and tests/gpu/test_accelerate_script.py run it with its
import line swapped for `from fp8plug import ...` (swapped_script), the point being that nothing
else has to change. It prints one line, `RESULT {json}`, with what each phase saw.
"""

import contextlib
import json
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

# tests/cpu/test_accelerate_meaning.py reads this import as one line (the one users swap): keep it so
# isort: off
from accelerate.utils import TERecipeKwargs, apply_fp8_autowrap, contextual_fp8_autocast, convert_model, has_transformer_engine_layers  # noqa: E501
# isort: on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = 20


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 256)).to(DEVICE)
    x = torch.randn(64, 256, device=DEVICE)
    target = torch.randn(64, 256, device=DEVICE)
    return model, x, target


def fp8_enabled() -> bool:
    """TransformerEngine's own word on whether FP8 autocast is on now."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return bool(FP8GlobalStateManager.is_fp8_enabled())


def train(model, x, target, autocast=None, watch=True):
    """STEPS AdamW steps; the losses, and (`watch`) whether TE said FP8 was on in each forward."""
    seen = []
    hook = model[0].register_forward_hook(lambda *_: seen.append(fp8_enabled()) if watch else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        with autocast() if autocast else contextlib.nullcontext():
            loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    hook.remove()
    return losses, seen


def main():
    result = {}
    model, x, target = model_and_data()
    result["plain_losses"] = train(model, x, target, watch=False)[0]

    # 1. convert, then the forward wrapped in FP8 autocast by apply_fp8_autowrap
    model, x, target = model_and_data()
    with torch.no_grad():
        convert_model(model)
    result["te_layers"] = has_transformer_engine_layers(model)
    apply_fp8_autowrap(model, TERecipeKwargs(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max"))
    result["autowrap_losses"], result["autowrap_fp8"] = train(model, x, target)

    # 2. convert, then TE's own autocast around each forward, as Accelerate's FP8 benchmarks do
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    te_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    model, x, target = model_and_data()
    with torch.no_grad():
        convert_model(model)
    result["te_autocast_losses"], result["te_autocast_fp8"] = train(
        model, x, target, lambda: te.fp8_autocast(enabled=True, fp8_recipe=te_recipe))

    # 3. contextual_fp8_autocast with TE's recipe object: FP8 in training mode, not in eval mode
    model.forward = MethodType(contextual_fp8_autocast(model.forward, te_recipe), model)
    seen = []
    hook = model[0].register_forward_hook(lambda *_: seen.append(fp8_enabled()))
    with torch.no_grad():
        model.train()
        model(x)
        model.eval()
        model(x)
    hook.remove()
    result["contextual_fp8_train_eval"] = seen

    convert_model(model, to_transformer_engine=False)
    result["te_layers_after_unconvert"] = has_transformer_engine_layers(model)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
