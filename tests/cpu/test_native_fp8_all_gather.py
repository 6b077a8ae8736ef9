"""FSDP2 all-gathering the native engine's weights in FP8 (fp8plug.backends.native.fsdp_fp8), on two
CPU processes over gloo: torch's fully_shard runs the extension hooks on the CPU too.

Per-tensor scaling makes the FP8 all-gather exact: the max over the shards' amaxes is the whole
weight's amax, so each rank's shard is cast with the scale a cast after the gather would use, to
the same bytes. So the run that gathers FP8 must train to the very same losses and weights as the
run that gathers fp32 and casts after (dynamic and delayed weight scaling), while moving a quarter
of the weight bytes; and its state dicts, sharded and full, are plain tensors that load into a
plain model.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

IN, HIDDEN, OUT, STEPS = 64, 128, 64, 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def _train(scaling, fp8_all_gather, rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fp8plug
    from fp8plug.backends.native.fsdp_fp8 import FP8AllGatherWeight

    model = _model()
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(
        backend="native", scaling=scaling, enable_fsdp_float8_all_gather=fp8_all_gather or None))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    wrapped = [type(p.to_local()).__name__ for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gathered = {"bytes": 0, "dtypes": set()}
    # FSDP2's all-gather: dist.all_gather_single (torch 2.13) or all_gather_into_tensor (older)
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(output, input, *args, **kwargs):
            gathered["bytes"] += input.numel() * input.element_size()
            return real[name](output, input, *args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counting(name))
    torch.manual_seed(100 + rank)
    losses = []
    try:
        for _ in range(STEPS):
            x = torch.randn(32, IN)
            loss = (model(x) - x.flip(-1)).pow(2).mean()
            loss.backward()
            for fsdp_param in model[0]._get_fsdp_state()._fsdp_param_group.fsdp_params:
                gathered["dtypes"].update(str(t.dtype) for t in fsdp_param.all_gather_outputs)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    finally:
        for name in names:
            setattr(dist, name, real[name])
    grads_plain = all(type(s).__name__ == "Tensor" for s in
                      (optimizer.state[p]["exp_avg"].to_local() for p in model.parameters()))
    return model, dict(losses=torch.stack(losses), bytes=gathered["bytes"], dtypes=sorted(gathered["dtypes"]),
                       wrapped=wrapped, states_plain=grads_plain,
                       wrapped_weight=isinstance(model[0].weight.to_local(), FP8AllGatherWeight))


def _worker(rank, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    for scaling in ("dynamic", "delayed"):
        plain_model, plain = _train(scaling, False, rank)
        model, fp8 = _train(scaling, True, rank)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        full_plain = get_model_state_dict(plain_model, options=StateDictOptions(full_state_dict=True))
        sharded = model.state_dict()
        reference = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
        incompatible = reference.load_state_dict(full, strict=True)
        # a sharded state dict loads back into the FP8-all-gather model, which keeps gathering in FP8
        set_model_state_dict(model, sharded)
        result[scaling] = dict(
            plain=plain, fp8=fp8,
            full_types=sorted({type(v).__name__ for v in full.values()}),
            sharded_local_types=sorted({type(v.to_local()).__name__ for v in sharded.values()}),
            full_equal=all(torch.equal(full[k], full_plain[k]) for k in full),
            loads_into_plain=not incompatible.missing_keys and not incompatible.unexpected_keys
            and all(torch.equal(v, full[k]) for k, v in reference.state_dict().items()),
            still_wrapped=type(model[0].weight.to_local()).__name__,
        )
    if rank == 0:
        torch.save(result, Path(out_dir, "result.pt"))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can hang at exit (see tests/cpu/test_coverage.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("fp8ag")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return torch.load(tmp / "result.pt", weights_only=False)


@pytest.mark.slow  # two processes, four trainings: about 10 s
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_fp8_all_gather_trains_exactly_as_the_cast_after_the_gather(results, scaling):
    r = results[scaling]
    assert r["fp8"]["wrapped_weight"] and not r["plain"]["wrapped_weight"]
    # per-tensor scales from the whole weight's amax: the same FP8 bytes, so the same losses and weights
    torch.testing.assert_close(r["fp8"]["losses"], r["plain"]["losses"], rtol=0, atol=0)
    assert r["full_equal"]
    assert r["fp8"]["losses"][-1] < r["fp8"]["losses"][0]  # it trains


@pytest.mark.slow  # two processes, four trainings: about 10 s
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_weights_are_all_gathered_in_float8(results, scaling):
    r = results[scaling]
    assert "torch.float8_e4m3fn" in r["fp8"]["dtypes"] and "torch.float8_e4m3fn" not in r["plain"]["dtypes"]
    # fp32 parameters here: a weight gathers 1 byte an element instead of 4, a bias still 4
    weights, biases = IN * HIDDEN + HIDDEN * OUT, HIDDEN + OUT
    assert r["fp8"]["bytes"] / r["plain"]["bytes"] == pytest.approx((weights + 4 * biases) / (4 * weights + 4 * biases))


@pytest.mark.slow  # two processes, four trainings: about 10 s
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_state_dicts_and_optimizer_states_stay_plain(results, scaling):
    r = results[scaling]
    assert r["full_types"] == ["Tensor"]
    assert r["sharded_local_types"] == ["Tensor"]
    assert r["loads_into_plain"]
    assert r["fp8"]["states_plain"]
    assert r["still_wrapped"] == "FP8AllGatherWeight"


def test_only_an_argument_turns_it_on_and_unconverting_gives_the_plain_weight_back(monkeypatch):
    import fp8plug
    from fp8plug.backends import get_backend
    from fp8plug.backends.native.fsdp_fp8 import FP8AllGatherWeight
    from fp8plug.recipe.plans import make_plan
    from fp8plug.tuning.hardware import DeviceInfo

    engine = get_backend("native")
    monkeypatch.setenv("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "true")  # `accelerate launch`'s default
    cpu = DeviceInfo("cpu", "cpu")
    assert not make_plan(engine, fp8plug.FP8RecipeKwargs(backend="native"), cpu).fsdp_float8_all_gather
    plan = make_plan(engine, fp8plug.FP8RecipeKwargs(backend="native", enable_fsdp_float8_all_gather=True), cpu)
    assert plan.fsdp_float8_all_gather
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.convert(model, plan)
    assert isinstance(model[0].weight, FP8AllGatherWeight) and engine.has_storageless_weights()
    state = model.state_dict()
    assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in state.items())
    out = model(torch.randn(16, IN))  # unsharded, the wrapper computes as the plain weight
    out.sum().backward()
    assert type(model[0].weight.grad) is torch.Tensor
    engine.unconvert(model)
    assert type(model[0]) is nn.Linear and type(model[0].weight) is nn.Parameter
    assert torch.equal(model[0].weight, before["0.weight"])
