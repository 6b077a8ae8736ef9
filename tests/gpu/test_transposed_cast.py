"""The two-pass FP8 casts on CUDA write the bytes of the torch-op casts they replace: the transposed
ones (fp8plug/backends/native/transposed_cast.py) for the granular layers' transposed operands
(rowwise and 1x128 tiles) and the grouped GEMM's token rows, weight-gradient operands (gathered
through the padded layout, whole and as a column slice) and input-gradient weight; and the eager
granular casts written as they are (tile_cast.py: per row, 1x128 tile, 128x128 block, tensor); and
the two FSDP2 FP8 all-gather needs: a shard cast with a scale known already, and the gathered
FP8 weight's transposed copy."""

import pytest
import torch

from fp8plug.backends.native import granular, grouped, tile_cast, transposed_cast
from fp8plug.backends.native.scaling import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an sm_90 (Hopper) GPU")

SIZES = [37, 0, 128, 5, 300, 16, 64, 1]  # unaligned, empty, aligned groups


def same(mine, reference):
    """Equal bytes, NaN where the reference has NaN (its sign and payload aside)."""
    for a, b in zip(mine, reference):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        a32, b32 = a.float(), b.float()
        assert torch.equal(a32.isnan(), b32.isnan())
        assert torch.equal(a32.nan_to_num(), b32.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,power_of_two", [(granular.ROW, True), (granular.TILE, False)])
@pytest.mark.parametrize("rows,cols", [(8192, 1024), (300, 192), (131, 200)])
def test_granular_transposed_casts_write_the_torch_bytes(dtype, kind, power_of_two, rows, cols):
    torch.manual_seed(0)
    x = (torch.randn(rows, cols, device="cuda") * torch.logspace(-4, 3, cols, device="cuda")).to(dtype)
    x[5, 7], x[9, 11] = float("nan"), float("inf")  # a non-finite value keeps its column's scale at 1, made NaN
    assert granular._columns_of(x.t(), kind)
    same(granular._cast_columns(x, kind, power_of_two), granular._cast_tiles(x.t(), kind, power_of_two))
    same(granular.cast_tiles(x.t(), kind, power_of_two), granular._cast_tiles(x.t(), kind, power_of_two))


def test_scales_next_to_powers_of_two_are_the_torch_ones():
    """The kernels work the scale out themselves (transposed_cast's tile_scale); where rounding
    decides which power of two a scale floors to, amaxes a few ulps either side of 448 / 2**k, they
    give granular.tile_scale's torch bytes, as do an amax of zero and one past the largest scale."""
    k = torch.arange(-20, 21, device="cuda", dtype=torch.float32)
    ulps = torch.arange(-4, 5, device="cuda", dtype=torch.int32)
    amax = ((448.0 * torch.exp2(-k))[:, None].view(torch.int32) + ulps).view(torch.float32).reshape(1, -1)
    amax = torch.cat([amax, torch.tensor([[0.0, 2e-37, 1e-30, 3e38]], device="cuda")], dim=1)
    x = torch.cat([amax, -0.5 * amax, torch.zeros_like(amax)])  # each column's amax is its first row
    for power_of_two, kind in [(True, granular.ROW), (False, granular.ROW), (True, granular.TILE),
                               (False, granular.TILE)]:
        same(granular._cast_columns(x, kind, power_of_two), granular._cast_tiles(x.t(), kind, power_of_two))
    for power_of_two in (True, False):
        rows = x.t().contiguous()
        same(granular.cast_tiles(rows, granular.ROW, power_of_two),
             granular._cast_tiles(rows, granular.ROW, power_of_two))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [granular.ROW, granular.TILE, granular.SQUARE, granular.TENSOR])
