"""Do a compiled granular FP8 layer's gradients match eager ones? One case per process.

    python3 benchmarks/diagnose/compiled_granular_grads.py rowwise --backend inductor            # one layer
    python3 benchmarks/diagnose/compiled_granular_grads.py rowwise --model --norms               # a tiny Llama
    python3 benchmarks/diagnose/compiled_granular_grads.py blockwise --device cpu                # the smoke

Why: on an H200 (torch 2.11, 2026-11-26) a compiled rowwise or blockwise layer's gradients came out
exactly zero, with inductor and with aot_eager, while its forward matched eager and the CPU's
compiled gradients are exact (docs/numerics.md). Prints one JSON line: the loss eager and compiled,
and each gradient's SQNR (dB) against eager (a layer), or the parameters whose compiled gradient is
zero and the lowest SQNRs (a model). Lets the compiled path through (granular.COMPILED_CUDA_GRANULAR)
so it measures what a fix must change.
"""

import argparse
import json

import torch

from fp8plug.backends.native import granular


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float(10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum().clamp(min=1e-30)))


def one_layer(args) -> dict:
    x = torch.randn(512, 256, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 256, device=args.device, requires_grad=True)

    def loss_of(x, w):
        return granular.granular_linear(x, w, args.scaling, torch.bfloat16).float().square().mean()

    runs = []
    for fn in (loss_of, torch.compile(loss_of, backend=args.backend)):
        x.grad = w.grad = None
        loss = fn(x, w)
        loss.backward()
        runs.append((float(loss), x.grad.clone(), w.grad.clone()))
    (eager_loss, gx, gw), (compiled_loss, cx, cw) = runs
    return dict(case=f"layer {args.scaling} {args.backend}", loss=(eager_loss, compiled_loss),
                input_grad_db=sqnr(cx, gx), weight_grad_db=sqnr(cw, gw),
                compiled_grad_norms=(float(cx.float().norm()), float(cw.float().norm())))


def tiny_llama(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import fp8plug

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(args.device)
    ids = torch.randint(0, 512, (4, 128), device=args.device)
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling=args.scaling),
                          _convert_ln=args.norms)
    runs = []
    for runner in (model, torch.compile(model, backend=args.backend)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = runner(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager), (compiled_loss, compiled) = runs
    moved = [n for n in eager if float(eager[n].abs().max()) > 0]
    zero = [n for n in moved if n in compiled and float(compiled[n].abs().max()) == 0]
    lowest = sorted((round(sqnr(compiled[n], eager[n]), 1), n) for n in moved if n in compiled)[:4]
    return dict(case=f"model {args.scaling} norms={args.norms} {args.backend}", loss=(eager_loss, compiled_loss),
                zero_grads=len(zero), of=len(moved), zero_names=zero[:4], lowest_db=lowest)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scaling", choices=granular.GRANULAR)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    p.add_argument("--model", action="store_true", help="a tiny transformers Llama instead of one layer")
    p.add_argument("--norms", action="store_true", help="with --model: convert the RMSNorms too")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    granular.COMPILED_CUDA_GRANULAR = True
    torch.manual_seed(0)
    print(json.dumps(tiny_llama(args) if args.model else one_layer(args)), flush=True)


if __name__ == "__main__":
    main()
