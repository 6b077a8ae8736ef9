"""What torch.compile costs the FP8 model against bf16, in counts the host's speed does not move.

Why: the first compiled step's seconds follow the host (bf16's own ranged from 35 to 50 s across
three runs on one day: docs/performance.md, "Time to the first step"), so a change that makes
compiling cheaper needs a measure that one run can trust. Compiling costs about in proportion to
the graph: the ops dynamo and AOT autograd trace, and the kernels inductor generates code for. This
script counts them for bf16 and each scaling of the native engine on a transformers
`LlamaForCausalLM` (every Linear converted: `auto_filter=False`), one forward and backward under
`torch.compile(model)` with bf16 autocast, each row in its own process:

- `graphs`: the graphs dynamo compiled (each hook of the top module is a frame of its own);
- `tracing_s`: torch's own seconds for tracing the Python;
- `ops`, `graph_ops`: the ATen ops of every graph inductor receives (after AOT autograd and
  inductor's graph passes; forward and backward graphs apart, recomputation in backward
  included), in all and graph by graph in the order they were compiled;
- `aot_s`, `front_end_s`: torch's own seconds for AOT autograd and for the whole front end
  (dynamo, AOT autograd, inductor's graph passes);
- `ops_by_source`: those ops by the line of fp8plug that made them (the innermost fp8plug frame of
  each op's stack; a cast's ops, one operator for dynamo, to the line that calls it), the largest
  first, and the rest as "outside fp8plug": where to look to make the graph smaller;
- with `--codegen` inductor runs to the end instead (Triton kernels on a GPU, C++ on a CPU), and
  `kernels` is how many kernels it generated, `compile_s` torch's whole compile time.

Without `--codegen` inductor stops before generating code (its inner compile hands the graph back
to run as is), which works on a CPU and takes seconds. On a CPU the finer scalings' casts are one
operator each (granular.cast_tiles), where a GPU traces them: their counts are a GPU's only with
`--device cuda`. Sizes: the benchmark Llama's 4 layers at a small width by default (the counts do
not depend on the width); `--preset llama` for its own.

    python3 benchmarks/training/compile_cost.py                       # a CPU: the front end
    python3 benchmarks/training/compile_cost.py --preset llama --codegen --json out/compile_cost.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from fresh_process import run_fresh  # noqa: E402

# bf16, or the native engine's scaling: dynamic per-tensor is what fp8plug.Accelerator runs with no
# recipe on an H100 or H200 (the automatic choice, tuned by measured speed), delayed what
# FP8RecipeKwargs(backend="native") runs with no scaling named
ROWS = {"bf16": None, "dynamic": "dynamic", "delayed": "delayed", "rowwise": "rowwise", "blockwise": "blockwise"}
PRESETS = {
    "small": dict(layers=4, hidden=256, intermediate=512, heads=8, kv_heads=2, vocab=512, seq=128, batch=2),
    "llama": dict(layers=4, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, seq=2048, batch=4),
}
MARK = "compile_cost: "  # the line a row prints its result on
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_of(node, package: str) -> str:
    """The line of fp8plug (its package directory: `package`) that made a graph node ("path:line
    function", the path from the package's parent), from the node's stack trace."""
    frames = [f for f in FRAME.findall(node.meta.get("stack_trace") or "") if f[0].startswith(package + os.sep)]
    if not frames:
        return "outside fp8plug"
    path, line, function = frames[-1]
    return f"{os.path.relpath(path, os.path.dirname(package))}:{line} {function}"


def measure(row: str, spec: dict, device: str, codegen: bool) -> dict:
    """One row, in this process: compile, run one forward and backward, count."""
    import torch
    from hf_llama_measure import compile_breakdown, dynamo_graphs
    from hf_llama_task import build_model
    from torch._inductor import metrics
    from torch._inductor.compile_fx import compile_fx

    import fp8plug
    from fp8plug import FP8RecipeKwargs

    model = build_model(spec, device)
    if ROWS[row] is not None:
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", auto_filter=False, scaling=ROWS[row]))
    graph_ops, by_source = [], collections.Counter()

    def hand_back(graph_module, example_inputs, **kwargs):  # inductor's inner compile, stopped before codegen
        from functorch.compile import make_boxed_func

        ops = [node for node in graph_module.graph.nodes if node.op == "call_function"]
        graph_ops.append(len(ops))
        by_source.update(source_of(node, os.path.dirname(fp8plug.__file__)) for node in ops)
        return make_boxed_func(graph_module.forward)

    def front_end_only(graph_module, example_inputs):
        return compile_fx(graph_module, example_inputs, inner_compile=hand_back)

    compiled = torch.compile(model, backend="inductor" if codegen else front_end_only)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    breakdown = compile_breakdown(top=None)
    seconds = breakdown["largest"]
    result = dict(row=row, graphs=dynamo_graphs(), tracing_s=seconds.get("bytecode_tracing", 0.0))
    if codegen:
        result.update(kernels=metrics.generated_kernel_count,
                      compile_s=breakdown["phases"].get("total_wall_time", 0.0))
    else:
        result.update(ops=sum(graph_ops), graph_ops=graph_ops, ops_by_source=dict(by_source.most_common()),
                      aot_s=seconds.get("create_aot_dispatcher_function", 0.0),
                      front_end_s=round(seconds.get("_compile.compile_inner", 0.0)
                                        + seconds.get("backward._backward_impl", 0.0), 2))
    return result


def run_rows(rows: list, args) -> list:
    """Each row in a fresh process with empty compile caches; its result, or the error it ended with."""
    results = []
    for row in rows:
        with tempfile.TemporaryDirectory() as caches, tempfile.TemporaryDirectory() as out:
            path = Path(out) / "row.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--preset", args.preset,
                   "--device", args.device, "--row-json", str(path)] + (["--codegen"] if args.codegen else [])
            code, err = run_fresh(cmd, args.timeout, caches_in=caches)
            if code == 0 and path.exists():
                results.append(json.loads(path.read_text()))
            else:
                results.append(dict(row=row, error=(err or f"exit {code}")[-1500:]))
        print(MARK + json.dumps(results[-1]), flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--codegen", action="store_true", help="run inductor to the end and count its kernels")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per row")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--row-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row is not None:
        Path(args.row_json).write_text(json.dumps(measure(args.row, PRESETS[args.preset], args.device, args.codegen)))
        return 0
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown row(s) {unknown}; choose from {list(ROWS)}")
    results = run_rows(rows, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(preset=args.preset, device=args.device, rows=results), indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
