"""Delayed scaling that stays right: across ranks, after NaN/inf, at extreme amaxes, with layers
used several times per step and with activation checkpointing; recipe bounds and copies.

Each test checks numbers against a float64 reference or an unbroken run. The DDP tests run two
processes over gloo (torch.multiprocessing), hand-built DDP and fp8plug.Accelerator alike.
"""

import copy
import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8plug
from fp8plug import FP8RecipeKwargs, sync_fp8_scaling
from fp8plug.backends.native.engine import NativeFP8Linear
from tests.support.numerics import sqnr_db

NATIVE = dict(backend="native", auto_filter=False)


def rel_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def mlp(seed=0, width=64):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(**NATIVE, amax_history_len=16))
    return model


def reference_linear(layer, x):
    return F.linear(x.double(), layer.weight.double(), layer.bias.double())


# --- NaN, inf and extreme amaxes ------------------------------------------------------------------


def input_scaling_state(layer):
    """The input slot's history, scale and step count (the slot a bad input batch touches)."""
    return [t[..., 0].clone() for t in (layer.fp8_amax_history, layer.fp8_scale, layer.fp8_step)]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_bad_step_leaves_the_scale_and_the_next_step_recovers(algo, bad):
    """One batch with a NaN/inf (skipped by the user) changes neither the input's history nor its
    scale; a following batch 16x larger then casts exactly as in a run that never saw the bad
    batch. (The weight's slot saw a good amax in that step and records it as usual.)"""
    def run(with_bad_step):
        torch.manual_seed(0)
        layer = NativeFP8Linear(64, 64, amax_history_len=8, amax_compute_algo=algo)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            layer(torch.randn(32, 64, generator=gen))
            sync_fp8_scaling(layer)
        before = input_scaling_state(layer)
        if with_bad_step:
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
            x[3, 5] = bad
            layer(x)
            sync_fp8_scaling(layer)
            for a, b in zip(before, input_scaling_state(layer)):
                assert torch.equal(a, b)
        big = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 16
        layer(big)  # one step at the larger magnitude, so the history holds it
        sync_fp8_scaling(layer)
        out = layer(big)
        return rel_error(out, reference_linear(layer, big)), [*input_scaling_state(layer), layer.fp8_scale.clone()]

    clean_error, clean_state = run(False)
    error, state = run(True)
    assert error == pytest.approx(clean_error, rel=1e-6)
    assert error < 0.1
    for a, b in zip(clean_state, state):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_tiny_loss_scale_gives_finite_correct_gradients(scaling):
    """A loss scaled by 1e-36 makes grad_output amax ~1e-38: fp8_max / amax overflows float32
    unless clamped. Gradients must be finite and as accurate as at a normal scale."""
    torch.manual_seed(0)
    layer = NativeFP8Linear(64, 64, scaling=scaling, amax_history_len=4)
    x = torch.randn(32, 64, requires_grad=True)
    for step in range(3):
        x.grad = layer.weight.grad = None
        out = layer(x)
        (out.pow(2).sum() * 1e-36).backward()
        sync_fp8_scaling(layer)
        assert torch.isfinite(layer.fp8_scale).all()
    xd = x.detach().double().requires_grad_()
    wd = layer.weight.detach().double().requires_grad_()
    (F.linear(xd, wd, layer.bias.detach().double()).pow(2).sum() * 1e-36).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert layer.weight.grad.abs().max() > 0  # not silently zeroed
    assert sqnr_db(layer.weight.grad, wd.grad) >= 18
    assert sqnr_db(x.grad, xd.grad) >= 18


def test_zero_input_gives_zero_output_and_finite_state():
    layer = NativeFP8Linear(32, 32, bias=False, amax_history_len=4)
    for _ in range(2):
        out = layer(torch.zeros(16, 32))
        sync_fp8_scaling(layer)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isfinite(layer.fp8_scale).all()


# --- recipe bounds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("margin", 9), ("margin", -1), ("margin", 1024), ("interval", 0), ("interval", 10_001),
    ("amax_history_len", 0), ("amax_history_len", 10**9), ("auto_filter_tokens", 0),
    ("auto_filter_tokens", 2**40),
])
def test_numeric_fields_are_bounded(field, value):
    with pytest.raises(ValueError, match=rf"FP8RecipeKwargs\.{field}: .* use an integer from"):
        FP8RecipeKwargs(**{field: value})


def test_bounds_apply_to_the_environment_and_name_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "16")
    with pytest.raises(ValueError,
                       match=r"margin \(from ACCELERATE_FP8_MARGIN\): '16' is out of range; "
                             r"use an integer from 0 to 8"):
        FP8RecipeKwargs()
    monkeypatch.delenv("ACCELERATE_FP8_MARGIN")
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "1000000000")  # the config wizard's key
    with pytest.raises(ValueError, match="AMAX_HISTORY_LENGTH"):
        FP8RecipeKwargs()


