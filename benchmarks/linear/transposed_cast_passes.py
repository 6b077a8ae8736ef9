"""The transposed casts of a [tokens, C] activation or gradient (written [C, tokens]), as
fp8plug/backends/native/transposed_cast.py makes them, against the alternatives they were chosen
over:

- blockwise's 1x128 tiles (one scale per 128 rows and column): one pass (`tile_scaled_columns`: a
  program holds a whole 128-row segment) against the two passes it replaced (the column amaxes,
  then the cast), and its committed SEGMENT_CAST_TILE against 4 warps a program;
- rowwise (one scale per column over all rows): the amax pass's committed AMAX_TILE against
  32 x 128 on 4 warps.

Each pair is checked for equal bytes. GPU time per call: the calls are queued back to back behind
a GPU sleep, so the host's launch time is not counted (in a compiled step the host runs ahead).

    python3 benchmarks/linear/transposed_cast_passes.py --shapes 8192x4096,8192x14336,14336x4096
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
    torch.cuda._sleep(100_000_000)  # about 50 ms: longer than the host takes to queue the calls
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8192x4096,8192x14336,14336x4096", help="comma list of ROWSxCOLS (bf16)")
    args = p.parse_args()
    tiles, every = transposed_cast.TILES_128, transposed_cast.ALL_ROWS
    for shape in [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        segments = -(-shape[0] // transposed_cast.SEGMENT_ROWS)
        one_pass = lambda: transposed_cast.tile_scaled_columns(x, False, tiles)  # noqa: E731
        one, four, same = against(one_pass, one_pass, SEGMENT_CAST_TILE=(64, 4))
        two = ms_per_call(lambda: transposed_cast._cast_transposed(
            x, transposed_cast.column_amax(x, tiles, segments), False, tiles))
        print(f"{shape} 1x128 tiles: one pass {one * 1e3:.0f} us ({x.numel() * 3 / 1e9 / one:.2f} TB/s of one "
              f"read+write), two passes {two * 1e3:.0f} us; one pass on 4 warps {four * 1e3:.0f} us (equal: {same})")
        amax_pass = lambda: transposed_cast.column_amax(x, every, 1)  # noqa: E731
        amax, old, same = against(amax_pass, amax_pass, AMAX_TILE=(32, 128, 4))
        print(f"{shape} rowwise amax pass: {transposed_cast.AMAX_TILE} {amax * 1e3:.0f} us "
              f"({x.numel() * 2 / 1e9 / amax:.2f} TB/s), (32, 128, 4) {old * 1e3:.0f} us (equal: {same})")


def equal(a, b) -> bool:
    """Equal bytes (FP8 compared as bytes, so NaN payloads count)."""
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b))


def against(committed, alternative, **setting) -> tuple:
    """(committed ms, alternative ms, equal): the alternative runs with transposed_cast's module
    settings patched for the call."""
    mine = committed()
    fast = ms_per_call(committed)
    kept = {name: getattr(transposed_cast, name) for name in setting}
    for name, value in setting.items():
        setattr(transposed_cast, name, value)
    try:
        other = alternative()
        slow = ms_per_call(alternative)
    finally:
        for name, value in kept.items():
            setattr(transposed_cast, name, value)
    same = equal(mine, other) if isinstance(mine, tuple) else torch.equal(mine, other)
    return fast, slow, same

if __name__ == "__main__":
    main()
