"""How fast the one-pass FP8 cast (fp8plug.backends.native.fused_cast) runs per tile shape, in GB/s of
memory traffic (read the tensor once, write it twice in FP8), against torch ops under
torch.compile doing the same cast with the amax pass a dynamic scale needs. Picks
fused_cast.TILE and TRANSPOSE_16BIT_IN_REGISTERS (columns ending in "-reg").

    python3 benchmarks/linear/fused_cast_tiles.py --shapes 16384x8192,16384x57344,8192x14336
"""

from __future__ import annotations

import argparse
import json

import torch

from fp8plug.backends.native import fused_cast
from fp8plug.backends.native.cast import cast_operand
from fp8plug.backends.native.scaling import E4M3
from fp8plug.bench import Timer

TILES = [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8), (64, 256, 8)]


def gpu_ms(fn):
    """The GPU's own time for one call: calls queued behind a GPU sleep (fp8plug bench's timing),
    so the host's cost of issuing a custom op does not count."""
    return Timer(torch.device("cuda"), warmup=3, repeats=20, timing="queued")(fn, lambda: None)


@torch.compile
def torch_cast(t):
    """The native engine's cast of a dynamic slot (torch ops: amax pass, then both layouts)."""
    return cast_operand(t, E4M3, False, None, None, 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="16384x8192,16384x10240,16384x28672,16384x57344,8192x4096,4096x14336")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not fused_cast.load():
        raise SystemExit("the fused cast needs a CUDA GPU, Triton and torch.library.triton_op")
    rows = []
    scale, scaled = torch.tensor(3.0, device="cuda"), torch.tensor(True, device="cuda")
    for text in args.shapes.split(","):
        m, n = (int(v) for v in text.split("x"))
        t = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        traffic = t.numel() * (2 + 1 + 1)
        row = dict(shape=text, torch_compiled_ms=gpu_ms(lambda: torch_cast(t)))
        for tile in TILES:
            for in_registers in (False, True):
                fused_cast.TILE, fused_cast.TRANSPOSE_16BIT_IN_REGISTERS = tile, in_registers
                name = "x".join(map(str, tile)) + ("-reg" if in_registers else "")
                row[name] = gpu_ms(lambda: fused_cast.cast_transpose(t, scale, scaled, E4M3, 0))
        best = min((k for k in row if k[0].isdigit()), key=row.get)
        rows.append(row)
        print(f"{text}: torch compiled {row['torch_compiled_ms']:.3f} ms "
              f"({traffic / row['torch_compiled_ms'] / 1e6:.0f} GB/s); "
              + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k[0].isdigit())
              + f"; best {best} ({traffic / row[best] / 1e6:.0f} GB/s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
