"""The ao engine's FP8 linear for a frozen weight (private to fp8plug/backends/ao/engine.py).

torchao 0.18's Float8Linear always computes the weight gradient in backward (casting grad_output
and the input for it, and keeping the input from forward), even for a weight with requires_grad
False, such as PEFT LoRA's `base_layer`. `FrozenWeightFloat8Matmul` does only what the output and
the input gradient need, with torchao's own casts and GEMMs, so both are torchao's bit for bit.
This module imports torchao; the engine imports it only once torchao is in use.
"""

from __future__ import annotations

import torch
from torchao.float8.config import ScalingType
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole


def _to_float8(tensor: torch.Tensor, cast, config, mm_config, role: GemmInputRole, axis: int) -> torch.Tensor:
    """`tensor` as the GEMM operand `cast` (a torchao CastConfig) asks for: unchanged where it is
    float8 already or that cast is DISABLED, else dynamically scaled to float8."""
    if tensor_already_casted_to_fp8(tensor) or cast.scaling_type is ScalingType.DISABLED:
        return tensor
    return hp_tensor_to_float8_dynamic(
        tensor, cast.target_dtype, mm_config, gemm_input_role=role,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b over a's last dimension, a of any rank (flattened to 2-D for torch.mm and back)."""
    lead = a.shape[:-1]
    out = torch.mm(a.reshape(-1, a.shape[-1]), b)
    return out.reshape(*lead, out.shape[-1])


@torch._dynamo.allow_in_graph
class FrozenWeightFloat8Matmul(torch.autograd.Function):
    """input @ weight_t in FP8, for a weight that takes no gradient.

    Forward: torchao's two casts (input and weight, each per its cast config; none where the config
    says DISABLED or the tensor is float8 already) and its FP8 GEMM. Saved for backward: the weight
    only (a view of the Parameter), not the input. Backward: grad_output cast with
    `cast_config_grad_output`, the weight with `cast_config_weight_for_grad_input`, one GEMM for
    grad_input, no weight gradient. Only torchao's casting helpers and its tensor's `torch.mm` are
    used, so the GEMM settings (emulate, fast accumulation, pad_inner_dim) are the module's own.
    Marked allow_in_graph, as torchao's Function is, so torch.compile keeps it in one graph."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight_t: torch.Tensor, mm_config, config):
        ctx.save_for_backward(weight_t)
        ctx.mm_config, ctx.config = mm_config, config
        x = _to_float8(input, config.cast_config_input, config, mm_config, GemmInputRole.INPUT, -1)
        w = _to_float8(weight_t, config.cast_config_weight, config, mm_config, GemmInputRole.WEIGHT, 0)
        return _mm(x, w)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (weight_t,) = ctx.saved_tensors
        config, mm_config = ctx.config, ctx.mm_config
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad = _to_float8(grad, config.cast_config_grad_output, config, mm_config, GemmInputRole.GRAD_OUTPUT, -1)
        w = _to_float8(weight_t, config.cast_config_weight_for_grad_input, config, mm_config,
                       GemmInputRole.WEIGHT, -1)
        grad_input = torch.mm(grad, w.t())
        return grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1]), None, None, None


def takes_frozen_path(weight: torch.Tensor) -> bool:
    """Whether a Float8Linear with this weight runs FrozenWeightFloat8Matmul: a frozen weight in
    high precision. One FSDP2's float8 all-gather already cast stays on torchao's path."""
    return not weight.requires_grad and not tensor_already_casted_to_fp8(weight)


def frozen_forward(module, input: torch.Tensor) -> torch.Tensor:
    """What torchao's Float8Linear.forward computes for `input`, through FrozenWeightFloat8Matmul:
    the input in CUDA autocast's dtype where CUDA autocast is on, the bias added after the GEMM in
    the output's dtype."""
    if torch.is_autocast_enabled("cuda"):
        input = input.to(torch.get_autocast_dtype("cuda"))
    out = FrozenWeightFloat8Matmul.apply(input, module.weight.t(), module.linear_mm_config, module.config)
    return out if module.bias is None else out + module.bias.to(out.dtype)
