"""Where compiled FP8 gradients leave eager ones: layer by layer, cast by cast, model by model.

Why: on an H100 a compiled blockwise Llama never learned and compiled FP8 MoE experts gave a
down_proj gradient at 0 dB against eager; on an H200 one compiled rowwise or blockwise layer's
gradients were exactly zero, under aot_eager as under inductor (torch 2.11 tracing their
autograd.Functions; compiled, they are operators now: backends/native/compiled_ops.py), while the
CPU's compiled graphs give eager's bytes (tests/cpu/test_compiled_fp8_grads.py). This checks
that the GPU's compiled gradients are eager's. Cases (each in a
process of its own with empty inductor/Triton caches, each comparison in its own try/except):

  casts            every cast alone and in the groups one graph fuses, compiled (inductor) vs eager:
                   differing FP8 bytes and the scales' max relative difference
  dense-blockwise  granular_linear (1x128 / 128x128), M x K -> N, x bf16, fp32 weight, bf16 output
  dense-rowwise    the same, rowwise scaling
  dense-tensor     a NativeFP8Linear with per-tensor dynamic scaling (what trains compiled)
  grouped          grouped_fp8_linear, E experts, uneven groups (one empty), weight [E, N, K]
  grouped-transposed  the same with the weight stored [E, K, N] (GPT-OSS's layout)
  model-llama-blockwise, model-mixtral, model-qwen3_moe
                   a tiny transformers model through fp8plug.Accelerator with both flags True, one
                   forward and backward eager and compiled: per-parameter gradient SQNR compiled vs
                   eager, and each against a bf16 model's (the discriminating number: FP8 noise
                   makes compiled-vs-eager ~25 dB at best once anything upstream differs by one ulp,
                   but a correct compiled gradient is as close to bf16's as the eager one)

For the layer cases: output and gradients of eager vs a float64 reference, then of each compiled
variant vs eager (and vs float64): aot_eager (AOT autograd only), aot_eager_decomp_partition
(inductor's decompositions and min-cut partitioner, run eagerly), inductor, and inductor with the
casts made opaque custom ops (so only the GEMMs' surroundings are compiled). A variant whose
gradients are far from eager's but whose opaque-casts twin is not points at the traced casts.

    python3 benchmarks/diagnose/compiled_fp8_grads.py --json $OUT/compiled_fp8_grads.json
    python3 benchmarks/diagnose/compiled_fp8_grads.py --device cpu     # smoke test, small shapes
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
for _path in (str(ROOT), str(ROOT / "benchmarks" / "training")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from fp8plug.numerics.emulate import sqnr_db  # noqa: E402

CASES = ["casts", "dense-blockwise", "dense-rowwise", "dense-tensor", "grouped", "grouped-transposed",
         "model-llama-blockwise", "model-mixtral", "model-qwen3_moe"]
VARIANTS = ["aot_eager", "aot_eager_decomp_partition", "inductor", "inductor-opaque-casts"]


def sqnr(actual, reference) -> float:
    """The watch's SQNR (fp8plug.numerics.emulate.sqnr_db), with this file's argument order."""
    return sqnr_db(reference, actual)


def guarded(out: dict, key: str, fn):
    try:
        out[key] = fn()
    except Exception as e:  # one failing comparison must not stop the rest
        out[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}", "trace": traceback.format_exc()[-1500:]}


def fresh_dynamo():
    torch._dynamo.reset()


# --- casts: compiled bytes vs eager bytes ----------------------------------------------------------------


def compare_casts(eager, compiled) -> dict:
    """Per output: differing bytes of FP8 / integer tensors, max relative difference of float ones."""
    eager, compiled = torch.utils._pytree.tree_leaves(eager), torch.utils._pytree.tree_leaves(compiled)
    out = []
    for e, c in zip(eager, compiled):
        if not isinstance(e, torch.Tensor):
            out.append({"equal": e == c})
        elif e.shape != c.shape or e.dtype != c.dtype:
            out.append({"shape": [list(e.shape), list(c.shape)], "dtype": [str(e.dtype), str(c.dtype)]})
        elif e.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or not e.is_floating_point():
            diff = (e.contiguous().view(torch.uint8) != c.contiguous().view(torch.uint8)) if e.element_size() == 1 \
                else (e != c)
            out.append({"bytes_differing": int(diff.sum()), "of": e.numel(), "stride": [e.stride(), c.stride()]})
        else:
            rel = ((c.double() - e.double()).abs() / e.double().abs().clamp(min=1e-30)).max()
            out.append({"max_rel_diff": float(rel), "stride": [e.stride(), c.stride()]})
    return out


def run_casts(args, device) -> dict:
    from fp8plug.backends.native import granular, grouped
    from fp8plug.backends.native.cast import cast_operand

    m, k, n = args.m, args.k, args.n
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    g = torch.randn(m, n, device=device, generator=gen).bfloat16() * 1e-3
    T, S, R = granular.TILE, granular.SQUARE, granular.ROW
    c = granular.cast_tiles
    checks = {
        "tiles x 1x128": (lambda x: c(x, T, False), (x,)),
        "tiles x.t() 1x128": (lambda x: c(x.t(), T, False), (x,)),
        "tiles w 128x128": (lambda w: c(w, S, False), (w,)),
        "tiles g 1x128": (lambda g: c(g, T, False), (g,)),
        "tiles g.t() 1x128": (lambda g: c(g.t(), T, False), (g,)),
        "rows x pow2": (lambda x: c(x, R, True), (x,)),
        "rows w.t() pow2": (lambda w: c(w.t(), R, True), (w,)),
        "blockwise forward casts, one graph": (
            lambda x, w: (c(x, T, False), c(w, S, False), c(x.t(), T, False)), (x, w)),
        "blockwise backward casts, one graph": (lambda g: (c(g, T, False), c(g.t(), T, False)), (g,)),
        "per-tensor cast_operand": (lambda x: cast_operand(x, torch.float8_e4m3fn, False, None, None, 0), (x,)),
    }
    experts, sizes = args.experts, group_sizes(args.experts, m)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    tokens = torch.randn(sum(sizes), k, device=device, generator=gen).bfloat16()
    grads = torch.randn(sum(sizes), n, device=device, generator=gen).bfloat16() * 1e-3
    we = torch.randn(experts, n, k, device=device, generator=gen) * 0.02
    layout = grouped.group_layout(offs, tokens.shape[0])
    checks.update({
        "group_layout": (lambda o: tuple(grouped.group_layout(o, tokens.shape[0]))[:3], (offs,)),
        "pad_groups": (lambda t, o: grouped.pad_groups(t, grouped.group_layout(o, t.shape[0])), (tokens, offs)),
        "rowwise tokens": (grouped.rowwise, (grouped.pad_groups(tokens, layout),)),
        "rowwise weight [E,N,K]": (grouped.rowwise, (we,)),
        "input gradient's weight [E,K,N]": (lambda w: grouped.per_expert_transposed(
            w, grouped.expert_inverse_scales(grouped.rowwise(w)[1])), (we,)),
        "groupwise_columns": (lambda t, o: grouped.groupwise_columns(
            grouped.pad_groups(t, grouped.group_layout(o, t.shape[0])), grouped.group_layout(o, t.shape[0])),
            (grads, offs)),
        "grouped backward casts, one graph": (lambda gr, t, o: _grouped_backward_casts(grouped, gr, t, o),
                                              (grads, tokens, offs)),
    })
    out = {}
    for name, (fn, inputs) in checks.items():
        def one(fn=fn, inputs=inputs):
            fresh_dynamo()
            eager = fn(*inputs)
            return compare_casts(eager, torch.compile(fn, fullgraph=True)(*inputs))
        guarded(out, name, one)
    if device.type == "cuda":  # the fused casts (grouped_cast, transposed_cast) against the torch ops
        padded = grouped.pad_groups(grads, layout)
        expert_inv = grouped.expert_inverse_scales(grouped.rowwise(we)[1])
        guarded(out, "fused vs torch ops: tokens",
                lambda: compare_casts(grouped.rowwise(padded), grouped.cast_tokens(grads, layout)))
        guarded(out, "fused vs torch ops: weight_grad_operand",
                lambda: compare_casts(grouped.groupwise_columns(padded, layout),
                                      grouped.cast_weight_grad_operand(grads, layout)))
        guarded(out, "fused vs torch ops: weight_input_grad",
                lambda: compare_casts(grouped.per_expert_transposed(we, expert_inv),
                                      grouped.cast_weight_input_grad(we, expert_inv)))
    return out


def _grouped_backward_casts(grouped, grad_out, x, offs):
    layout = grouped.group_layout(offs, x.shape[0])
    gp = grouped.pad_groups(grad_out.contiguous(), layout)
    return (grouped.rowwise(gp), grouped.groupwise_columns(gp, layout),
            grouped.groupwise_columns(grouped.pad_groups(x, layout), layout))


# --- layers ----------------------------------------------------------------------------------------------


def group_sizes(experts: int, tokens: int) -> list:
    """Uneven groups summing to `tokens`: one empty expert, one unaligned, the rest skewed."""
    weights = [0.0, 0.37] + [1.0 + i for i in range(experts - 2)]
    raw = [int(tokens * w / sum(weights)) for w in weights]
    raw[1] = raw[1] | 5  # not a multiple of 16
    raw[-1] += tokens - sum(raw)
    return raw


def _opaque_casts():
    """The casts as custom ops inductor calls as they are (monkeypatched in for one variant)."""
    from fp8plug.backends.native import granular, grouped

    lib = "fp8diag"
    if not hasattr(torch.ops, lib) or not hasattr(getattr(torch.ops, lib), "rowwise"):
        @torch.library.custom_op(f"{lib}::rowwise", mutates_args=())
        def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return grouped.rowwise(t)

        @rowwise.register_fake
        def _(t):
            return t.new_empty(t.shape, dtype=torch.float8_e4m3fn), t.new_empty(t.shape[:-1], dtype=torch.float32)

        @torch.library.custom_op(f"{lib}::groupwise_columns", mutates_args=())
        def columns(t: torch.Tensor, group: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
            layout = grouped.GroupLayout(group, group, group, t.shape[0], experts)
            return grouped.groupwise_columns(t, layout)

        @columns.register_fake
        def _(t, group, experts):
            return (t.new_empty((t.shape[1], t.shape[0]), dtype=torch.float8_e4m3fn),
                    t.new_empty((experts * t.shape[1],), dtype=torch.float32))
    ops = getattr(torch.ops, lib)
    return {
        (granular, "cast_tiles"): lambda t, kind, p2: granular._cpu_cast_tiles(t.detach(), kind, p2),
        (grouped, "cast_tokens"): lambda t: ops.rowwise(t),
        (grouped, "cast_weight_forward"): lambda t: ops.rowwise(t),
        (grouped, "cast_weight_input_grad"): lambda t: ops.rowwise(t.contiguous()),
        (grouped, "cast_weight_grad_operand"): lambda t, layout: ops.groupwise_columns(t, layout.group,
                                                                                         layout.experts),
    }


def _grads(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autocast(grad.device.type, dtype=torch.bfloat16):
        out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


def layer_case(fn, inputs, reference, grad, variants) -> dict:
    """Eager vs float64, then each compiled variant vs eager and vs float64."""
    names = ["out", "grad_x", "grad_w"]
    out = {}
    ref = reference()
    eager = _grads(fn, inputs, grad)
    out["eager vs float64"] = {n: sqnr(e, r) for n, e, r in zip(names, eager, ref)}
    for variant in variants:
        def one(variant=variant):
            fresh_dynamo()
            backend = "inductor" if variant.startswith("inductor") else variant
            patches = _opaque_casts() if variant.endswith("opaque-casts") else {}
            saved = {key: getattr(*key) for key in patches}
            try:
                for (module, name), new in patches.items():
                    setattr(module, name, new)
                got = _grads(torch.compile(fn, backend=backend, fullgraph=True), inputs, grad)
            finally:
                for (module, name), old in saved.items():
                    setattr(module, name, old)
            return {"vs eager": {n: sqnr(c, e) for n, c, e in zip(names, got, eager)},
                    "vs float64": {n: sqnr(c, r) for n, c, r in zip(names, got, ref)}}
        guarded(out, variant, one)
    return out


def _float64_linear(x, w, grad):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    out = x64 @ w64.t()
    out.backward(grad.double())
    return [out.detach(), x64.grad, w64.grad]


def run_dense(args, device, scaling) -> dict:
    from fp8plug.backends.native import granular

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.m, args.k, device=device, generator=gen).bfloat16()
    w = torch.randn(args.n, args.k, device=device, generator=gen) * args.k ** -0.5
    grad = torch.randn(args.m, args.n, device=device, generator=gen) * 1e-3
    if scaling == "tensor":
        import fp8plug
        from fp8plug import FP8RecipeKwargs

        holder = torch.nn.Sequential(torch.nn.Linear(args.k, args.n, bias=False)).to(device)
        fp8plug.convert_model(holder, recipe=FP8RecipeKwargs(backend="native", scaling="dynamic"))
        layer = holder[0]

        def fn(x, w):  # the converted layer with `w` as its weight (a leaf whose gradient is compared)
            return torch.func.functional_call(layer, {"weight": w}, (x,))

        return {"type": type(layer).__name__, **layer_case(fn, [x, w], lambda: _float64_linear(x, w, grad), grad,
                                                            args.variants)}

    def fn(x, w):
        return granular.granular_linear(x, w, scaling, torch.bfloat16)

    return layer_case(fn, [x, w], lambda: _float64_linear(x, w, grad), grad, args.variants)


def run_grouped(args, device, transposed) -> dict:
    from fp8plug.backends.native import grouped

    gen = torch.Generator(device=device).manual_seed(0)
    sizes = group_sizes(args.experts, args.m)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    k, n = args.k, args.grouped_n
    x = torch.randn(args.m, k, device=device, generator=gen).bfloat16()
    w = torch.randn(args.experts, n, k, device=device, generator=gen) * k ** -0.5
    grad = torch.randn(args.m, n, device=device, generator=gen) * 1e-3
    stored = w.transpose(-2, -1).contiguous() if transposed else w

    def fn(x, w, offs):
        return grouped.grouped_fp8_linear(x, w, offs, transposed)

    def reference():
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        parts, start = [], 0
        for e, size in enumerate(sizes):
            parts.append(x64[start:start + size] @ w64[e].t())
            start += size
        out = torch.cat(parts)
        out.backward(grad.double())
        wg = w64.grad.transpose(-2, -1) if transposed else w64.grad
        return [out.detach(), x64.grad, wg]

    result = layer_case(fn, [x, stored, offs], reference, grad, args.variants)
    result["group_sizes"] = sizes
    return result


# --- tiny models -----------------------------------------------------------------------------------------


def build_model(name: str, device):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if name == "llama-blockwise":
        config = transformers.LlamaConfig(intermediate_size=768, **common)
        return transformers.LlamaForCausalLM(config).to(device)
    if name == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=512, num_local_experts=4, num_experts_per_tok=2,
                                            **common)
        return transformers.MixtralForCausalLM(config).to(device)
    config = transformers.Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=256, num_experts=4,
                                         num_experts_per_tok=2, decoder_sparse_step=1, head_dim=64, **common)
    return transformers.Qwen3MoeForCausalLM(config).to(device)


def run_model(args, device, name) -> dict:
    import fp8plug
    from fp8plug import FP8RecipeKwargs
    model = build_model(name, device)
    reference = copy.deepcopy(model)
    tokens = args.tokens_per_row
    ids = torch.randint(0, 512, (4, tokens), device=device, generator=torch.Generator(device=device).manual_seed(0))

    def grads_of(runner, owner, autocast=False):
        owner.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = runner(input_ids=ids, labels=ids).loss
        loss.backward() if autocast else accelerator.backward(loss)
        return float(loss), {n: p.grad.detach().float().clone() for n, p in owner.named_parameters()
                             if p.grad is not None}

    if hasattr(reference, "set_experts_implementation") and name != "llama-blockwise":
        reference.set_experts_implementation("eager")
    ref_loss, ref = grads_of(reference, reference, autocast=True)
    scaling = "blockwise" if name == "llama-blockwise" else None
    accelerator = fp8plug.Accelerator(mixed_precision="fp8",
                                      kwargs_handlers=[FP8RecipeKwargs(backend="native", scaling=scaling)])
    model = accelerator.prepare(model)
    out = {"bf16 loss": ref_loss}
    eager_loss, eager = grads_of(model, model)
    out["eager loss"] = eager_loss
    out["eager vs bf16"] = _summary({n: sqnr(eager[n], ref[n]) for n in eager if n in ref})
    for backend in args.model_variants:
        def one(backend=backend):
            fresh_dynamo()
            loss, got = grads_of(torch.compile(model, backend=backend), model)
            coverage = {k: list(v) for k, v in fp8plug.fp8_coverage(model)["layers"].items()}
            # how many dB closer to bf16 the eager gradient is than the compiled one: ~0 where the
            # compiled graph is right (both carry FP8 noise of the same size), large where it is wrong
            drop = {n: sqnr(eager[n], ref[n]) - sqnr(got[n], ref[n]) for n in got if n in ref}
            return {"loss": loss, "worst drop vs bf16 (eager dB - compiled dB)":
                    dict(sorted(drop.items(), key=lambda kv: -kv[1])[:6]),
                    "vs eager": _summary({n: sqnr(got[n], eager[n]) for n in eager if n in got}),
                    "vs bf16": _summary({n: sqnr(got[n], ref[n]) for n in got if n in ref}),
                    "missing grads": sorted(set(eager) - set(got)), "fp8 coverage (fp8, high)": coverage}
        guarded(out, f"compiled {backend}", one)
    return out


def _summary(values: dict) -> dict:
    worst = sorted(values.items(), key=lambda kv: kv[1])
    return {"min": worst[0][1] if worst else None, "worst": dict(worst[:6]), "all": values}


# --- driver ----------------------------------------------------------------------------------------------


def run_case(args, case) -> dict:
    device = torch.device(args.device)
    if case == "casts":
        return run_casts(args, device)
    if case.startswith("dense-"):
        return run_dense(args, device, case.split("-", 1)[1])
    if case.startswith("grouped"):
        return run_grouped(args, device, case.endswith("transposed"))
    return run_model(args, device, case.split("-", 1)[1])


def table(rows: list) -> str:
    """One line per comparison: case, what, and its numbers (SQNR dB or bytes)."""
    lines = []
    for row in rows:
        result = row.get("result", {})
        if "error" in row:
            lines.append(f"{row['case']:<24} ERROR {row['error'][:300]}")
            continue
        for what, value in result.items():
            if isinstance(value, dict) and "all" in value:
                value = {"min": value["min"], "worst": value["worst"]}
            if isinstance(value, dict):
                value = {k: (v if not isinstance(v, dict) or "all" not in v else {"min": v["min"], "worst": v["worst"]})
                         for k, v in value.items() if k != "trace"}
            lines.append(f"{row['case']:<24} {what:<40} {json.dumps(value, default=str)[:600]}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", default="all", help="comma list or 'all': " + ", ".join(CASES))
    p.add_argument("--variants", default=None, help="layer cases' compiled variants: " + ", ".join(VARIANTS))
    p.add_argument("--model-variants", default=None, help="model cases' compile backends (default inductor,aot_eager)")
    p.add_argument("--m", type=int, default=None, help="tokens (default 4096; cpu 256)")
    p.add_argument("--k", type=int, default=None, help="in features (default 4096; cpu 256)")
    p.add_argument("--n", type=int, default=None, help="dense out features (default 3072; cpu 384)")
    p.add_argument("--grouped-n", type=int, default=None, help="experts' out features (default 2048; cpu 256)")
    p.add_argument("--experts", type=int, default=None, help="default 8; cpu 4")
    p.add_argument("--tokens-per-row", type=int, default=None, help="model cases: sequence length (default 128)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per case")
    p.add_argument("--deadline", type=float, default=540, help="seconds for the whole run")
    p.add_argument("--json", default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    cpu = args.device == "cpu"
    for name, gpu, small in (("m", 4096, 256), ("k", 4096, 256), ("n", 3072, 384), ("grouped_n", 2048, 256),
                             ("experts", 8, 4), ("tokens_per_row", 128, 32)):
        if getattr(args, name) is None:
            setattr(args, name, small if cpu else gpu)
    args.variants = (args.variants.split(",") if args.variants
                     else ["aot_eager", "inductor"] if cpu else VARIANTS)
    args.model_variants = (args.model_variants.split(",") if args.model_variants
                           else ["aot_eager"] if cpu else ["inductor", "aot_eager"])
    if args.case:  # one case, in this process
        torch._dynamo.config.cache_size_limit = 64
        if cpu:
            torch.set_num_threads(1)
        try:
            row = {"case": args.case, "result": run_case(args, args.case)}
        except Exception as e:
            row = {"case": args.case, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.time() - PROCESS_START, 1)
        Path(args.out).write_text(json.dumps(row, default=str))
        return
    from fresh_process import run_fresh

    cases = CASES if args.cases == "all" else args.cases.split(",")
    if cpu and args.cases == "all":
        cases = [c for c in CASES if c not in ("model-qwen3_moe",)]
    rows = []
    for case in cases:
        left = args.deadline - (time.time() - PROCESS_START)
        if left < 10:
            rows.append({"case": case, "error": "not run: --deadline reached"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, __file__, "--case", case, "--out", str(out)] + _passed_on(args)
            code, err = run_fresh(cmd, min(args.timeout, left), caches_in=tmp)
            if out.exists():
                rows.append(json.loads(out.read_text()))
            else:
                rows.append({"case": case, "error": f"exit {code}: {err[-1500:]}" if code is not None
                             else f"killed after {min(args.timeout, left):.0f} s"})
        print(table(rows[-1:]), flush=True)
    meta = {"torch": torch.__version__, "device": args.device,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not cpu else None,
            "shapes": {k: getattr(args, k) for k in ("m", "k", "n", "grouped_n", "experts", "tokens_per_row")}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"done in {time.time() - PROCESS_START:.0f} s; {meta}")


def _passed_on(args) -> list:
    out = ["--device", args.device, "--variants", ",".join(args.variants),
           "--model-variants", ",".join(args.model_variants)]
    for name in ("m", "k", "n", "grouped_n", "experts", "tokens_per_row"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


if __name__ == "__main__":
    main()
