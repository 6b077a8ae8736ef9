"""The grouped FP8 GEMM's fused casts on the GPU (fp8plug/backends/native/grouped_cast.py: the
path eager training takes on CUDA) give the bytes of grouped.py's torch-op casts, for float32 and
bfloat16 weights and gradients at a Mixtral-like aspect; and an eager experts step through the
grouped GEMM then equals the unfused step exactly."""

import pytest
import torch

from fp8plug.backends.native import grouped, grouped_cast
from tests.cpu.test_moe_casts import _same, expert_scale

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="torch._scaled_grouped_mm with rowwise scales needs sm_90")

SIZES = [37, 0, 128, 5, 300, 16, 64, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_casts_are_bit_identical_on_cuda(dtype):
    torch.manual_seed(0)
    w = (torch.randn(8, 512, 256, device="cuda") * torch.logspace(-3, 1, 256, device="cuda")).to(dtype)
    w[2, 3, 5] = float("nan")
    assert grouped_cast.usable(w)
    _same(grouped_cast.weight_forward(w), grouped.rowwise(w))
    _same(grouped.cast_weight_forward(w), grouped.rowwise(w))  # stored [E, N, K]: the row kernel, one read
    stored_kn = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # GPT-OSS's layout: the compiled cast
    _same(grouped.cast_weight_forward(stored_kn), grouped.rowwise(w))
    w_kn, scale = w.transpose(-2, -1), expert_scale(w)
    _same([grouped_cast.weight_input_grad(w_kn, scale)], [grouped_cast.expert_scaled(w_kn, scale)])
    # the token and weight-gradient casts, gathered through the padded layout: test_transposed_cast.py


def test_an_eager_step_with_fused_casts_equals_the_unfused_step(monkeypatch):
    torch.manual_seed(0)
    offs = torch.tensor(SIZES, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(SIZES), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(SIZES), 512, 256, device="cuda") * 0.05
    g = torch.randn(sum(SIZES), 512, device="cuda", dtype=torch.bfloat16)

    def step():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = grouped.grouped_fp8_linear(xs, ws, offs)
        return [out, *torch.autograd.grad(out, (xs, ws), g)]

    fused = step()
    monkeypatch.setattr(grouped_cast, "usable", lambda t: False)
    for a, b in zip(fused, step()):
        assert torch.equal(a, b)
