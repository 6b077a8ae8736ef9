"""The grouped FP8 GEMM's fused casts (fp8plug/backends/native/grouped_cast.py, torch.compile'd,
run eagerly on CUDA) give the same bytes as grouped.py's torch-op casts (the CPU emulation and
the compiled-model path): compiled here on the CPU by inductor, whose divisions are correctly
rounded as Triton's are not, which the float64 divisions make moot. Shapes a Mixtral-like
experts module casts (3-D weights and their transposed views), rows holding zeros, NaN and inf
(NaN the same, whatever its sign bit). The token and weight-gradient casts are Triton kernels on
CUDA only (tests/gpu/test_transposed_cast.py)."""

import torch

from fp8plug.backends.native import grouped, grouped_cast

SIZES = [5, 0, 17, 10, 32]


def _bits_and_nans(t):
    """`t`'s bit patterns, NaNs zeroed, and where the NaNs are: a NaN's sign and payload carry
    nothing (the GEMM gives NaN either way) and differ between inductor's code and eager's."""
    if t.dtype == grouped.E4M3:
        bits = t.view(torch.uint8).to(torch.int32)
        nan = (bits & 0x7F) == 0x7F
    else:
        bits, nan = t.view(torch.int32), torch.isnan(t)
    return bits.masked_fill(nan, 0), nan


def _same(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        (bits_a, nan_a), (bits_b, nan_b) = _bits_and_nans(a), _bits_and_nans(b)
        assert torch.equal(nan_a, nan_b) and torch.equal(bits_a, bits_b)


def _weight():
    torch.manual_seed(0)
    w = torch.randn(4, 48, 32) * torch.logspace(-3, 2, 32)  # each column its own range
    w[1] = 0  # an expert all zeros
    w[2, 3, 5], w[3, 7, 1] = float("nan"), float("inf")
    return w


def test_weight_casts_both_directions_are_bit_identical():
    w = _weight()  # float32 master weights (bf16 ones: tests/gpu/test_moe_casts.py; one compile is seconds here)
    _same(grouped_cast.weight_forward(w), grouped.rowwise(w))
    _same(grouped_cast.weight_input_grad(w.transpose(-2, -1)), grouped.rowwise(w.transpose(-2, -1)))


def test_eager_cuda_only_and_never_inside_torch_compile():
    assert not grouped_cast.usable(torch.zeros(2))  # the CPU emulation keeps the torch ops
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def inside(t):
        seen.append(torch.compiler.is_compiling())
        return t + 1

    inside(torch.zeros(2))
    assert seen == [True]  # what usable() reads: a compiled model traces grouped.py's torch ops instead


def test_a_cast_past_its_compile_limit_runs_unfused_with_one_warning(monkeypatch, caplog):
    # each weight shape is an entry of the compiled cast; a process that builds many MoE models
    # (one pytest process) can pass dynamo's 8, an error under fullgraph. Limit 1 here: the second
    # shape runs as torch ops, the same bytes, and says so once.
    monkeypatch.setattr(grouped_cast, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(grouped_cast, "_OVER_LIMIT", set())
    monkeypatch.setitem(grouped_cast._COMPILED, grouped_cast._weight_forward,
                        torch.compile(grouped_cast._weight_forward, fullgraph=True, dynamic=False, backend="eager"))
    first, second, third = _weight(), _weight()[:, :16], _weight()[:, :8]
    with caplog.at_level("WARNING", logger="fp8plug"):
        for w in (first, second, third, first):
            _same(grouped_cast.weight_forward(w), grouped.rowwise(w))
    warnings = [r for r in caplog.records if "compiled 1 shapes" in r.getMessage()]
    assert len(warnings) == 1 and "_weight_forward" in warnings[0].getMessage()