@pytest.mark.parametrize("rows,cols", [(8192, 4096), (300, 520), (31, 130)])
def test_eager_granular_casts_write_the_torch_bytes(dtype, kind, rows, cols):
    torch.manual_seed(3)
    x = (torch.randn(rows, cols, device="cuda") * torch.logspace(-4, 3, cols, device="cuda")).to(dtype)
    x[5, 7], x[9, 11] = float("nan"), float("inf")  # their tile keeps scale 1, the values made NaN
    assert tile_cast.usable(x)
    for power_of_two in (True, False):
        same(granular.cast_tiles(x, kind, power_of_two), granular._cast_tiles(x, kind, power_of_two))
    columns = x[:, 2:cols - 1]  # a row-major view with a row stride of its own
    same(granular.cast_tiles(columns, kind, True), granular._cast_tiles(columns, kind, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_casts_through_the_layout_write_the_padded_bytes(dtype):
    torch.manual_seed(1)
    offs = torch.tensor(SIZES, device="cuda").cumsum(0).to(torch.int32)
    layout = grouped.group_layout(offs, sum(SIZES))
    x = (torch.randn(sum(SIZES), 512, device="cuda") * torch.logspace(-3, 2, 512, device="cuda")).to(dtype)
    padded = grouped.pad_groups(x, layout)
    assert grouped._fused(x)
    same(grouped.cast_tokens(x, layout), grouped.rowwise(padded))
    same(grouped.cast_weight_grad_operand(x, layout), grouped.groupwise_columns(padded, layout))
    columns = x[:, 128:384]  # a piece of the float32 weight gradient reads a column slice
    same(grouped.cast_weight_grad_operand(columns, layout),
         grouped.groupwise_columns(grouped.pad_groups(columns, layout), layout))
    x[40] = float("nan")  # a NaN row stays NaN, scale and all
    same(grouped.cast_tokens(x, layout), grouped.rowwise(grouped.pad_groups(x, layout)))
    wide = torch.randn(sum(SIZES), 40000, device="cuda").to(dtype)  # past ONE_READ_MAX: walked twice
    wide[7, 39999], wide[9, 3] = float("nan"), float("inf")
    same(grouped.cast_tokens(wide, layout), grouped.rowwise(grouped.pad_groups(wide, layout)))
    same(grouped.cast_weight_grad_operand(wide, layout),  # the NaN's and the inf's columns: NaN there, 0 besides
         grouped.groupwise_columns(grouped.pad_groups(wide, layout), layout))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_gradient_weight_cast_writes_the_torch_bytes(dtype):
    torch.manual_seed(2)
    w = (torch.randn(8, 1024, 384, device="cuda") * torch.logspace(-3, 1, 384, device="cuda")).to(dtype)
    expert_inv = grouped.expert_inverse_scales(grouped.rowwise(w)[1])
    same(grouped.cast_weight_input_grad(w, expert_inv), grouped.per_expert_transposed(w, expert_inv))


def test_the_amax_pass_reduces_every_segment():
    torch.manual_seed(3)
    x = torch.randn(1000, 300, device="cuda")
    amax = transposed_cast.column_amax(x, transposed_cast.TILES_128, 8)[0]
    expected = torch.nn.functional.pad(x.abs(), (0, 0, 0, 24)).reshape(8, 128, 300).amax(1)
    assert torch.equal(amax, expected)
    x[3, 4] = float("nan")
    assert transposed_cast.column_amax(x, transposed_cast.ALL_ROWS, 1)[0, 0, 4] == float("inf")


@pytest.mark.parametrize("sizes", [[2048, 700, 1300, 0, 16], [1, 600, 2, 5, 40]])
def test_the_amax_pass_reduces_long_and_short_groups(sizes):
    """A program whose rows lie in one group keeps an elementwise maximum and reduces it once; one
    that a group starts inside walks 16-row pieces. Both give each group's column maxima."""
    torch.manual_seed(4)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    layout = grouped.group_layout(offs, sum(sizes))
    x = torch.randn(sum(sizes), 384, device="cuda", dtype=torch.bfloat16) * 3
    x[sum(sizes) // 2, 5] = float("nan")  # read as inf
    amax = transposed_cast.column_amax(x, transposed_cast.GROUPS, layout.experts, layout.source, layout.group,
                                       layout.padded_rows)[0]
    padded = grouped.pad_groups(x, layout).float().abs().nan_to_num(nan=float("inf"))
    expected = torch.stack([padded[layout.group == e].amax(0) for e in range(layout.experts)])
    assert torch.equal(amax, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1792, 4096), (300, 192), (1, 7)])
def test_the_shard_cast_with_a_known_scale_writes_quantize_bytes(dtype, rows, cols):
    torch.manual_seed(0)
    x = (torch.randn(rows, cols, device="cuda") * 30).to(dtype)
    x[0, 0], x[-1, -1] = float("nan"), float("-inf")
    scale = torch.tensor(7.25, device="cuda")
    same([tile_cast.cast_scaled(x, scale)], [quantize(x, scale, torch.float8_e4m3fn)])


@pytest.mark.parametrize("rows,cols", [(4096, 14336), (1024, 4096), (37, 300), (1, 129)])
def test_the_fp8_transposed_copy_is_torchs(rows, cols):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
    y = transposed_cast.transposed(x)
    assert y.is_contiguous() and torch.equal(y.view(torch.uint8), x.t().contiguous().view(torch.uint8))
