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


import pytest
import torch

pytest.importorskip("transformers")

from fp8plug.checkpoints import export_formats as formats  # noqa: E402
from fp8plug.checkpoints.export import export_model, save_fp8_checkpoint  # noqa: E402
from tests.gpu.test_export import PROMPT, VOCAB, sequences, trained_in_fp8  # noqa: E402
from tests.support.moe_models import builder  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.transformers_fp8_loader import load_with_transformers  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="fp8plug's FP8 experts (torch._scaled_grouped_mm, rowwise) need sm_90")

_TRANSFORMERS = tuple(int(part) for part in __import__("transformers").__version__.split(".")[:2])
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
    accelerator, model = trained_in_fp8(build(**SIZES, **MODELS[name]), name)
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


@pytest.mark.parametrize("layout, mode", [("block", "fp8_kernels"), ("block", "dequantize"),
                                          ("per_tensor", "dequantize")])
def test_transformers_loads_the_fp8_experts(directories, layout, mode, tmp_path, request):
    reference, fp8_dirs, prompt = directories
    if request.node.callspec.params["directories"] == "mixtral" and mode == "dequantize" and _TRANSFORMERS < (5, 24):
        # transformers 5.17 (the GPU machine's) leaves Mixtral's renamed router weight in the checkpoint's
        # float32 under FineGrainedFP8Config while the rest loads in bf16, so its forward fails
        # (reproduced on the CPU; 5.24 loads it in bf16); docs/moe.md gives the user's workaround
        request.applymarker(pytest.mark.xfail(reason="transformers < 5.24 keeps Mixtral's router in float32 "
                                                     "under FineGrainedFP8Config", strict=False))
    result = load_with_transformers(reference, fp8_dirs[layout], layout, mode, prompt, tmp_path)
    if layout == "per_tensor":  # vLLM's and SGLang's layout: its config makes transformers refuse it
        assert "transformers reads layout='block'" in result["refused"], result.get("refused")
        return
    if mode == "fp8_kernels":  # the experts are transformers' FP8 experts, holding FP8 weights
        assert result["experts"] == ("FP8Experts", "torch.float8_e4m3fn"), result["experts"]
    (ref_logits, ref_tokens), (fp8_logits, fp8_tokens) = result["reference"], result["fp8"]
    sqnr = sqnr_db(fp8_logits, ref_logits)
    assert sqnr >= 25, f"{layout}/{mode}: logits {sqnr:.1f} dB from the reference's"
    assert torch.equal(fp8_tokens, ref_tokens), (layout, mode, fp8_tokens, ref_tokens)
