"""What inductor makes of an RMSNorm followed by FP8 projections (the norm and the FP8 cast fused
into the projections that follow): shared by tests/cpu/test_native.py (C++ kernels on the CPU) and
tests/gpu/test_native.py (Triton kernels).

Compiled, fp8plug needs no fused module of its own for this: the native cast reaches inductor as
torch ops (one operator for dynamo, which AOT autograd traces into its ops), so inductor computes
the norm's statistics and the amax of its output in one kernel, and the FP8 cast of the
projections' shared input recomputes the normalised value from the norm's input instead of
reading it back: the normalised activation is never written in high precision. These helpers
build that block, compile it, and check that of the code inductor generated for it."""

from __future__ import annotations

import re

import torch
from torch import nn

import fp8plug
from tests.support.numerics import sqnr_db

HIDDEN = 256
# q, k and v widths differ from HIDDEN, so a (tokens, HIDDEN) buffer can only be the norm's output
Q_OUT, KV_OUT = 192, 64


class NormThenProjections(nn.Module):
    """transformers' LlamaRMSNorm, then q, k and v reading its output (a Llama attention's input)."""

    def __init__(self):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.norm = LlamaRMSNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, Q_OUT, bias=False)
        self.k = nn.Linear(HIDDEN, KV_OUT, bias=False)
        self.v = nn.Linear(HIDDEN, KV_OUT, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1)


def compiled_forward(device: str, tokens: int = 512):
    """Compile a converted NormThenProjections (native, dynamic scaling: the compiled default) with
    inductor and run forward and backward once under bf16 autocast. Returns (code, out, expected):
    the generated code of the forward, the compiled output, and the bf16 model's output."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = NormThenProjections().to(device)
    model = NormThenProjections().to(device)
    model.load_state_dict(reference.state_dict())
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic", auto_filter=False))
    x = torch.randn(tokens, HIDDEN, device=device) * 3
    compiled = torch.compile(model)

    def step():
        with torch.autocast(device, torch.bfloat16):
            out = compiled(x)
        out.float().sum().backward()
        return out

    out, codes = run_and_get_code(step)
    with torch.no_grad(), torch.autocast(device, torch.bfloat16):
        expected = reference(x)
    return codes[0], out, expected  # the forward is compiled (and listed) first


def allocations(code: str, tokens: int) -> list:
    """The dtypes of the (tokens, HIDDEN) buffers the generated code allocates."""
    pattern = rf"empty_strided_\w+\(\({tokens}, {HIDDEN}\), \([^)]*\), torch\.(\w+)\)"
    return re.findall(pattern, code)


def kernel_sources(code: str) -> dict:
    """name -> source of each kernel in the generated code (`name = async_compile.triton('name',
    '''source''', ...)`, or `.cpp_pybinding([...], '''source''')` on the CPU)."""
    return dict(re.findall(r"(\w+) = async_compile\.(?:triton|cpp_pybinding)\(.*?'''(.*?)'''", code, re.S))


def check_norm_fused_into_the_cast(device: str, tokens: int, norm_kernel_has=("rsqrt",)) -> None:
    """Compile the block on `device` and check: some kernel computes the norm (its source holds
    every string of `norm_kernel_has`), the forward allocates q/k/v's (tokens, HIDDEN) input in FP8
    and never in a high-precision dtype, and the output is within 20 dB of the bf16 model's."""
    code, out, expected = compiled_forward(device, tokens=tokens)
    sources = kernel_sources(code)
    assert any(all(mark in source for mark in norm_kernel_has) for source in sources.values()), list(sources)
    dtypes = allocations(code, tokens=tokens)
    assert "float8_e4m3fn" in dtypes and not {"bfloat16", "float32", "float16"} & set(dtypes), dtypes
    assert sqnr_db(out, expected) >= 20
