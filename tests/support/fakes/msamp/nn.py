"""Stand-in for msamp.nn: ScalingParameter, FP8Linear, LinearReplacer, model_state,
clip_grad_norm_ (see tests/support/fakes/README.md). FP8Linear computes in high precision here."""

import torch
import torch.nn.functional as F

from msamp.common.dtype import Dtypes
from msamp.common.tensor import ScalingMeta, ScalingTensor


class ScalingParameter(ScalingTensor):
    def __init__(self, tensor, requires_grad=True):
        super().__init__(tensor.value, tensor.meta)
        self._is_param = True
        self.requires_grad = requires_grad


class _ModelState:
    use_fp8_ddp = False


model_state = _ModelState()


class ScalingModule(torch.nn.Module):
    def __setattr__(self, name, value):
        if isinstance(value, ScalingParameter):
            self._parameters[name] = value
        else:
            super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        """As MS-AMP's ScalingModule._apply, so model.to(device) works: ScalingParameters move
        (keeping their quantized dtype), other parameters and buffers as torch does it."""
        for module in self.children():
            module._apply(fn)
        with torch.no_grad():
            for param in self._parameters.values():
                if isinstance(param, ScalingParameter):
                    param.value = fn(param.value).to(param.value.dtype)
                elif param is not None:
                    param.data = fn(param)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self


class FP8Linear(ScalingModule):
    def __init__(self, in_features, out_features, use_bias=True, weight_qtype=Dtypes.kfloat16,
                 bias_type=torch.float32):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        value = torch.empty((out_features, in_features), dtype=weight_qtype.dtype)
        self.weight = ScalingParameter(ScalingTensor(value, ScalingMeta(weight_qtype)))
        if use_bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=bias_type))
        else:
            self.register_parameter("bias", None)

    def forward(self, input):
        return F.linear(input, self.weight.float().to(input.dtype), self.bias)


class LinearReplacer:
    @staticmethod
    @torch.no_grad()
    def _build_fp8linear(linear, weight_qtype):
        fp8 = FP8Linear(linear.in_features, linear.out_features, linear.bias is not None, weight_qtype,
                        linear.bias.dtype if linear.bias is not None else torch.float32)
        if linear.bias is not None:
            fp8.bias.data.copy_(linear.bias)
        fp8.weight.copy_(linear.weight.cast(weight_qtype))
        return fp8

    @classmethod
    def _replace(cls, model, weight_qtype):
        if isinstance(model, torch.nn.Linear):
            if getattr(model, "use_fp32_linear", False):
                return model
            return cls._build_fp8linear(model, weight_qtype)
        for name, child in list(model.named_children()):
            setattr(model, name, cls._replace(child, weight_qtype))
        return model

    @classmethod
    def replace(cls, model, weight_qtype=Dtypes.kfloat16, src_rank=0, group=None):
        return cls._replace(model, weight_qtype)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    parameters = [parameters] if isinstance(parameters, (torch.Tensor, ScalingTensor)) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.norm(torch.stack([torch.norm(g.float() if isinstance(g, ScalingTensor) else g, norm_type)
                                    for g in grads]), norm_type)
    return total
