"""Llama-3-8B trained with FSDP2 through Accelerate on several GPUs: bf16, Accelerate's own FP8 and
fp8plug, side by side.

The model: transformers' `LlamaForCausalLM` of Llama-3-8B's shape (32 layers, hidden 4096, ffn
14336, 32/8 heads, vocab 128256, rope theta 500000; `--layers` etc. shrink it), built from a config
with its parameters on meta (`accelerate.init_empty_weights(include_buffers=False)`: RoPE's small
buffers stay real), so it is never whole on any host or GPU. Accelerate's FSDP2 (one shard unit per
`LlamaDecoderLayer`) shards it still on meta; `model.to_empty()` then gives each rank memory for its
shards, and each parameter is initialised from a seed of its own name (matrices normal(0, 0.02),
norm weights 1, as transformers does), generated whole on the device one at a time and cut to the
rank's shard: every row, at every world size, starts from the same weights (`init_sums` in the
JSON; bench_model.py). accelerate 1.15 maps the optimizer onto the sharded parameters by
`data_ptr()`, 0 for every meta tensor, so the optimizer is pointed at them again after prepare
(`params_not_stepped` checks).

The same in every row: full activation checkpointing per decoder layer through the plugin's
`activation_checkpointing=True` (torch's non-reentrant checkpoint_wrapper, before sharding); mixed
precision as benchmarks/training/hf_llama.py sets it, "bf16" or "fp8", which under FSDP2 Accelerate
turns into MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 master weights;
fused AdamW (lr 3e-4, linear warm-up over a tenth of the steps); hf_llama_task.py's learnable
synthetic task, each rank its own batches. Rows:

  bf16           accelerate.Accelerator(mixed_precision="bf16")
  fp8plug        fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs()])
  fp8plug-ao     the same with FP8RecipeKwargs(backend="ao", enable_fsdp_float8_all_gather=True)
  fp8plug-native the same with FP8RecipeKwargs(backend="native") (bf16 all-gather, cast after it)
  fp8plug-fp8ag  the same with FP8RecipeKwargs(backend="native", enable_fsdp_float8_all_gather=True)
  accelerate-ao  accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
  accelerate-te  the same with TERecipeKwargs()

each `-usercompiled` (torch.compile(model) after prepare), `-regional` (Accelerate's
TorchDynamoPlugin(use_regional_compilation=True): under FSDP2 each decoder layer is compiled in
place before sharding) or `-eager`. Each row is one `python -m torch.distributed.run --standalone`
launch with empty inductor/triton caches; this parent (row_launcher.py) rewrites --json after
each row, skips rows --deadline leaves no time for, and ends a row at --timeout (keeping the steps
it finished).

`--tp N` trains every row tensor-parallel: Accelerate's ParallelismConfig(tp_size=N,
dp_shard_size=nproc/N) (FSDP2 over the dp_shard dimension where that is above 1), the meta model
sharded first with its transformers tp_plan (q/k/v/gate/up colwise, o/down rowwise, the embedding
and lm_head as transformers' plan says: `tensor_parallel`), each tensor-parallel group given the
same batches. The fp8plug rows then run the native engine's FP8 Linear on the DTensor shards
(fp8plug/backends/native/tensor_parallel.py); tok/s per GPU counts a group's tokens once (divided
by N). The rows to compare are bf16 and fp8plug (native), compiled whole and regional:

    python3 benchmarks/distributed/fsdp2_llama.py --nproc 4 --tp 2 --steps 12 --warmup 3 --json out/tp2.json \\
        --rows bf16-usercompiled,bf16-regional,fp8plug-usercompiled,fp8plug-regional,fp8plug-native-usercompiled
    python3 benchmarks/distributed/fsdp2_llama.py --nproc 2 --tp 2 --steps 12 --warmup 3 --rows bf16-eager,fp8plug-eager

`--strategy zero3` runs the same rows under DeepSpeed ZeRO-3 instead (Accelerate's
DeepSpeedPlugin(zero_stage=3), bf16, the same model, batch, optimizer and schedule): the model is
built inside `deepspeed.zero.Init`, so each layer is partitioned as it is constructed and no rank
ever holds the whole model, and each parameter is then initialised from the same per-name seed
(gathered one at a time, filled on rank 0, scattered back); activation checkpointing is
transformers' own per decoder layer (non-reentrant), the FSDP2 rows' granularity. ZeRO-3 rows
run `-eager`, or `-usercompiled` through DeepSpeedEngine.compile(); `-regional` is FSDP2's only.

Per row: tok/s per GPU (batch x seq over the median step time after --warmup; each step ends with
a device synchronise, negligible at 1 s a step); MFU = tok/s per GPU x F / 989e12 (--peak-tflops,
H100 SXM dense bf16) with F = 6 x N + 12 x layers x heads x head_dim x seq FLOPs per token, N the
parameters outside the input embedding that a token runs through (of an MoE layer's experts, top_k)
(PaLM's and torchtitan's count: causal masking not subtracted,
recomputation not added); peak memory per GPU (max_memory_allocated, max over ranks); seconds from
the launch to the end of step 1; the loss (rank 0, mean over the last 10 steps); FP8 Linear layers
out of all Linear layers (an FP8 row that converted none fails rather than report bf16 numbers).

`--model mixtral` / `qwen3moe` trains benchmarks/moe/moe_llm.py's MoE shapes instead (its config
builder; `toy` is its CPU size), built on meta and initialised per name as above, one FSDP2 unit per
decoder layer, without activation checkpointing unless asked (as moe_llm.py runs them). Their
weights are bf16 where it counts: Accelerate's FSDP2 keeps fp32 master shards (it upcasts bf16
parameters before sharding) and all-gathers them in bf16 (MixedPrecisionPolicy param_dtype), so
the bf16 rows' experts run transformers' `grouped_mm` on bf16 weights and tokens, the baseline of
moe_llm.py's `bf16-bf16weights` rows; `gathered_dtype`, `master_dtypes` and
`experts_implementation` in the JSON say so per row, and `experts_fp8` / `experts_total` how many
experts modules ran their GEMMs in FP8. `--data text` trains on real text instead of the
synthetic task (benchmarks/training/real_text.py's corpus and tokenizer, made once by the parent).
Every row records rank 0's loss at every step (`losses`) and its 10-step mean against the bf16
row of the same compile mode (`loss_vs_bf16_pct`). The loss is the model's output, which FSDP2's
policy (output_dtype bf16) rounds to bf16: about 0.2-0.4% a step at losses of 2-8. With --data
text each row also evaluates the trained model on held-out text (`heldout_loss`, against bf16's
in `heldout_vs_bf16_pct`): the comparison to trust for a bound like 1%.

    python3 benchmarks/distributed/fsdp2_llama.py --json out/fsdp2.json             # every visible GPU
    python3 benchmarks/distributed/fsdp2_llama.py --nproc 1 --layers 4 --json out/fsdp2_1gpu.json
    python3 benchmarks/distributed/fsdp2_llama.py --device cpu --nproc 2 --layers 2 --hidden 256 \\
        --intermediate 512 --heads 4 --kv-heads 2 --vocab 512 --seq 64 --rows bf16-eager,fp8plug-eager
    python3 benchmarks/distributed/fsdp2_llama.py --strategy zero3 --rows bf16-eager,fp8plug-eager --json out/zero3.json
    python3 benchmarks/distributed/fsdp2_llama.py --model mixtral --data text --steps 200 \\
        --rows bf16-usercompiled,fp8plug-usercompiled --json out/moe_fsdp2.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path

PROCESS_START = time.time()  # --deadline counts from here
ROOT = Path(__file__).resolve().parents[2]
for _path in (str(ROOT), str(ROOT / "benchmarks" / "training"), str(ROOT / "benchmarks" / "moe")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench_model import (  # noqa: E402
    LLAMA3_8B,
    build_meta_model,
    flops_per_token,
    materialise,
    weight_sums,
)
from fsdp2_data import TEXT_CACHE, heldout_loss, text_dir, text_spec, train_batches  # noqa: E402
from gpu_time_by_kind import profile_steps  # noqa: E402
from hf_llama_measure import dynamo_graphs, model_facts, note_early_step, step_numbers  # noqa: E402
from hf_llama_report import versions  # noqa: E402
from hf_llama_task import loss_floor, warmup_schedule  # noqa: E402
from moe_llm import MODELS as MOE_MODELS  # noqa: E402
from moe_llm import experts_facts  # noqa: E402
from parallel_setup import fsdp_on_cpu, tensor_parallel, tp_on_cpu  # noqa: E402
from row_launcher import run_rows, table, write_json  # noqa: E402
from zero3_rows import prepare_zero3, zero3_plugin  # noqa: E402

# --model: the Llama, or one of benchmarks/moe/moe_llm.py's MoE shapes (its builder: the same model as its rows)
MODELS = dict(llama=LLAMA3_8B, **MOE_MODELS)
# the size options (--layers, --expert-ffn, ...): every key some model's spec has, except what its name fixes
SIZE_KEYS = [key for key in dict.fromkeys(k for spec in MODELS.values() for k in spec)
             if key not in ("arch", "norm_topk_prob")]
DECODER_LAYERS = dict(mixtral="MixtralDecoderLayer", qwen3moe="Qwen3MoeDecoderLayer")  # by spec["arch"]
# row base -> (which Accelerator, mixed precision, FP8 engine, recipe arguments)
BASES = {
    "bf16": ("accelerate", "bf16", None, {}),
    # bf16 with fp8plug's changes that are not FP8 (SDPA is_causal=True, no built mask; under regional
    # compilation the loss compiled too), which fp8plug rows get by default: bf16-skipmask against
    # fp8plug splits fp8plug's gain into those and FP8
    "bf16-skipmask": ("accelerate", "bf16", None, dict(skip_causal_mask=True)),
    "fp8plug": ("fp8plug", "fp8", None, {}),
    "fp8plug-ao": ("fp8plug", "fp8", "ao", dict(enable_fsdp_float8_all_gather=True)),
    "fp8plug-native": ("fp8plug", "fp8", "native", {}),  # what `fp8plug` chooses on an H100 (the CPU: ao)
    # native with FSDP2 all-gathering the weights in FP8 (fp8plug.backends.native.fsdp_fp8), against
    # fp8plug-native (bf16 all-gather, the cast after it)
    "fp8plug-fp8ag": ("fp8plug", "fp8", "native", dict(enable_fsdp_float8_all_gather=True)),
    "accelerate-ao": ("accelerate", "fp8", "ao", {}),
    "accelerate-te": ("accelerate", "fp8", "te", {}),
}
MODES = ("usercompiled", "regional", "eager")
ALL_ROWS = [f"{base}-{mode}" for base in BASES for mode in MODES]
DEFAULT_ROWS = "bf16-usercompiled,fp8plug-usercompiled,accelerate-ao-usercompiled,fp8plug-regional"


# --- one row: every rank of a torch.distributed.run launch runs this --------------------------------


def make_accelerator(row: str, backend: str, device_type: str, strategy: str = "fsdp2", spec: dict = None,
                     tp: int = 1):
    """The row's Accelerator, with the FSDP2 plugin every row shares (or, `strategy` "zero3", the
    DeepSpeed ZeRO-3 plugin) and its compile mode; with `tp` above 1, Accelerate's
    ParallelismConfig(tp_size=tp, dp_shard_size=world/tp), FSDP2 only where dp_shard_size is above 1."""
    import accelerate
    from accelerate.utils import (
        AORecipeKwargs,
        FullyShardedDataParallelPlugin,
        ParallelismConfig,
        TERecipeKwargs,
        TorchDynamoPlugin,
    )

    base, mode = row.rsplit("-", 1)
    kind, precision, engine, options = BASES[base]
    if kind == "fp8plug":
        import fp8plug

        cls = fp8plug.Accelerator
        handlers = [fp8plug.FP8RecipeKwargs(**options, **({"backend": engine} if engine else {}))]
    else:  # bf16-skipmask's option is no recipe's: it has none
        cls = accelerate.Accelerator
        handlers = [dict(ao=AORecipeKwargs, te=TERecipeKwargs)[engine](**options)] if engine else []
    if strategy == "zero3":
        return cls(mixed_precision=precision, kwargs_handlers=handlers, deepspeed_plugin=zero3_plugin(spec))
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[DECODER_LAYERS.get(spec.get("arch"), "LlamaDecoderLayer")],
        reshard_after_forward=True, activation_checkpointing=spec.get("checkpointing", True),
        cpu_ram_efficient_loading=False,
        state_dict_type="SHARDED_STATE_DICT")
    dynamo = TorchDynamoPlugin(backend=backend, use_regional_compilation=True) if mode == "regional" else None
    dp_shard = int(os.environ.get("WORLD_SIZE", "1")) // tp
    config = ParallelismConfig(tp_size=tp, dp_shard_size=dp_shard) if tp > 1 else None
    if dp_shard == 1 and tp > 1:
        plugin = None  # tensor parallelism alone
    cpu = device_type == "cpu"
    accelerator = cls(mixed_precision=precision, kwargs_handlers=handlers, fsdp_plugin=plugin, dynamo_plugin=dynamo,
                      cpu=cpu, **({"parallelism_config": config} if config and not cpu else {}))
    if cpu and plugin is not None:
        fsdp_on_cpu(accelerator, plugin)
    if cpu and config is not None:
        tp_on_cpu(accelerator, config)
    if plugin is not None and not accelerator.is_fsdp2:
        raise RuntimeError(f"Accelerate did not turn FSDP2 on (distributed type {accelerator.distributed_type})")
    return accelerator


def rebind_optimizer(optimizer, model) -> None:
    """Point the (fresh) optimizer at the model's sharded parameters: accelerate's FSDP2 prepare
    maps old to new parameters by data_ptr(), 0 for all meta tensors, so it leaves every slot
    holding one and the same parameter."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if len(inner.param_groups) != 1 or inner.state:
        raise RuntimeError("rebind_optimizer expects one parameter group and no optimizer state yet")
    inner.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]


