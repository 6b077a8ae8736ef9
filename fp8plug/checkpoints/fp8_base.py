"""Loading an FP8 checkpoint as a frozen FP8 base for LoRA: `load_fp8_base`, `load_fp8_weights`.

Why not `from_pretrained`: transformers marks its FP8-loaded models inference-only, and the usual
way round it dequantizes the whole base to bf16 (twice the memory) before FP8 training casts the
same weights back to FP8. Here each FP8 Linear of the checkpoint becomes a
`FrozenFP8Linear` (fp8plug.backends.native.frozen_base) holding the stored codes and a float32
scale, fed straight to the FP8 GEMMs; everything else (embeddings, norms, the Linears the
checkpoint keeps in high precision such as lm_head) loads in `dtype`. PEFT's own merge of such a
model is refused with the way that works (fp8plug.checkpoints.fp8_base_merge).

The model is built on the meta device (buffers such as the rotary frequencies on the CPU, as
accelerate's `init_empty_weights` does) and filled one tensor at a time, read by safetensors
straight onto `device`: no whole-model copy in any dtype. 128x128 block checkpoints
(`weight_scale_inv`) are requantized to one scale per tensor at load, tensor by tensor on the
device; the worst requantization SQNR is logged once (docs/fp8_base.md says why per tensor).
Checkpoint names are save_pretrained's (fp8plug.checkpoints.export_experts maps them back); MoE
experts stored one FP8 weight per expert are dequantized into the model's 3-D expert parameters in
`dtype`, trainable or not: no frozen FP8 layer takes 3-D experts, and under LoRA they are frozen
high-precision weights like the embeddings.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

import torch
from torch import nn

from fp8plug.backends import get_backend
from fp8plug.backends.base import offers
from fp8plug.checkpoints import export_experts
from fp8plug.checkpoints import export_formats as formats
from fp8plug.checkpoints.fp8_base_merge import FP8_BASE, watch_peft_merges
from fp8plug.layers.gemm_counts import count_gemms
from fp8plug.layers.rules import module_paths, replace_module

logger = logging.getLogger("fp8plug")

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")


def load_fp8_base(path, *, device=None, dtype: torch.dtype = torch.bfloat16, trainable: bool = False,
                  fp8_head: bool = False, model_class=None, backend: str = "native") -> nn.Module:
    """The transformers model of the FP8 checkpoint in directory `path` (`quant_method: "fp8"`,
    per-tensor `weight_scale` or 128x128 block `weight_scale_inv`, sharded or not), with every
    FP8 Linear kept in FP8 in memory as a frozen `FrozenFP8Linear` and every other tensor in
    `dtype`, on `device` (default: CUDA if there is one). Returned in eval mode, as
    `from_pretrained` returns a model; wrap it with PEFT and train.

    trainable: full fine-tuning instead. The FP8 Linears are dequantized into ordinary Linears in
    `dtype` (trainable weights need a high-precision master copy; convert the model with fp8plug
    as usual). fp8_head: store an untied output head that the checkpoint keeps in high precision as
    a frozen FP8 layer too (per-tensor, quantized at load: what the native engine's FP8 head does
    each step anyway under LoRA), saving its high-precision copy. model_class: the transformers
    class to build (default AutoModelForCausalLM). backend: the engine whose frozen FP8 layer holds
    the codes (its optional `frozen_fp8_layer`; native's is the one there is)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"load_fp8_base: {path!r} has no config.json; give the directory of an FP8 checkpoint "
                                "(fp8plug.checkpoints.export.save_fp8_checkpoint writes one).")
    quantization = _quantization_config(path)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the model is built plain; the FP8 layers are ours
    with init_empty_weights():  # parameters on meta, buffers (rotary frequencies) computed on the CPU
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    load_fp8_weights(model, path, device=device, dtype=dtype, trainable=trainable, fp8_head=fp8_head,
                     quantization=quantization, backend=backend)
    return model.eval()


