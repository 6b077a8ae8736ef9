"""Which attention kernel does scaled_dot_product_attention pick on each train_step.py path, and why?

The fp8plug and raw paths of the probe model once ran different attention kernels (FlashAttention-2
against cuDNN). This prints, for each path, the SDPA priority order at each stage of set-up, and
for every attention call of one eager step the backend the dispatcher chooses, with the inputs'
layout and the failing checks of cuDNN attention (torch's own debug messages).

    python3 benchmarks/training/sdpa_choice.py --paths fp8plug,raw --engine native --layers 1
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
import train_step

BACKENDS = {int(value): name for name, value in torch.nn.attention.SDPBackend.__members__.items()}


def priority() -> str:
    return ",".join(BACKENDS.get(int(b), str(b)) for b in torch._C._get_sdp_priority_order())


def probe_calls():
    """Wrap F.scaled_dot_product_attention to report the dispatcher's choice for each call."""
    original = F.scaled_dot_product_attention

    def reporting(q, k, v, *args, **kwargs):
        choice = torch._fused_sdp_choice(q, k, v, *args, **kwargs)
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, kwargs.get("is_causal", False), False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cudnn_ok = torch.backends.cuda.can_use_cudnn_attention(params, debug=True)
        print(f"  sdpa: chose {BACKENDS.get(choice, choice)}; cudnn usable={cudnn_ok}; q {tuple(q.shape)} "
              f"stride {q.stride()} {q.dtype} requires_grad={q.requires_grad} "
              f"autocast={torch.is_autocast_enabled('cuda')} grad_mode={torch.is_grad_enabled()} "
              f"priority={priority()}")
        for w in caught:
            print(f"    cudnn check: {w.message}")
        return original(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = reporting
    return lambda: setattr(F, "scaled_dot_product_attention", original)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", default="fp8plug,raw")
    parser.add_argument("--engine", default="native")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--compile", default="none", choices=("none", "blocks", "model"))
    parser.add_argument("--warmup", type=int, default=3, help="compiled: steps before the profiled one")
    args = parser.parse_args()
    spec = dict(train_step.MODELS["probe"], n_layers=args.layers)
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; priority at start: {priority()}")
    for path in args.paths.split(","):
        print(f"== {path} {args.engine}")
        run = train_step.setup(path, args.engine, None, spec, device, torch.bfloat16, args.compile)
        print(f"  after set-up: priority {priority()}")
        tokens = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["seq"]), device=device)
        if args.compile == "none":
            restore = probe_calls()
            try:
                run.step(tokens)
            finally:
                restore()
        else:  # compiled: the kernel is fixed at trace time; read the aten ops the step ran
            for _ in range(args.warmup):
                run.step(tokens)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                run.step(tokens)
                torch.cuda.synchronize()
            names = {}
            for e in prof.events():
                if any(word in e.name.lower() for word in ("scaled_dot_product", "flash", "cudnn", "sdpa", "fmha")):
                    names[e.name[:90]] = names.get(e.name[:90], 0) + 1
            print(f"  compiled step ran: {names}")
            print(f"  dynamo: {dict(torch._dynamo.utils.counters['stats'])}; "
                  f"recompiles/fallbacks: {dict(torch._dynamo.utils.counters['recompiles'])} "
                  f"{dict(torch._dynamo.utils.counters['frames'])}")
        torch.cuda.synchronize()
        print(f"  after one step: priority {priority()}")
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
