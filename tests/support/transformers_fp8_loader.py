"""Load an FP8 checkpoint with transformers alone, in a child process that never imports fp8plug,
and bring back its logits and greedy tokens beside the high-precision reference's: the GPU tests
of fp8plug's exports (tests/gpu/test_export.py, test_export_experts.py) hold the two against each
other, so that no fp8plug code is on the load or inference path."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.processes import ROOT, child_env

NEW_TOKENS = 32  # greedy tokens generated after the prompt

LOADER = textwrap.dedent("""
    import sys
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    reference, checkpoint, layout, mode, prompt_file, out = sys.argv[1:7]
    prompt = torch.load(prompt_file).cuda()

    def run(model):
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=prompt).logits.float().cpu()
            tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=%(new)d, min_new_tokens=%(new)d, pad_token_id=0)
        return logits, tokens[:, prompt.shape[1]:].cpu()

    kwargs = {"dtype": torch.bfloat16, "device_map": "cuda"}
    result = {"reference": run(AutoModelForCausalLM.from_pretrained(reference, **kwargs))}
    if mode == "dequantize":
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
        except ValueError as exc:  # the per-tensor layout's config makes transformers refuse it
            if layout != "per_tensor":
                raise
            result["refused"] = str(exc)
            result["fp8plug_imported"] = "fp8plug" in sys.modules
            torch.save(result, out)
            sys.exit(0)
        result["linears"] = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)})
        experts = getattr(getattr(model.model.layers[0], "mlp", None), "experts", None)
        if experts is not None and hasattr(experts, "down_proj"):
            result["experts"] = (type(experts).__name__, str(experts.down_proj.dtype))
        result["fp8"] = run(model)
    except Exception as exc:  # transformers' FP8 kernels come from the Hub; say so where they cannot be had
        if mode == "dequantize" or not ("kernel" in str(exc).lower() or isinstance(exc, ImportError)):
            raise
        result["unavailable"] = f"{type(exc).__name__}: {exc}"
    result["fp8plug_imported"] = "fp8plug" in sys.modules
    torch.save(result, out)
""") % {"new": NEW_TOKENS}


def load_with_transformers(reference, checkpoint, layout: str, mode: str, prompt, tmp_path) -> dict:
    """The child's result: "reference" and "fp8" as (logits, greedy tokens), "linears" (the Linear
    classes of the FP8 model) and, for MoE models, "experts" (class and weight dtype); for the
    per-tensor layout, which transformers refuses, "refused" (its message) instead of "fp8". `mode`:
    "fp8_kernels" (transformers' FP8 modules) or "dequantize"; skips where the kernels cannot be had."""
    out = tmp_path / "result.pt"
    run = subprocess.run([sys.executable, "-c", LOADER, str(reference), str(checkpoint), layout, mode, str(prompt),
                          str(out)], cwd=ROOT, env=child_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    assert result["fp8plug_imported"] is False
    if "unavailable" in result:
        pytest.skip(f"transformers' FP8 kernels cannot be loaded here: {result['unavailable'][:300]}")
    return result