def test_largest_allowed_margin_still_trains_accurately():
    torch.manual_seed(0)
    layer = NativeFP8Linear(64, 64, margin=8, amax_history_len=4)
    for _ in range(3):
        x = torch.randn(32, 64)
        out = layer(x)
        sync_fp8_scaling(layer)
    assert rel_error(out, reference_linear(layer, x)) < 0.1


# --- recipe copies ------------------------------------------------------------------------------------


def test_replace_and_copy_equal_the_directly_built_recipe(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "32")
    direct = FP8RecipeKwargs(backend="ao", scaling="rowwise")
    replaced = dataclasses.replace(FP8RecipeKwargs(backend="ao"), scaling="rowwise")
    assert replaced == direct
    for name in dataclasses.fields(FP8RecipeKwargs):
        if not name.name.startswith("_"):
            assert replaced.is_explicit(name.name) == direct.is_explicit(name.name), name.name
    assert replaced.amax_history_len == 32 and not replaced.is_explicit("amax_history_len")
    # what the caller gave stays given through replace, copy and deepcopy
    given = dataclasses.replace(FP8RecipeKwargs(backend="ao", fp8_format="E4M3"), scaling="rowwise")
    assert given.is_explicit("fp8_format") and given.fp8_format == "E4M3"
    for clone in (copy.copy(direct), copy.deepcopy(direct), dataclasses.replace(direct)):
        assert clone == direct and clone._explicit_fields == direct._explicit_fields


def test_replaced_ao_recipe_builds_the_same_torchao_config():
    pytest.importorskip("torchao")
    engine = fp8plug.get_backend("ao")
    direct = engine.float8_config(FP8RecipeKwargs(backend="ao", scaling="rowwise"))
    replaced = engine.float8_config(dataclasses.replace(FP8RecipeKwargs(backend="ao"), scaling="rowwise"))
    assert replaced == direct
    assert replaced.cast_config_grad_output.target_dtype == torch.float8_e4m3fn  # rowwise: E4M3 grads


# --- layers used several times per step -----------------------------------------------------------


def fp8_vs_float64_grads(run, params, inputs):
    """Gradients of `run(params, inputs)` in FP8 against the same computation in float64."""
    loss = run(params, inputs)
    loss.backward()
    fp8 = [p.grad.clone() for p in params]
    doubles = [p.detach().double().requires_grad_() for p in params]
    ref_loss = run(doubles, [x.double() for x in inputs], reference=True)
    ref_loss.backward()
    return fp8, [p.grad for p in doubles]


@pytest.mark.parametrize("pattern", ["twice_in_one_forward", "siamese", "no_grad_between"])
def test_layer_called_several_times_before_backward(pattern):
    torch.manual_seed(0)
    layer = NativeFP8Linear(64, 64, amax_history_len=4)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen) * 3

    def run(params, inputs, reference=False):
        w, bias = params
        x, y = inputs
        f = (lambda t: F.linear(t, w, bias)) if reference else layer
        if pattern == "twice_in_one_forward":  # weight sharing (ALBERT, universal transformers)
            return f(torch.tanh(f(x))).pow(2).mean()
        if pattern == "siamese":  # enc(a), enc(b), one backward
            return (f(x) - f(y)).pow(2).mean()
        out = f(x)
        with torch.no_grad():  # a train-mode no_grad forward between forward and backward
            f(y)
        return out.pow(2).mean()

    for step in range(3):  # step 0 scales from current amaxes; later steps from the history
        layer.weight.grad = layer.bias.grad = None
        fp8, ref = fp8_vs_float64_grads(run, [layer.weight, layer.bias], [a, b])
        torch.optim.SGD(layer.parameters(), lr=0.0).step()  # ends the step: history advances once
        assert layer.fp8_step.tolist() == [step + 1] * 3
        assert sqnr_db(fp8[0], ref[0]) >= 18 and sqnr_db(fp8[1], ref[1]) >= 18