def load_fp8_weights(model: nn.Module, path, *, device=None, dtype: torch.dtype = torch.bfloat16,
                     trainable: bool = False, fp8_head: bool = False, quantization: Optional[dict] = None,
                     backend: str = "native") -> nn.Module:
    """Fill `model` (built on the meta device or not; its Linears plain nn.Linear) from the FP8
    checkpoint in `path`, as `load_fp8_base` describes, in place; returns it."""
    from safetensors import safe_open

    path = os.fspath(path)
    engine = _engine_for(backend)
    quantization = quantization if quantization is not None else _quantization_config(path)
    block = (quantization.get("weight_block_size") or [None])[0]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    where = _tensor_files(path)
    fp8_weights = {k[: -len(suffix)] + ".weight": k for k in where for suffix in SCALE_SUFFIXES if k.endswith(suffix)}
    missing_weights = [k for k in fp8_weights if k not in where]
    if missing_weights:
        raise ValueError(f"load_fp8_base: {path} has scales without weights: {missing_weights[:3]}")
    modules = dict(model.named_modules())
    paths = module_paths(model)
    renamed, expert_slots = export_experts.model_names(model, where)  # save_pretrained's names -> the model's
    handles: Dict[str, object] = {}

    def read(key):
        name = where[key]
        if name not in handles:
            handles[name] = safe_open(os.path.join(path, name), framework="pt", device=str(device))
        return handles[name].get_tensor(key)

    loaded, worst = {"fp8": 0, "high": 0}, (float("inf"), None)
    done = set()
    for key in where:
        if key.endswith(SCALE_SUFFIXES) or key in done or key in expert_slots:
            continue
        if key in fp8_weights:
            stem = key[: -len(".weight")]
            bias_key = f"{stem}.bias"
            bias = read(bias_key) if bias_key in where else None
            done.add(bias_key)
            stem = renamed.get(key, key)[: -len(".weight")]
            new, sqnr = _fp8_linear(engine, modules.get(stem), stem, read(key), read(fp8_weights[key]), bias, block,
                                    dtype, trainable, type(model).__name__)
            replace_module(model, stem, new, paths)
            loaded["fp8"] += 1
            if sqnr < worst[0]:
                worst = (sqnr, stem)
        else:
            _assign(model, renamed.get(key, key), read(key), dtype)
            loaded["high"] += 1

    def expert_weight(key):  # MoE experts are dequantized into their 3-D parameters, trainable or not
        scale_key = fp8_weights.get(key)
        weight = read(key)
        return weight if scale_key is None else formats.dequantize(weight, read(scale_key), block or formats.BLOCK)

    experts = export_experts.assemble_experts(model, expert_slots, expert_weight, dtype, device)
    for name, tensor in experts.items():
        _assign(model, name, tensor, dtype)
    _tie_head(model)
    head = _quantize_head(engine, model, paths, dtype) if fp8_head and not trainable else None
    _refuse_missing(model, path)
    model.to(device)  # the buffers built on the CPU (FrozenFP8Linear keeps its codes in FP8)
    if loaded["fp8"] and not trainable:  # PEFT's own merge of this model is refused, naming merge_and_export
        model.__dict__[FP8_BASE] = True
        watch_peft_merges()
    for fqn, module in model.named_modules():
        if getattr(module, "frozen_fp8", False):
            count_gemms(model, fqn, module, engine.name)
    exact = worst[1] is None
    requantized = (f"; {block}x{block} block scales requantized to one per tensor, "
                   + ("exactly" if exact else f"worst SQNR {worst[0]:.1f} dB ({worst[1]})")
                   if block and loaded["fp8"] and not trainable else "")
    logger.info("fp8plug: loaded %s: %d Linears %s%s%s, %d other tensors in %s%s", path, loaded["fp8"],
                "dequantized to " + str(dtype) + " (trainable)" if trainable else "kept in FP8 (frozen)", requantized,
                f"; {head} quantized to FP8 at load (fp8_head)" if head else "", loaded["high"], dtype,
                f", {len(experts)} MoE expert parameters put together from per-expert weights in {dtype}"
                if experts else "")
    return model


def _quantization_config(path: str) -> dict:
    config = formats.read_json(os.path.join(path, "config.json"), "load_fp8_base")
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        raise ValueError(
            f"load_fp8_base: {path}/config.json has quantization_config {quantization or None}, not an FP8 checkpoint "
            "(quant_method 'fp8'); load a high-precision checkpoint with from_pretrained and convert it with fp8plug.")
    block = quantization.get("weight_block_size")
    if block is not None and (len(block) != 2 or block[0] != block[1]):
        raise ValueError(f"load_fp8_base: weight_block_size {block} in {path}/config.json: only square blocks "
                         "(such as [128, 128]) or per-tensor scales (null) are read.")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        logger.warning("fp8plug: %s has activation_scheme %r; its static input scales are not used (inputs are "
                       "scaled dynamically in training).", path, quantization.get("activation_scheme"))
    return quantization


def _tensor_files(path: str) -> Dict[str, str]:
    """key -> the safetensors file holding it (through the index when sharded)."""
    index = os.path.join(path, formats.INDEX_NAME)
    if os.path.isfile(index):
        return dict(formats.read_json(index, "load_fp8_base", ("weight_map",))["weight_map"])
    single = os.path.join(path, formats.WEIGHTS_NAME)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"load_fp8_base: {path} has neither {formats.WEIGHTS_NAME} nor {formats.INDEX_NAME}.")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {key: formats.WEIGHTS_NAME for key in f.keys()}


