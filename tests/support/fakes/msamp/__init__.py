"""CONTRACT-TEST STAND-IN for MS-AMP (github.com/Azure/MS-AMP, v0.4.0), not MS-AMP itself.

It mirrors the public surface fp8plug's msamp adapter uses (see tests/support/fakes/README.md) so the
adapter can be tested where MS-AMP cannot be installed. No FP8 arithmetic happens here.
"""

import torch

from msamp.nn import LinearReplacer, clip_grad_norm_
from msamp.optim import LBAdam, LBAdamW

opt_levels = ["O1", "O2"]


def initialize(model, optimizer=None, opt_level="O1"):
    """As MS-AMP's: cast the model's Linears and rebuild the Adam/AdamW as LBAdam/LBAdamW over the
    same param groups (the cast model's parameters, by index), with O2's low-bit state dtypes."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError("Model must be an instance of torch.nn.Module")
    if opt_level not in opt_levels:
        raise ValueError("Invalid optimization level. Please choose from {}".format(opt_levels))
    if not optimizer:
        optimizer = torch.optim.AdamW(model.parameters())
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ValueError("Optimizer {} is not supported in optimization level {}".format(optimizer, opt_level))

    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    order = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) in index_of
            order.append(index_of[id(param)])
    cast_model = LinearReplacer.replace(model)
    parameters = list(cast_model.parameters())
    position = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i in range(len(params)):
            params[i] = parameters[order[position]]
            position += 1

    default_args = optimizer.defaults
    default_args["exp_avg_dtype"] = torch.uint8 if opt_level == "O2" else torch.float32
    default_args["exp_avg_sq_dtype"] = torch.float16 if opt_level == "O2" else torch.float32
    # MS-AMP pops these; decoupled_weight_decay does not exist in the torch 2.1 MS-AMP pins.
    for key in ["foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"]:
        default_args.pop(key, None)
    # MS-AMP checks Adam first; on torch 2.1 AdamW is not an Adam subclass, so AdamW -> LBAdamW.
    if type(optimizer) is torch.optim.AdamW:
        return cast_model, LBAdamW(optimizer.param_groups, **default_args)
    return cast_model, LBAdam(optimizer.param_groups, **default_args)


__version__ = "0.4.0+contract-stand-in"
__all__ = ["clip_grad_norm_", "initialize"]
