"""The grouped FP8 GEMM's fused casts (fp8plug/backends/native/grouped_cast.py, torch.compile'd,
run eagerly on CUDA) give the same bytes as grouped.py's torch-op casts (the CPU emulation and
the compiled-model path): compiled here on the CPU by inductor, whose divisions are correctly
rounded as Triton's are not, which the float64 divisions make moot. Shapes a Mixtral-like
experts module casts (3-D weights and their transposed views), rows holding zeros, NaN and inf
(NaN the same, whatever its sign bit). The token and weight-gradient casts are Triton kernels on
CUDA only (tests/gpu/test_transposed_cast.py). And the input gradient's weight, cast with one scale
an expert, keeps the precision of one scale a column against float64."""

import pytest
import torch

from fp8plug.backends.native import grouped, grouped_cast
from tests.support.numerics import sqnr_db

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


def expert_scale(w):
    """The input gradient's weight scale, one an expert: from the forward's row inverse scales."""
    return grouped_cast.reciprocal(grouped.expert_inverse_scales(grouped.rowwise(w)[1]))


def test_weight_casts_both_directions_are_bit_identical():
    w = _weight()  # float32 master weights (bf16 ones: tests/gpu/test_moe_casts.py; one compile is seconds here)
    _same(grouped_cast.weight_forward(w), grouped.rowwise(w))
    w_kn, scale = w.transpose(-2, -1), expert_scale(w)
    _same([grouped_cast.weight_input_grad(w_kn, scale)], [grouped_cast.expert_scaled(w_kn, scale)])


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


@pytest.mark.parametrize("spread", [0, 2, 4])
def test_one_scale_an_expert_keeps_the_input_gradients_precision(spread):
    """Columns of each expert weight spread over 10^spread: the input gradient's weight cast with
    one scale an expert (from the forward's row scales) against one a column, both held against
    float64. e4m3's relative precision is the same at any magnitude in its normal range."""
    torch.manual_seed(spread)
    w = torch.randn(4, 256, 512, dtype=torch.float64) * 0.02 * torch.logspace(-spread / 2, spread / 2, 512,
                                                                               dtype=torch.float64)
    grad = torch.randn(300, 256, dtype=torch.float64)
    expert_inv = grouped.expert_inverse_scales(grouped.rowwise(w.float())[1])
    per_expert, inv = grouped.cast_weight_input_grad(w.float(), expert_inv)
    assert per_expert.shape == (4, 512, 256) and inv.shape == (4, 512)
    per_column, column_inv = grouped.rowwise(w.float().transpose(-2, -1))
    for e in range(4):
        reference = grad @ w[e]
        ours = sqnr_db(grad.float() @ (per_expert[e].float() * inv[e][:, None]).t(), reference)
        columns = sqnr_db(grad.float() @ (per_column[e].float() * column_inv[e][:, None]).t(), reference)
        assert ours > 30 and ours > columns - 0.5, (e, ours, columns)
    assert torch.equal(inv, expert_inv[:, None].expand(-1, 512))
    assert torch.equal(grouped_cast.reciprocal(expert_inv), grouped_cast.reciprocal(inv[:, 0]))


def test_a_nan_in_a_groups_column_leaves_the_weight_gradients_column_nan():
    """The weight gradient's operand reads a NaN as an inf amax, as the fused kernel must (its
    atomic maximum cannot carry a NaN): that group's column is NaN at the NaN, 0 elsewhere, its
    inverse scale inf, and the weight gradient's column comes out NaN, nothing else touched."""
    offs = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    layout = grouped.group_layout(offs, sum(SIZES))
    torch.manual_seed(1)
    x, g = torch.randn(sum(SIZES), 24), torch.randn(sum(SIZES), 8)
    x[20, 3] = float("nan")  # row 20 lies in the third group (rows 5..21)
    data, inv = grouped.groupwise_columns(grouped.pad_groups(x, layout), layout)
    column = data[3].float()[layout.group == 2]
    assert column.isnan().sum() == 1 and (column.nan_to_num() == 0).all()
    assert inv.view(layout.experts, -1)[2, 3] == float("inf")
    assert inv.view(layout.experts, -1).isfinite().sum() == inv.numel() - 1
    g_t, g_inv = grouped.groupwise_columns(grouped.pad_groups(g, layout), layout)
    grad_w = grouped.scaled_grouped_mm(g_t, data.t(), g_inv, inv, layout.offs, torch.float32, False)  # [E, 8, 24]
    assert grad_w[2, :, 3].isnan().all()
    grad_w[2, :, 3] = 0
    assert grad_w.isfinite().all()
