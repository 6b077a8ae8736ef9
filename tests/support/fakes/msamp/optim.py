"""Stand-in for msamp.optim: LBOptimizer (all_reduce_grads), LBAdamW, LBAdam, with MS-AMP's
constructor signatures; step() only counts (see tests/support/fakes/README.md)."""

import torch
from torch.optim.optimizer import Optimizer

from msamp.common.tensor import ScalingTensor
from msamp.nn import ScalingParameter, model_state


class LBOptimizer(Optimizer):
    def __init__(self, params, defaults):
        self.all_reduce_calls = []
        self.steps = 0
        super().__init__(params, defaults)

    def step(self, closure=None):
        self.steps += 1

    def all_reduce_grads(self, model):
        """MS-AMP all-reduces the FP8 weights' gradients here unless its FP8 DDP did already."""
        self.all_reduce_calls.append(model)
        if model_state.use_fp8_ddp:
            return
        _ = [p.grad for p in model.parameters() if isinstance(p, ScalingParameter)]

    def add_param_group(self, param_group):
        params = param_group["params"]
        param_group["params"] = [params] if isinstance(params, (torch.Tensor, ScalingTensor)) else list(params)
        for name, default in self.defaults.items():
            param_group.setdefault(name, default)
        self.param_groups.append(param_group)


class LBAdamW(LBOptimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16,
                 tensor_scale=True):
        self.bias_correction = bias_correction
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.tensor_scale = tensor_scale
        self.use_adam = False
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)


class LBAdam(LBAdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                 maximize=False, *args, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, *args, **kwargs)
        self.use_adam = True
