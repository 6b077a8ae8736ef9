"""An FP8 checkpoint of an MoE model, FP8 experts included, that transformers itself loads on the GPU.

A small Mixtral and a small Qwen3-MoE (expert size 128, so transformers' FP8Experts scale grid
[E, ceil(2I/128), ...] equals the merged per-expert grid [E, 2*ceil(I/128), ...]) train with
fp8plug.Accelerator (experts in FP8) until they continue arithmetic sequences confidently, are
exported, written with `save_pretrained` (the reference) and with `save_fp8_checkpoint`, and loaded by
`AutoModelForCausalLM.from_pretrained(dir)` in a child process that never imports fp8plug. Checked:
logits within 25 dB SQNR of the reference's and 32 greedy tokens identical.

Modes: "fp8_kernels" (the block layout: the experts load as transformers' FP8Experts with FP8
weights; its kernels come from the Hub through `kernels`, so the case is skipped, saying why,
where they cannot be had) and "dequantize" (FineGrainedFP8Config(dequantize=True), both layouts).
The per-tensor layout is not tried with FP8 kernels: transformers merges per-expert scalar scales
into FP8Experts' [E, 2, 1] per-tensor scale with Concatenate(dim=1), which 1-D stacked scalars
cannot take (docs/moe.md); vLLM and SGLang read that layout.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug.checkpoints import export_formats as formats  # noqa: E402
from fp8plug.checkpoints.export import export_model, save_fp8_checkpoint  # noqa: E402
from tests.gpu.test_export import NEW_TOKENS, PROMPT, VOCAB, sequences  # noqa: E402
from tests.support.hf import fresh  # noqa: E402
from tests.support.moe_models import builder  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.processes import ROOT, child_env  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="fp8plug's FP8 experts (torch._scaled_grouped_mm, rowwise) need sm_90")

SIZES = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, max_position_embeddings=128)
MODELS = {"mixtral": dict(intermediate_size=128),
          "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=128, head_dim=64)}


@pytest.fixture(scope="module", params=list(MODELS))
def directories(request, tmp_path_factory):
    """(reference directory, {layout: FP8 directory}, prompt file) for an MoE model trained in FP8."""
    name = request.param
    build = builder(name)
    if build is None:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {name}")
    fresh()
    accelerator = fp8plug.Accelerator(mixed_precision="fp8")
    model = build(**SIZES, **MODELS[name])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, opt = accelerator.prepare(model, opt)
    generator = torch.Generator().manual_seed(0)
    model.train()
    average = None
    for step in range(2000):
        ids = sequences(32, generator, accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        average = loss.item() if average is None else 0.9 * average + 0.1 * loss.item()
        if step >= 200 and average < 0.25:
            break
    assert average < 0.25, f"{name} did not learn the sequences (loss {average:.3f}); greedy tokens would be noise"
    plain = export_model(accelerator.unwrap_model(model)).eval()
    root = tmp_path_factory.mktemp(name)
    plain.save_pretrained(root / "reference")
    fp8_dirs = {}
    for layout in formats.LAYOUTS:
        report = save_fp8_checkpoint(plain, root / layout, layout=layout)
        kept = [why for fqn, why in report.kept.items() if fqn.endswith("experts")]
        if not report.experts and any("reverse conversion" in why for why in kept):
            pytest.skip(f"this transformers' reverse weight conversion is not read per expert here: {kept[0]}")
        assert report.experts == [f"model.layers.{i}.mlp.experts" for i in range(2)], report
        fp8_dirs[layout] = root / layout
    torch.save(sequences(4, torch.Generator().manual_seed(123), "cpu")[:, :PROMPT], root / "prompt.pt")
    return root / "reference", fp8_dirs, root / "prompt.pt"


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
    if layout == "per_tensor":
        kwargs["key_mapping"] = %(keys)r
    if mode == "dequantize":
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
        experts = model.model.layers[0].mlp.experts
        result["experts"] = (type(experts).__name__, str(experts.down_proj.dtype))
        result["fp8"] = run(model)
    except Exception as exc:  # transformers' FP8 kernels come from the Hub; say so where they cannot be had
        if mode == "dequantize" or not ("kernel" in str(exc).lower() or isinstance(exc, ImportError)):
            raise
        result["unavailable"] = f"{type(exc).__name__}: {exc}"
    result["fp8plug_imported"] = "fp8plug" in sys.modules
    torch.save(result, out)
""") % {"new": NEW_TOKENS, "keys": formats.TRANSFORMERS_PER_TENSOR_KEYS}


@pytest.mark.parametrize("layout, mode", [("block", "fp8_kernels"), ("block", "dequantize"),
                                          ("per_tensor", "dequantize")])
def test_transformers_loads_the_fp8_experts(directories, layout, mode, tmp_path):
    reference, fp8_dirs, prompt = directories
    out = tmp_path / "result.pt"
    run = subprocess.run([sys.executable, "-c", LOADER, str(reference), str(fp8_dirs[layout]), layout, mode,
                          str(prompt), str(out)], cwd=ROOT, env=child_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    assert result["fp8plug_imported"] is False
    if "unavailable" in result:
        pytest.skip(f"transformers' FP8 kernels cannot be loaded here: {result['unavailable'][:300]}")
    if mode == "fp8_kernels":  # the experts are transformers' FP8 experts, holding FP8 weights
        assert result["experts"] == ("FP8Experts", "torch.float8_e4m3fn"), result["experts"]
    (ref_logits, ref_tokens), (fp8_logits, fp8_tokens) = result["reference"], result["fp8"]
    sqnr = sqnr_db(fp8_logits, ref_logits)
    assert sqnr >= 25, f"{layout}/{mode}: logits {sqnr:.1f} dB from the reference's"
    assert torch.equal(fp8_tokens, ref_tokens), (layout, mode, fp8_tokens, ref_tokens)
