"""An FP8 checkpoint that transformers itself loads, on the GPU.

A small Llama (tied and untied head) trains with fp8plug.Accelerator on CUDA (the engine it
selects) until it continues arithmetic token sequences confidently, is exported (`export_model`), written with
`save_pretrained` (the reference) and with `save_fp8_checkpoint` in each layout, and every
directory is loaded by `AutoModelForCausalLM.from_pretrained` in a child process that never
imports fp8plug (so no fp8plug code is on the load or inference path). Checked per layout: the
FP8 model's logits within 25 dB SQNR of the reference's, and 32 greedily generated tokens
identical. Two ways of loading: transformers' FP8 kernels (FP8Linear; they come from the Hub's
kernels-community/finegrained-fp8 through the `kernels` package, so this case is skipped, saying
why, where they cannot be had) and FineGrainedFP8Config(dequantize=True), transformers' own
dequantizing load.
"""


import pytest
import torch

pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug.checkpoints import export_formats as formats  # noqa: E402
from fp8plug.checkpoints.export import export_model, save_fp8_checkpoint  # noqa: E402
from tests.support.hf import fresh  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.transformers_fp8_loader import load_with_transformers  # noqa: E402

VOCAB = 512
SEQ = 64
PROMPT = 16


def llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def sequences(batch, generator, device):
    """Arithmetic sequences mod VOCAB: each token is the one before plus a stride the context shows."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    stride = torch.tensor([1, 2, 3, 5, 7, 11])[torch.randint(0, 6, (batch, 1), generator=generator)]
    return ((start + stride * torch.arange(SEQ)) % VOCAB).to(device)


def trained_in_fp8(model, name: str):
    """(accelerator, model): `model` trained with fp8plug.Accelerator on `sequences` until it continues
    them confidently (a few hundred steps; only the second token is a guess, one stride of 6: loss
    ~0.03), so that greedy tokens are not noise."""
    fresh()
    accelerator = fp8plug.Accelerator(mixed_precision="fp8")
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
    return accelerator, model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def directories(request, tmp_path_factory):
    """(reference directory, {layout: FP8 directory}, prompt ids file, engine name) for a model
    trained in FP8 on CUDA."""
    tied = request.param
    accelerator, model = trained_in_fp8(llama(tied), "the model")
    engine = accelerator.fp8_engine.name
    plain = export_model(accelerator.unwrap_model(model)).eval()
    root = tmp_path_factory.mktemp("tied" if tied else "untied")
    plain.save_pretrained(root / "reference")
    fp8_dirs = {}
    for layout in formats.LAYOUTS:
        report = save_fp8_checkpoint(plain, root / layout, layout=layout, max_shard_size="8MB")
        assert len(report.quantized) == 4 * 7 and "model.safetensors.index.json" in report.files
        fp8_dirs[layout] = root / layout
    torch.save(sequences(4, torch.Generator().manual_seed(123), "cpu")[:, :PROMPT], root / "prompt.pt")
    return root / "reference", fp8_dirs, root / "prompt.pt", engine


@pytest.mark.parametrize("mode", ["fp8_kernels", "dequantize"])
@pytest.mark.parametrize("layout", formats.LAYOUTS)
def test_transformers_loads_the_fp8_checkpoint(directories, layout, mode, tmp_path):
    reference, fp8_dirs, prompt, engine = directories
    result = load_with_transformers(reference, fp8_dirs[layout], layout, mode, prompt, tmp_path)
    if layout == "per_tensor":  # vLLM's and SGLang's layout: its config makes transformers refuse it
        assert "transformers reads layout='block'" in result["refused"], result.get("refused")
        return
    if mode == "fp8_kernels":
        assert "FP8Linear" in result["linears"], result["linears"]
    (ref_logits, ref_tokens), (fp8_logits, fp8_tokens) = result["reference"], result["fp8"]
    sqnr = sqnr_db(fp8_logits, ref_logits)
    assert sqnr >= 25, f"{layout}/{mode} (trained with {engine}): logits {sqnr:.1f} dB from the reference's"
    assert torch.equal(fp8_tokens, ref_tokens), (layout, mode, fp8_tokens, ref_tokens)
