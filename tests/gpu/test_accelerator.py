"""fp8plug.Accelerator on one sm_89+ GPU with the native, torchao and TransformerEngine engines:
training close to bf16, plain checkpoints both ways, save_state/load_state, gradient accumulation.

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_accelerator.py -q
"""

import copy

import pytest
import torch

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, synthetic_batches
from tests.support.hf import fresh
from tests.support.processes import child_env
from tests.support.training import tail_mean, train

CFG = DecoderConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=512, max_seq_len=64)
ENGINES = ["native", "ao", "te"]
STEPS = 150
MAX_GAP = 0.05  # relative gap of the final loss (mean of the last 10 steps) to bf16's
LINEARS = {f"layers.{i}.{name}" for i in range(2) for name in ("q", "k", "v", "o", "gate", "up", "down")}


def accelerator(backend=None, **kwargs):
    if backend is None:
        return fp8plug.Accelerator(mixed_precision="bf16", **kwargs)
    recipe = FP8RecipeKwargs(backend=backend, modules_to_ignore=["lm_head"])
    return fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], **kwargs)


def base_model(seed=0):
    torch.manual_seed(seed)
    return TinyDecoder(CFG)


def data(n=32):
    return synthetic_batches(n, batch=16, seq=64, vocab=CFG.vocab_size, seed=1, device="cuda")


def run(backend, model, steps=STEPS, **kwargs):
    fresh()
    acc = accelerator(backend, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = acc.prepare(model, optimizer)
    losses = train(model, optimizer, data(), steps, accelerator=acc)
    return acc, model, losses


@pytest.fixture(scope="module")
def bf16_final():
    fresh()
    _, _, losses = run(None, base_model())
    return tail_mean(losses)


@pytest.mark.parametrize("backend", ENGINES)
def test_trains_within_5_percent_of_bf16(backend, bf16_final):
    acc, model, losses = run(backend, base_model())
    assert acc.mixed_precision == "fp8" and acc.fp8_engine.name == backend
    converted = set(acc.fp8_reports[0].converted)  # TransformerEngine also converts the norms
    assert LINEARS <= converted and "lm_head" not in converted, str(acc.fp8_reports[0])
    final = tail_mean(losses)
    assert losses[0] > final  # it learned
    gap = abs(final - bf16_final) / bf16_final
    print(f"{backend}: fp8 {final:.4f} bf16 {bf16_final:.4f} gap {gap:.2%}")
    assert gap <= MAX_GAP, (backend, final, bf16_final)


@pytest.mark.parametrize("backend", ENGINES)
def test_checkpoints_have_plain_keys_and_load_strictly_both_ways(backend, tmp_path):
    acc, model, _ = run(backend, base_model(), steps=3)
    plain_keys = set(TinyDecoder(CFG).state_dict())
    state = acc.get_state_dict(model)
    assert set(state) == plain_keys
    assert set(acc.unwrap_model(model).state_dict()) == plain_keys
    acc.save_model(model, tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == plain_keys
    plain = TinyDecoder(CFG)
    plain.load_state_dict(saved, strict=True)
    torch.testing.assert_close(plain.layers[0].q.weight, state["layers.0.q.weight"].cpu().float(), rtol=0, atol=0)

    source = base_model(seed=7)
    acc.unwrap_model(model).load_state_dict(source.state_dict(), strict=True)
    reloaded = acc.get_state_dict(model)["layers.0.up.weight"].cpu().float()
    torch.testing.assert_close(reloaded, source.layers[0].up.weight, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["native", "te"])
def test_save_state_load_state_restores_fp8_state(backend, tmp_path):
    batches = data()
    init = base_model()
    acc, model, _ = run(backend, copy.deepcopy(init), steps=5)
    acc.save_state(tmp_path / "ckpt")
    saved_fp8 = acc.fp8_engine.fp8_state(acc.unwrap_model(model))
    assert saved_fp8, "the engine reported no FP8 scaling state after 5 FP8 steps"
    optimizer = acc._optimizers[0]
    reference = train(model, optimizer, batches[5:10], 5, accelerator=acc)

    fresh()
    acc2 = accelerator(backend)
    model2 = base_model(seed=3)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=2e-3)
    model2, optimizer2 = acc2.prepare(model2, optimizer2)
    acc2.load_state(tmp_path / "ckpt")
    loaded = acc2.fp8_engine.fp8_state(acc2.unwrap_model(model2))
    assert loaded.keys() == saved_fp8.keys()
    for fqn, entry in saved_fp8.items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[fqn][name], value), (fqn, name)
    resumed = train(model2, optimizer2, batches[5:10], 5, accelerator=acc2)
    for a, b in zip(resumed, reference):
        assert abs(a - b) / b <= 1e-2, (resumed, reference)


def test_te_gradient_accumulation_marks_first_microbatch():
    fresh()
    acc = accelerator("te", gradient_accumulation_steps=2)
    engine = acc.fp8_engine
    seen = []
    original = engine.microbatch

    def spy(is_first):
        seen.append(is_first)
        return original(is_first)

    engine.microbatch = spy
    try:
        model = base_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        model, optimizer = acc.prepare(model, optimizer)
        losses = train(model, optimizer, data(), 40, accelerator=acc)
    finally:
        del engine.microbatch
    assert seen[:4] == [True, False, True, False] and len(seen) == 40
    assert all(torch.isfinite(torch.tensor(losses)))
    assert tail_mean(losses) < losses[0] * 0.9


def test_launch_with_the_one_gpu_example_config(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = child_env(tmp_path)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "examples" / "configs" / "gpu_fp8.yaml"), str(root / "examples" / "train_accelerate.py"),
           "--steps", "30", "--batch", "16", "--seq", "64", "--vocab", "256", "--dim", "128", "--ffn", "512",
           "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    result = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert result["engine"] == "te" and result["mixed_precision"] == "fp8"
    assert result["recipe"]["amax_compute_algo"] == "max" and result["recipe"]["amax_history_len"] == 1024
    losses = result["losses"]
    assert all(x == x for x in losses) and sum(losses[-5:]) / 5 < losses[0]
    assert result["weights"]["keys"] == 22  # plain keys: no TransformerEngine _extra_state


@pytest.mark.parametrize("held", ["eager", "compiled after prepare", "compiled before prepare", "dynamo_backend"])
def test_the_default_is_one_engine_however_the_model_is_held(held, bf16_final):
    """With no backend given, the engine does not depend on how the user will compile
    (the Accelerator cannot see a torch.compile(model) after prepare coming), and each way trains
    in FP8 to within 5% of bf16."""
    fresh()
    acc = fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(auto_filter=False)],
                              dynamo_backend="inductor" if held == "dynamo_backend" else "no")  # tiny layers kept
    assert acc.fp8_selection.mode == ("compiled" if held == "dynamo_backend" else "any")
    assert acc.fp8_engine.name == "native" and acc.fp8_recipe.scaling == "dynamic", acc.fp8_selection.explain()
    model = base_model()
    if held == "compiled before prepare":
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = acc.prepare(model, optimizer)
    if held == "compiled after prepare":
        model = torch.compile(model)
    losses = train(model, optimizer, data(), STEPS, accelerator=acc)
    coverage = fp8plug.fp8_coverage(model)
    assert coverage["fp8_gemms"] > 0 and coverage["high_precision_gemms"] == 0, coverage
    gap = abs(tail_mean(losses) - bf16_final) / bf16_final
    assert gap <= MAX_GAP, (held, tail_mean(losses), bf16_final)
