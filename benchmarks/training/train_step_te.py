"""train_step.py's raw TransformerEngine path, written as a TE user writes it without fp8plug:
nn.Linear and nn.RMSNorm swapped for te.Linear and te.RMSNorm with the weights copied, a recipe
for the scaling, and TE's FP8 autocast around the forward. A module of its own so that
train_step.py holds the paths and how they are timed; TE is imported only where it runs.
"""

from __future__ import annotations


def _te():
    import transformer_engine.pytorch as te

    return te


def recipe(scaling: str):
    """The TransformerEngine recipe of `scaling` (delayed with fp8plug's defaults, current, block)."""
    from transformer_engine.common import recipe as te_recipe

    fmt = te_recipe.Format.HYBRID
    if scaling == "delayed":
        # fp8plug's defaults (FP8RecipeKwargs): margin 0, history 1024, most_recent
        return te_recipe.DelayedScaling(margin=0, fp8_format=fmt, amax_history_len=1024,
                                        amax_compute_algo="most_recent")
    if scaling == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if scaling == "block":
        return te_recipe.Float8BlockScaling(fp8_format=fmt)
    raise ValueError(f"raw te path: scaling {scaling!r} not benchmarked; use delayed, current or block")


def autocast(te_recipe):
    """TE's FP8 autocast under either of its names (te.autocast, older te.fp8_autocast)."""
    te = _te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)


def swap_modules(model, dtype, ignore):
    """Raw TransformerEngine: every nn.Linear (but those in `ignore`) -> te.Linear, nn.RMSNorm -> te.RMSNorm,
    weights copied, as a user would write it by hand."""
    import torch
    from torch import nn

    te = _te()
    for fqn, module in list(model.named_modules()):
        if fqn in ignore or not fqn:
            continue
        if type(module) is nn.Linear:
            new = te.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                            params_dtype=dtype, device=module.weight.device)
        elif type(module) is nn.RMSNorm:
            new = te.RMSNorm(module.normalized_shape[0], eps=module.eps or 1e-5, dtype=dtype,
                             device=module.weight.device)
        else:
            continue
        with torch.no_grad():
            new.weight.copy_(module.weight)
            if getattr(module, "bias", None) is not None:
                new.bias.copy_(module.bias)
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model