def fp8_facts(model, accelerator) -> dict:
    """What ran in FP8: fp8plug's GEMM counts, and for TransformerEngine modules how many ran under
    FP8 autocast (a te.Linear outside it runs in bf16)."""
    out = {}
    if hasattr(accelerator, "fp8_coverage"):
        coverage = accelerator.fp8_coverage()
        out.update(fp8_gemms=coverage["fp8_gemms"], high_precision_gemms=coverage["high_precision_gemms"])
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    out["param_local_types"] = sorted({type(t).__name__ for t in local})  # float8 all-gather: WeightWith...
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    out["attn_implementation"] = getattr(config, "_attn_implementation", None)
    te = [m for m in model.modules() if type(m).__module__.startswith("transformer_engine") and hasattr(m, "fp8")]
    if te:
        out["te_modules_ran_fp8"] = sum(bool(m.fp8) for m in te)
        out["te_modules"] = len(te)
    return out


def train(row: str, spec: dict, args, t0: float) -> dict:
    """Build, shard, materialise and train `row`; the numbers rank 0 reports (all ranks run it)."""
    import torch

    mode = row.rsplit("-", 1)[1]
    device_type = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and device_type != "cuda":
        raise RuntimeError("--device cuda: no CUDA device")
    accelerator = make_accelerator(row, args.compile_backend, device_type, args.strategy, spec, args.tp)
    world, device = accelerator.num_processes, accelerator.device
    cuda = device.type == "cuda"
    out = dict(device=torch.cuda.get_device_name(device) if cuda else "CPU", world_size=world, strategy=args.strategy)
    if args.strategy == "zero3":
        model, optimizer, scheduler = prepare_zero3(mode, BASES[row.rsplit("-", 1)[0]][2], spec, args, t0, accelerator,
                                                    out)
        return train_loop(model, optimizer, scheduler, accelerator, spec, args, t0, out)
    model = build_meta_model(spec)
    if BASES[row.rsplit("-", 1)[0]][3].get("skip_causal_mask"):
        from fp8plug.hf.attention import skip_causal_mask

        skip_causal_mask(model)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    params = sum(p.numel() for p in model.parameters())
    if args.tp > 1:
        tensor_parallel(model, accelerator.torch_device_mesh["tp"])
        out["tp_size"] = args.tp
        if not accelerator.is_fsdp2:  # the FSDP2 plugin's activation checkpointing, per decoder layer, here
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    scheduler = warmup_schedule(optimizer, args.steps)
    # tensor parallelism without FSDP2: the model stays on meta through prepare (materialised below)
    placement = [False] * 3 if args.tp > 1 and not accelerator.is_fsdp2 else None
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler, device_placement=placement)
    if BASES[row.rsplit("-", 1)[0]][3].get("skip_causal_mask"):  # the loss compiled too, where regional
        from fp8plug.hf.regional_loss import compile_losses

        compile_losses([model], accelerator.state.dynamo_plugin)
    materialise(model, device)
    rebind_optimizer(optimizer, model)
    if hasattr(accelerator, "fp8_coverage"):  # read once, eagerly: settles the counts made on meta
        accelerator.fp8_coverage()
    out.update(parameters=params, linears=linears, prepared_s=time.time() - t0, init_sums=weight_sums(model, device))
    out.update(model_facts(model, optimizer, accelerator, BASES[row.rsplit("-", 1)[0]][2]))
    out.update(precision_facts(model, accelerator))
    if mode == "usercompiled":
        model = torch.compile(model, backend=args.compile_backend)
    return train_loop(model, optimizer, scheduler, accelerator, spec, args, t0, out)


