"""The experts' row casts and amax pass at a model's shapes, as committed against the alternatives
they were chosen over (fp8plug/backends/native/transposed_cast.py):

- the token rows' cast (`rows_cast`, through the padded layout): one read (a program holds whole
  rows, up to ONE_READ_MAX elements) against two walks along the rows (amaxes, then the cast);
- the forward's weight cast [E, N, K] (`grouped.cast_weight_forward`): the row kernel against the
  compiled reduction (`grouped_cast.weight_forward`, which weights stored [E, K, N] still take);
- the weight-gradient operands' amax pass (`column_amax`, GROUPS): the committed AMAX_TILE in walks of
  AMAX_ROWS_PER_PROGRAM rows against 32 x 128 tiles on 4 warps, and against 512-row walks of 64-row
  tiles.

Each pair is checked for equal bytes. GPU time per call (transposed_cast_passes.py's `against`:
calls queued behind a GPU sleep). Token groups from 8192 tokens routed top-k over skewed experts,
as grouped_gemm.py.

    python3 benchmarks/moe/token_casts.py --model mixtral
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "linear"))

from grouped_gemm import SHAPES, group_sizes  # noqa: E402
from transposed_cast_passes import against  # noqa: E402

from fp8plug.backends.native import grouped, grouped_cast  # noqa: E402
from fp8plug.backends.native import transposed_cast as tc  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mixtral", choices=sorted(SHAPES))
    p.add_argument("--skew", type=float, default=0.6)
    args = p.parse_args()
    tokens, experts, top_k, hidden, ffn = SHAPES[args.model]
    sizes = group_sizes(tokens, experts, top_k, args.skew)
    layout = grouped.group_layout(sizes.cumsum(0).to(torch.int32).cuda(), int(sizes.sum()))
    rows = int(sizes.sum())
    print(f"{args.model}: {rows} token rows in {experts} groups, {layout.padded_rows} padded")
    for name, width in (("gate_up input", hidden), ("down input", ffn), ("gate_up output gradient", 2 * ffn)):
        t = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)

        def cast():
            return tc.rows_cast(t, grouped.AMAX_FLOOR, layout.source, layout.padded_rows)

        def amax():
            return tc.column_amax(t, tc.GROUPS, layout.experts, layout.source, layout.group, layout.padded_rows)

        one, two, same = against(cast, cast, ONE_READ_MAX=0)
        print(f"  {name} [{rows}, {width}]: row cast one read {one * 1e3:.0f} us, two walks {two * 1e3:.0f} us "
              f"(equal: {same})")
        short, wider, same = against(amax, amax, AMAX_TILE=(32, 128, 4))
        _, long, same_long = against(amax, amax, AMAX_TILE=(64, 128, 4), AMAX_ROWS_PER_PROGRAM=512)
        print(f"    amax pass {tc.AMAX_TILE} tiles in {tc.AMAX_ROWS_PER_PROGRAM}-row walks {short * 1e3:.0f} us, "
              f"(32, 128, 4) tiles {wider * 1e3:.0f} us, 512-row walks {long * 1e3:.0f} us "
              f"(equal: {same and same_long})")
    for shape in ((experts, 2 * ffn, hidden), (experts, hidden, ffn)):
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(shape, device="cuda", dtype=dtype)
            kernel, compiled, same = against(lambda: grouped.cast_weight_forward(w),
                                             lambda: grouped_cast.weight_forward(w))
            print(f"  weight {list(shape)} {str(dtype)[6:]}: row kernel {kernel * 1e3:.0f} us, compiled cast "
                  f"{compiled * 1e3:.0f} us ({w.numel() * (w.element_size() + 1) / 1e9 / kernel:.2f} TB/s; "
                  f"equal: {same})")


if __name__ == "__main__":
    main()