def _fp8_linear(engine, module, stem, fp8, scale, bias, block, dtype, trainable, model_name):
    """The layer for one FP8 weight of the checkpoint, and its requantization SQNR (inf if none)."""
    if not isinstance(module, nn.Linear):
        found = "no such module" if module is None else f"a {type(module).__name__}"
        raise ValueError(f"load_fp8_base: the checkpoint stores {stem}.weight in FP8, but {model_name} has {found} at "
                         f"{stem!r}, not a Linear; the checkpoint was written for another architecture or config.")
    shape = (module.out_features, module.in_features)
    if fp8.dtype != torch.float8_e4m3fn or tuple(fp8.shape) != shape:
        raise ValueError(f"load_fp8_base: {stem}.weight is {fp8.dtype} {tuple(fp8.shape)} in the checkpoint; "
                         f"{model_name} expects float8_e4m3fn {shape}.")
    tiles = (-(-shape[0] // block), -(-shape[1] // block)) if block else None
    if (tiles is None and scale.numel() != 1) or (tiles is not None and tuple(scale.shape) != tiles):
        want = f"a {tiles[0]}x{tiles[1]} grid of {block}x{block} block scales" if tiles else "one per-tensor scale"
        raise ValueError(f"load_fp8_base: the scale of {stem}.weight has shape {tuple(scale.shape)}; the config's "
                         f"weight_block_size={[block, block] if block else None} means {want}.")
    scale = scale.float()
    if trainable:
        linear = nn.Linear(shape[1], shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(formats.dequantize(fp8, scale, block or formats.BLOCK).to(dtype))
        if bias is not None:
            linear.bias = nn.Parameter(bias.to(dtype))
        return linear, float("inf")
    sqnr = float("inf")
    if tiles is not None:  # one scale per tensor, from the block-dequantized weight
        fp8, scale, sqnr = formats.requantize_per_tensor(fp8, scale, block)
    return engine.frozen_fp8_layer(fp8, scale, bias, dtype, name=stem), sqnr


def _assign(model: nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Put the checkpoint's high-precision `key` into `model` (cast to `dtype` if floating)."""
    owner_name, _, leaf = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_name) if owner_name else model
    except AttributeError:
        owner = None
    old = None if owner is None else owner._parameters.get(leaf, owner._buffers.get(leaf))
    if old is None:
        raise ValueError(f"load_fp8_base: the checkpoint's {key} is not a parameter or buffer of "
                         f"{type(model).__name__}; the checkpoint was written for another architecture or config.")
    if tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"load_fp8_base: {key} has shape {tuple(tensor.shape)} in the checkpoint, "
                         f"{tuple(old.shape)} in {type(model).__name__}.")
    if tensor.is_floating_point():
        tensor = tensor.to(dtype if leaf in owner._parameters else old.dtype)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = tensor


def _tie_head(model: nn.Module) -> None:
    """A tied output head (stored once, under the embedding's name) shares the embedding again."""
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_out() if callable(get_out) else None
    embedding = get_in() if callable(get_in) else None
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and head is not None and embedding is not None and head.weight.is_meta and not embedding.weight.is_meta:
        head.weight = embedding.weight


def _quantize_head(engine, model: nn.Module, paths, dtype) -> Optional[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if type(head) is not nn.Linear or head.weight.is_meta or tied:
        return None  # tied (the embedding needs its high-precision table) or not a plain Linear
    name = next(n for n, m in model.named_modules() if m is head)
    fp8, scale = formats.quantize_per_tensor(head.weight)
    new = engine.frozen_fp8_layer(fp8, scale, head.bias, dtype, name=name)
    new.quantized_at_load = True  # merge_and_export writes it back in high precision, as the source kept it
    replace_module(model, name, new, paths)
    return name


def _refuse_missing(model: nn.Module, path: str) -> None:
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        more = ", ..." if len(missing) > 4 else ""
        raise ValueError(f"load_fp8_base: {path} holds no {', '.join(missing[:4])}{more} "
                         f"({len(missing)} tensors of {type(model).__name__} missing); the checkpoint was written for "
                         "another architecture or config, or a shard is missing.")


def _engine_for(backend: str):
    """The engine that holds the frozen FP8 layers, checked to offer them."""
    engine = get_backend(backend)
    if not offers(engine, "frozen_fp8_layer"):
        raise ValueError(f"load_fp8_base: backend={backend!r} ({engine.title}) cannot keep a checkpoint's weights in "
                         "FP8 as frozen layers; use backend='native', or trainable=True to dequantize them.")
    return engine