def precision_facts(model, accelerator) -> dict:
    """The dtypes a prepared model trains in: its master weights and, under FSDP2, the dtype the
    mixed precision policy all-gathers them in (what its GEMMs read; transformers' grouped_mm
    experts run in that dtype); and the experts implementation transformers calls, where it has one
    (fp8plug's FP8 experts replace "grouped_mm")."""
    import torch

    inner = accelerator.unwrap_model(model)
    masters = sorted({str(p.dtype).replace("torch.", "") for p in inner.parameters() if p.requires_grad})
    policy = getattr(getattr(accelerator.state, "fsdp_plugin", None), "mixed_precision_policy", None)
    param_dtype = getattr(policy, "param_dtype", None)
    out = dict(master_dtypes=masters,
               gathered_dtype=str(param_dtype).replace("torch.", "") if isinstance(param_dtype, torch.dtype) else None)
    config = getattr(inner, "config", None)
    if hasattr(config, "_experts_implementation"):
        out["experts_implementation"] = config._experts_implementation
    return out


def train_loop(model, optimizer, scheduler, accelerator, spec: dict, args, t0: float, out: dict) -> dict:
    """The timed steps every strategy shares; `out` completed with the row's numbers."""
    import torch

    rank, device = accelerator.process_index, accelerator.device
    cuda = device.type == "cuda"
    tp = getattr(args, "tp", 1)
    data = train_batches(spec, args, rank // tp).to(device)  # a tensor-parallel group trains on one batch
    if cuda:
        out["after_init_gb"] = torch.cuda.memory_allocated(device) / 1e9
    ms, losses = [], []

    def step(i: int):
        loss = model(input_ids=data[i], labels=data[i]).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for i in range(args.steps):
        start = time.perf_counter()
        loss = step(i)
        if cuda:
            torch.cuda.synchronize(device)
        ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.detach().float())
        note_early_step(out, i, args.warmup, t0, cuda)
        if rank == 0:
            write_json(args.json + ".progress", dict(out, step_ms_all=ms, losses=[x.item() for x in losses]))
    out.update(step_numbers(spec, args.steps, args.warmup, ms, losses))
    out["tokens_per_s"] /= tp  # the tp GPUs of a group train one batch
    out["loss_last"] = losses[-1].item()
    out["losses"] = [round(x, 5) for x in torch.stack(losses).tolist()]  # rank 0's, every step
    out["step_ms_all"] = [round(x, 2) for x in ms]
    out["dynamo_graphs"] = dynamo_graphs()
    out["final_sums"] = weight_sums(model, device)
    out.update(fp8_facts(model, accelerator))
    if "experts" in spec and hasattr(accelerator, "fp8_reports"):
        out.update(experts_facts(accelerator, model))
    if args.data == "text":  # after the counts were read: evaluation runs in high precision
        out["heldout_loss"] = heldout_loss(model, spec, args, device, rank // tp)
    if cuda and args.profile:  # after the timed steps: every rank profiles (collectives), rank 0 reports
        out["profile"] = profile_steps(lambda: step(args.steps - 1), args.profile, top=40)
    if cuda:
        peak = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                            dtype=torch.float64, device=device)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        out.update(peak_gb=peak[0].item() / 1e9, peak_reserved_gb=peak[1].item() / 1e9)
    elif torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out


