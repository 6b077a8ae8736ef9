"""One rank of tests/gpu/test_tensor_parallel.py (launched with torch.distributed.run): a small
transformers Llama saved once, loaded with `tp_plan="auto"` over Accelerate's ParallelismConfig
mesh (tp_size=2, dp_shard_size=WORLD/2 with FSDP2 where WORLD > 2), trained in bf16 for --steps
(the baseline, timed), then given to fp8plug.Accelerator, whose prepare() must refuse it with the
fix. Rank 0 writes a JSON summary to --out."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    return p.parse_args()


def accelerator_for(cls, world, **kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    dp_shard = world // 2
    config = ParallelismConfig(tp_size=2, dp_shard_size=dp_shard)
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2) if dp_shard > 1 else None
    return cls(parallelism_config=config, fsdp_plugin=fsdp, **kwargs)


def load(model_dir, accelerator):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", device_mesh=accelerator.torch_device_mesh,
                                                dtype=torch.float32)


def main():
    args = parse_args()
    import accelerate

    import fp8plug
    from fp8plug.layers.rules import ConversionError

    world = int(os.environ["WORLD_SIZE"])
    result = {"world": world}
    accelerator = accelerator_for(accelerate.Accelerator, world, mixed_precision="bf16")
    model = load(args.model_dir, accelerator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = model.config.vocab_size
    losses, times = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (4, 512), device="cuda", generator=gen)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result.update(bf16_losses=losses, bf16_step_s=sorted(times[2:])[len(times[2:]) // 2])
    del model, optimizer
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=False)
    try:
        fp8_acc = accelerator_for(fp8plug.Accelerator, world, mixed_precision="fp8")
        model = load(args.model_dir, fp8_acc)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fp8_acc.prepare(model, optimizer)
        result["refusal"] = None
    except ConversionError as exc:
        result["refusal"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - any other failure is what the test must see
        result["refusal"] = None
        result["error"] = f"{type(exc).__name__}: {exc}"
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