# --- activation checkpointing -----------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))
        self.mode = mode

    def forward(self, x):
        for block in self.blocks:
            if self.mode == "plain":
                x = x + block(x)
            else:
                x = x + checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def train_losses(model, steps=5, lr=1e-2):
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(**NATIVE, amax_history_len=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen, requires_grad=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_matches_the_plain_run(mode):
    """The recompute casts with the original forward's scales and the history advances once per
    step, so a checkpointed run is the plain run, loss for loss and state for state."""
    plain, ckpt = Checkpointed("plain"), Checkpointed(mode)
    assert train_losses(ckpt) == train_losses(plain)
    for a, b in zip(plain.modules(), ckpt.modules()):
        if isinstance(a, NativeFP8Linear):
            assert a.fp8_step.tolist() == [5, 5, 5]
            assert torch.equal(a.fp8_amax_history, b.fp8_amax_history)
            assert torch.equal(a.fp8_scale, b.fp8_scale)
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(a, b)


def test_hugging_face_gradient_checkpointing_matches_the_plain_run():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True,
    )

    def run(checkpointed):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        model.train()
        if checkpointed:
            model.gradient_checkpointing_enable()
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(**NATIVE, amax_history_len=4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(4):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, model

    plain_losses, plain = run(False)
    ckpt_losses, ckpt = run(True)
    assert ckpt.is_gradient_checkpointing
    assert ckpt_losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    layer = ckpt.model.layers[0].mlp.up_proj
    assert isinstance(layer, NativeFP8Linear) and layer.fp8_step.tolist() == [4, 4, 4]


# --- across ranks ---------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def _unequal_batch(rank, step):
    """Rank r's inputs are 4**r times rank 0's."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(32, 64, generator=gen) * 4.0**rank


def _hand_built_ddp(rank, world, port, out_dir):
    _join(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcast_buffers=True, the default
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    collectives = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: collectives.append(1) or all_reduce(*args, **kwargs)
    for step in range(4):
        ddp(_unequal_batch(rank, step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.all_reduce = all_reduce
    x = _unequal_batch(rank, 99)
    with torch.no_grad():
        error = rel_error(model[0](x), reference_linear(model[0], x))
    torch.save({"error": error, "scale": model[0].fp8_scale.clone(), "history": model[0].fp8_amax_history.clone(),
                "collectives": len(collectives)}, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def _leave():
    """End a worker without the interpreter's teardown: gloo's process-group destructor can abort
    or deadlock there ("terminate called without an active exception") after the work is done."""
    dist.barrier()  # every rank is done with its collectives
    os._exit(0)


def _accelerator_resume(rank, world, port, out_dir):
    _join(rank, world, port)
    from fp8plug import Accelerator

    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def accelerator():
        return Accelerator(cpu=True, mixed_precision="fp8",
                           kwargs_handlers=[FP8RecipeKwargs(**NATIVE, amax_history_len=16)])

    def steps(acc, model, optimizer, start, stop):
        losses = []
        for step in range(start, stop):
            loss = model(_unequal_batch(rank, step)).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    acc = accelerator()
    whole = steps(acc, *acc.prepare(*fresh()), 0, 6)
    acc = accelerator()
    model, optimizer = acc.prepare(*fresh())
    first = steps(acc, model, optimizer, 0, 3)
    acc.save_state(os.path.join(out_dir, "ckpt"))
    saved = acc.unwrap_model(model)[0].fp8_amax_history.clone()
    acc = accelerator()
    model, optimizer = acc.prepare(*fresh())
    acc.load_state(os.path.join(out_dir, "ckpt"))
    loaded = acc.unwrap_model(model)[0]
    state = {"history": loaded.fp8_amax_history.clone(), "scale": loaded.fp8_scale.clone()}
    resumed = first + steps(acc, model, optimizer, 3, 6)
    torch.save({"whole": whole, "resumed": resumed, "saved": saved, **state},
               os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def spawn(worker, tmp_path, world=2):
    torch.multiprocessing.spawn(worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow
def test_hand_built_ddp_shares_one_scale_from_all_ranks(tmp_path):
    """Rank 1's inputs are 4x rank 0's. The scales are reduced across ranks (not rank 0's
    broadcast by DDP): every rank holds the same state, and rank 1's output is as accurate as
    rank 0's (the bug this guards against gave rank 1 35-53% error)."""
    results = spawn(_hand_built_ddp, tmp_path)
    assert torch.equal(results[0]["scale"], results[1]["scale"])
    assert torch.equal(results[0]["history"], results[1]["history"])
    # the input history holds the max over ranks: rank 1's larger inputs
    assert results[0]["history"][0, 0].item() > 3 * 4.0
    for result in results:
        assert result["error"] < 0.1, results
        assert result["collectives"] == 4  # one amax all-reduce per step for both layers, not one per layer


@pytest.mark.slow
def test_accelerator_ddp_resume_restores_the_shared_state_exactly(tmp_path):
    results = spawn(_accelerator_resume, tmp_path)
    for rank, result in enumerate(results):
        assert result["resumed"] == result["whole"], (rank, result)  # bit-identical continuation
        assert torch.equal(result["history"], result["saved"])
    assert torch.equal(results[0]["history"], results[1]["history"])
    assert torch.equal(results[0]["scale"], results[1]["scale"])
