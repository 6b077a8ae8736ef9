"""The FP8 checkpoint layouts inference clients read, and the files that hold them.

Two layouts, both float8_e4m3fn weights with float32 scales that multiply (weight ~= fp8 x scale),
activations quantized by the client at run time (`activation_scheme: "dynamic"`):

- "block" (`LAYOUTS[0]`, the default): one scale per 128x128 tile, `<linear>.weight_scale_inv` of
  shape [ceil(out/128), ceil(in/128)] (a multiplier despite its name, DeepSeek-V3's convention),
  `weight_block_size: [128, 128]`. transformers' FP8 loader (FineGrainedFP8Config), vLLM and
  SGLang all read it. transformers' dequantizer (every load without FP8 GEMMs, and
  `dequantize=True`) derives the tile from the scale grid, so a weight with a width above 128 that
  is not a multiple of 128 would be read wrong or refused: such Linears stay in high precision in
  this layout (`block_width_problem`). vLLM fuses q/k/v and gate/up into one layer and then needs
  each part but the last to have a multiple of 128 rows (all of them under tensor parallelism, and
  in its older releases): `block_warnings`.
- "per_tensor": one scalar `<linear>.weight_scale` per Linear, `weight_block_size: null`: what vLLM
  and SGLang read for per-tensor FP8 (any shape; a fused layer takes one scale per part).
  transformers' per-tensor FP8Linear names that scalar `weight_scale_inv`, so its `from_pretrained`
  would drop the scales as unexpected keys and run with new ones; the layout's config therefore
  carries a `scale_fmt` that transformers refuses, with the reason as its value (`PER_TENSOR_SCALE_FMT`).

`quantization_config` lists the Linears kept in high precision under both names clients read:
`modules_to_not_convert` (transformers; given, it replaces transformers' own default list, so
every kept Linear is named) and `ignored_layers` (vLLM, SGLang).
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = 128
LAYOUTS = ("block", "per_tensor")
SCALE_NAMES = {"block": "weight_scale_inv", "per_tensor": "weight_scale"}
# The per-tensor layout's `scale_fmt`: transformers' FineGrainedFP8Config (5.10.1 to 5.24 at least)
# takes only "float" or "ue8m0" there and stops `from_pretrained` with this value in its message;
# vLLM's and SGLang's Fp8Config do not read the field (their DeepSeek code compares it with "ue8m0":
# float scales, as these are).
PER_TENSOR_SCALE_FMT = ("float scales named weight_scale (fp8plug's per_tensor layout, for vLLM and SGLang); "
                        "transformers reads layout='block'")
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

CHUNK_ROWS = 4096  # rows quantized at a time (quantize_per_tensor, requantize_per_tensor)
# vLLM and SGLang run these sibling Linears as one fused layer, in one precision.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"save_fp8_checkpoint(layout={layout!r}): give one of {', '.join(map(repr, LAYOUTS))} "
                         "(fp8plug.checkpoints.export_formats says which clients read which).")
    return layout


def quantize_per_tensor(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight in float8_e4m3fn, float32 scalar scale) with weight ~= fp8 * scale.

    Row chunks at a time (CHUNK_ROWS), so that quantizing a 128k-vocabulary head at load costs tens of
    megabytes of float32, not three full copies (6 GB at Llama-3-8B's). Element by element the same
    arithmetic as on the whole tensor, so the result does not depend on the chunking."""
    w = weight.detach()
    rows = w.reshape(w.shape[0], -1) if w.dim() >= 2 else w.reshape(1, -1)
    amax = torch.zeros((), dtype=torch.float32, device=w.device)
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        amax = torch.maximum(amax, rows[start:start + CHUNK_ROWS].abs().amax().float())
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    out = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=w.device)
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        out[start:start + CHUNK_ROWS] = (rows[start:start + CHUNK_ROWS].float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return out.reshape(w.shape), scale.reshape(())


def requantize_per_tensor(fp8: torch.Tensor, scale: torch.Tensor, block: int = BLOCK):
    """A block-scaled FP8 weight re-expressed with one per-tensor scale: (fp8, scale, SQNR in dB of the
    new weight against the block-scaled one; inf if exact). Chunks of rows (a multiple of `block`),
    so that the float32 copies stay small whatever the weight's size."""
    rows = max(block, CHUNK_ROWS - CHUNK_ROWS % block)

    def chunks():
        for start in range(0, fp8.shape[0], rows):
            part = fp8[start:start + rows]
            tiles = scale[start // block:start // block + -(-part.shape[0] // block)]
            yield start, dequantize(part, tiles, block)

    amax = max((float(real.abs().amax()) for _, real in chunks()), default=0.0)
    new_scale = torch.tensor(amax / E4M3_MAX if amax > 0 else 1.0, dtype=torch.float32, device=fp8.device)
    out = torch.empty_like(fp8)
    signal = noise = 0.0
    for start, real in chunks():
        codes = (real / new_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        out[start:start + codes.shape[0]] = codes
        signal += float(real.square().sum())
        noise += float((codes.float() * new_scale - real).square().sum())
    sqnr = 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else float("inf")
    return out, new_scale, sqnr


def quantize_blocks(weight: torch.Tensor, block: int = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight in float8_e4m3fn, float32 scales [ceil(out/block), ceil(in/block)]), one scale per
    block x block tile (the last row and column of tiles may be partial), weight ~= fp8 * scale."""
    w = weight.detach().float()
    rows, cols = w.shape
    tiles_r, tiles_c = -(-rows // block), -(-cols // block)
    padded = torch.zeros(tiles_r * block, tiles_c * block, dtype=w.dtype, device=w.device)
    padded[:rows, :cols] = w
    amax = padded.reshape(tiles_r, block, tiles_c, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = expand_blocks(scale, rows, cols, block)
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """Per-tile scales repeated over their tiles, cut to the weight's [rows, cols]."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]


def quantize(weight: torch.Tensor, layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return quantize_blocks(weight) if layout == "block" else quantize_per_tensor(weight)


def dequantize(fp8: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weight of either layout (a 2-d scale is per `block` x `block` tile)."""
    if scale.dim() == 2:
        return fp8.float() * expand_blocks(scale.float(), fp8.shape[0], fp8.shape[1], block)
    return fp8.float() * scale.float()


def quantization_config(layout: str, kept: Iterable[str]) -> dict:
    """config.json's `quantization_config` for `layout` with the Linears `kept` in high precision
    (per_tensor: with the `scale_fmt` that makes transformers refuse it, PER_TENSOR_SCALE_FMT)."""
    kept = sorted(kept)
    entry = {"quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": [BLOCK, BLOCK] if layout == "block" else None,
             "modules_to_not_convert": kept, "ignored_layers": kept}
    if layout == "per_tensor":
        entry["scale_fmt"] = PER_TENSOR_SCALE_FMT
    return entry


def block_width_problem(rows: int, cols: int) -> Optional[str]:
    """Why a [rows, cols] weight cannot be stored in the block layout, or None.

    transformers' FP8 dequantizer (5.10.1 to 5.24: `Fp8Dequantize`, which every load without FP8
    GEMMs runs) takes the tile size from the scale grid, rows // ceil(rows / 128): a width above
    128 that is not a multiple of 128 gives a smaller tile (192 rows in two tiles read as 2 x 96, so
    rows 96-127 take the second tile's scale: right only where the two tiles' ranges happen to
    match) or, where it does not divide (320), a refusal. A width up to 128 is one tile whatever it
    is, and reads right."""
    bad = [f"{name}={n}" for name, n in (("out_features", rows), ("in_features", cols)) if n > BLOCK and n % BLOCK]
    if not bad:
        return None
    return (f"{' and '.join(bad)} not a multiple of {BLOCK}: transformers would read its partial {BLOCK}x{BLOCK} "
            "tiles wrong (layout='per_tensor' stores it in FP8 for vLLM and SGLang)")


def fused_siblings(names: Iterable[str]) -> Dict[str, List[str]]:
    """name -> the other Linears (among `names`) it is fused with in vLLM and SGLang."""
    names = set(names)
    siblings: Dict[str, List[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf in group:
                others = [f"{parent}.{o}" if parent else o for o in group if o != leaf]
                siblings[name] = [o for o in others if o in names]
    return siblings


def block_warnings(linears: Dict[str, nn.Linear]) -> List[str]:
    """Why vLLM would refuse some of the block layout's `linears`: a fused part (not the last) whose
    out_features is not a multiple of 128."""
    problems = []
    for name, module in sorted(linears.items()):
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf in group[:-1] and module.out_features % BLOCK:
                problems.append(f"{name} (out_features={module.out_features}, fused with "
                                f"{', '.join(g for g in group if g != leaf)})")
    return problems


def model_config(model: nn.Module) -> dict:
    """The model's config as `save_pretrained` writes it: the class under `architectures` and the
    weights' dtype under `dtype` (a config built by hand has both null), without changing the model."""
    entry = model.config.to_dict()
    entry["architectures"] = [type(model).__name__]
    entry["dtype"] = str(_dtype(model)).rpartition(".")[2]
    return entry


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def read_json(path: str, who: str, keys: Iterable[str] = ()) -> dict:
    """The JSON object in file `path` (a checkpoint's config.json or index), with `keys` present;
    a file that is not one, or lacks one of them, is refused naming the file (`who`: the caller,
    for the message) rather than with the parser's bare line and column."""
    with open(path) as f:
        try:
            entry = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{who}: {path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                             "an interrupted copy may have cut it short: copy or write the checkpoint again.") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{who}: {path} holds a JSON {type(entry).__name__}, not an object; copy or write the "
                         "checkpoint again.")
    missing = [key for key in keys if key not in entry]
    if missing:
        raise ValueError(f"{who}: {path} has no {', '.join(map(repr, missing))}; copy or write the checkpoint again.")
    return entry


def write_json(path: str, entry: dict) -> None:
    with open(path, "w") as f:
        json.dump(entry, f, indent=2, sort_keys=True)
        f.write("\n")


def write_weights(tensors: Dict[str, torch.Tensor], directory: str, max_shard_size) -> List[str]:
    """`tensors` as safetensors in `directory`: one model.safetensors, or shards with
    model.safetensors.index.json when they exceed `max_shard_size` (as save_pretrained names them).
    Returns the file names written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous().cpu() for n in names}, os.path.join(directory, filename),
                  metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        write_json(os.path.join(directory, INDEX_NAME),
                   {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)})
        files.append(INDEX_NAME)
    return files


def read_weights(directory: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint in `directory`, sharded (through its index) or not."""
    from safetensors.torch import load_file

    index = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(index):
        return load_file(os.path.join(directory, WEIGHTS_NAME))
    files = sorted(set(read_json(index, "reading the FP8 checkpoint", ("weight_map",))["weight_map"].values()))
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def scale_of(tensors: Dict[str, torch.Tensor], weight_name: str) -> Optional[torch.Tensor]:
    """The scale stored beside `<linear>.weight`, in either layout, or None."""
    stem = weight_name[: -len("weight")]
    return tensors.get(stem + "weight_scale_inv", tensors.get(stem + "weight_scale"))