def run_row(args) -> int:
    """This rank's part of one row; rank 0 writes the row's JSON, a failing rank its error."""
    rank = int(os.environ.get("RANK", "0"))
    Path(args.json + f".pid{rank}").write_text(str(os.getpid()))
    result = dict(row=args.row, error=None)
    try:
        result.update(train(args.row, args.spec, args, args.t0 or PROCESS_START))
        result["mfu"] = result["tokens_per_s"] * flops_per_token(args.spec) / (args.peak_tflops * 1e12)
    except BaseException as exc:  # noqa: BLE001 - a failed row is a row with its reason
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        error = f"rank {rank}: {type(exc).__name__}: {first}"
        write_json(args.json + f".rank{rank}.err", dict(row=args.row, error=error))
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)  # no teardown: the other ranks may be waiting in a collective; the launcher ends them
    if rank == 0:
        write_json(args.json, result)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # skip process-group and compile-worker teardown, which can hang after NCCL work


# --- the parent: what launches one row (benchmarks/distributed/row_launcher.py runs the rows) --------------


def child_command(row: str, args, path: Path) -> list:
    spec = [x for key, value in args.spec.items() if key in SIZE_KEYS
            for x in (f"--{key.replace('_', '-')}", str(value))]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            str(Path(__file__).resolve()), "--row", row, "--json", str(path), "--model", args.model, *spec,
            "--activation-checkpointing", "on" if args.spec["checkpointing"] else "off",
            "--data", args.data, "--text-mb", str(args.text_mb), "--text-cache", args.text_cache,
            "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--lr", str(args.lr), "--device", args.device,
            "--compile-backend", args.compile_backend, "--strategy", args.strategy,
            "--peak-tflops", str(args.peak_tflops), "--tp", str(args.tp), "--profile", str(args.profile),
            "--t0", str(time.time())]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama",
                   help="llama (Llama-3-8B's shape), or benchmarks/moe/moe_llm.py's MoE shapes (toy: its CPU size)")
    for key in SIZE_KEYS:
        kind = next(type(spec[key]) for spec in MODELS.values() if key in spec)
        p.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None,
                       help="default: " + ", ".join(f"{name} {spec[key]}" for name, spec in MODELS.items()
                                                    if key in spec))
    p.add_argument("--activation-checkpointing", choices=("on", "off"), default=None,
                   help="per decoder layer (default: on for llama, off for the MoE models, as moe_llm.py runs them)")
    p.add_argument("--data", choices=("synthetic", "text"), default="synthetic",
                   help="synthetic: hf_llama_task's task (known loss floor); text: real text (real_text.py's corpus)")
    p.add_argument("--text-mb", type=int, default=40, help="--data text: megabytes of site-packages text read")
    p.add_argument("--text-cache", default=str(TEXT_CACHE), help="--data text: where the tokenized corpus is kept")
    p.add_argument("--strategy", choices=("fsdp2", "zero3"), default="fsdp2",
                   help="FSDP2 through Accelerate (default), or DeepSpeed ZeRO-3 (rows -eager, -usercompiled)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ParallelismConfig(tp_size=TP, "
                   "dp_shard_size=nproc/TP) and the model's tp_plan (default 1: FSDP2 alone)")
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list (default {DEFAULT_ROWS}); rows: "
                   + ", ".join(ALL_ROWS))
    p.add_argument("--nproc", type=int, default=0, help="processes (GPUs) per row; default every visible GPU (CPU: 2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (CPU tests: aot_eager)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU, for MFU (H100 SXM: 989)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per row (default 600)")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole run, from this process's start")
    p.add_argument("--min-row-s", type=float, default=90, help="the least time a row is started with (default 90)")
    p.add_argument("--warm-cache", action="store_true", help="keep the usual inductor/triton caches")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="on GPUs, profile N more steps after the timed ones: GPU time by kernel kind, and the "
                        "communication no compute hid (benchmarks/training/gpu_time_by_kind.py)")
    p.add_argument("--json", default=None, help="write meta and rows here (rewritten after each row)")
    p.add_argument("--logs", default=None, help="keep each row's launch output as DIR/<row>.log")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one rank of one row (what the parent launches)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.spec = dict(MODELS[args.model])
    for key in SIZE_KEYS:
        if getattr(args, key) is not None:
            if key not in args.spec:
                p.error(f"--{key.replace('_', '-')}: --model {args.model} has no such size")
            args.spec[key] = getattr(args, key)
    args.spec["checkpointing"] = (args.model == "llama" if args.activation_checkpointing is None
                                  else args.activation_checkpointing == "on")
    if args.data == "text" and args.spec["vocab"] < 512:
        p.error("--data text needs --vocab 512 or more (a byte-level tokenizer has 257 tokens before any merge)")
    bad = [r for r in args.rows.split(",") if r.strip() and r.strip() not in ALL_ROWS]
    if bad:
        p.error(f"--rows: unknown row {bad[0]!r}; rows: {', '.join(ALL_ROWS)}")
    if args.row is not None and args.row not in ALL_ROWS:
        p.error(f"--row: unknown row {args.row!r}")
    chosen = [args.row] if args.row else args.rows.split(",")
    if args.strategy == "zero3" and any(r.strip().endswith("-regional") for r in chosen):
        p.error("--strategy zero3: regional compilation is FSDP2's; use -eager or -usercompiled rows")
    if args.tp > 1 and args.strategy == "zero3":
        p.error("--tp: tensor parallelism runs with --strategy fsdp2 (Accelerate's ParallelismConfig)")
    if args.tp > 1 and args.nproc > 0 and args.nproc % args.tp:
        p.error(f"--tp {args.tp}: --nproc {args.nproc} must divide by it (dp_shard_size = nproc / tp)")
    if not 1 <= args.warmup < args.steps:
        p.error("--warmup must be at least 1 and below --steps")
    if args.spec["hidden"] % args.spec["heads"] or args.spec["heads"] % args.spec["kv_heads"]:
        p.error("--hidden must divide by --heads, and --heads by --kv-heads")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.row:
        return run_row(args)
    if args.nproc <= 0:
        import torch

        args.nproc = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 2
    meta = dict(model=args.model, spec=args.spec, strategy=args.strategy, nproc=args.nproc, tp=args.tp,
                steps=args.steps, warmup=args.warmup, lr=args.lr, data=args.data,
                loss_floor=loss_floor(args.spec) if args.data == "synthetic" else None, peak_tflops=args.peak_tflops,
                flops_per_token=flops_per_token(args.spec), compile_backend=args.compile_backend, versions=versions(),
                date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command="python3 benchmarks/distributed/fsdp2_llama.py "
                + " ".join(sys.argv[1:] if argv is None else argv))
    if args.data == "text":  # made once here, before any row: the rows read it
        from real_text import prepare_data

        meta["text"] = prepare_data(text_dir(args), text_spec(args))
    rows = run_rows(args, meta, child_command, PROCESS_START)
    print(table(meta, rows))
    return 0 if any(r.get("tokens_per_s") and not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
