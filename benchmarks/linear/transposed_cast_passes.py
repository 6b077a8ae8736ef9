"""Blockwise's transposed 1x128 cast (a [tokens, C] activation or gradient, one scale per 128 rows
and column, written [C, tokens]) in one pass (`transposed_cast.tile_scaled_columns`: a program
holds a whole 128-row segment) against the two passes it replaced (the column amaxes, then the
cast). Time per call, calls back to back, so the host's launches count as they do in a step.

    python3 benchmarks/linear/transposed_cast_passes.py --shapes 8192x4096,8192x14336,8192x1024
"""

from __future__ import annotations

import argparse

import torch

from fp8plug.backends.native import transposed_cast


def ms_per_call(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8192x4096,8192x14336,8192x1024", help="comma list of ROWSxCOLS (bf16)")
    args = p.parse_args()
    tiles = transposed_cast.TILES_128
    for shape in [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        segments = -(-shape[0] // transposed_cast.SEGMENT_ROWS)
        one = ms_per_call(lambda: transposed_cast.tile_scaled_columns(x, False, tiles))
        two = ms_per_call(lambda: transposed_cast._cast_transposed(
            x, transposed_cast.column_amax(x, tiles, segments), False, tiles))
        print(f"{shape}: one pass {one * 1e3:.0f} us ({x.numel() * 3 / 1e9 / one:.2f} TB/s of one read+write), "
              f"two passes {two * 1e3:.0f} us")


if __name__ == "__main__":
    main()
