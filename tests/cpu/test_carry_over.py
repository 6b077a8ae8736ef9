"""fp8plug.layers.carry_over: what a sharding plan or another wrapper put on a module survives its
replacement by an FP8 module and back (hooks, a forward replaced on the instance as transformers'
tp_plan does, marks), without fp8plug's own hooks, on one process (the DTensor runs are
tests/cpu/test_tensor_parallel.py)."""

import functools

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug.layers.carry_over import CARRIED, carry_over


def _wrap_forward(module, log):
    """A forward replaced on the instance, closing over the module and its bound forward (the shape
    of transformers' TensorParallelLayer.install_forward)."""
    original_forward = module.forward

    def wrapped(*args, **kwargs):
        log.append(type(module).__name__)
        return original_forward(*args, **kwargs) * 2

    module.forward = wrapped
    module._is_hooked = True


def test_hooks_forward_and_marks_carry_over_both_ways():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).train()
    seen, log = [], []
    model[0].register_forward_pre_hook(lambda mod, args, kwargs: seen.append(("pre", type(mod).__name__)),
                                       with_kwargs=True)
    model[0].register_forward_hook(lambda mod, args, out: seen.append(("post", type(mod).__name__)))
    _wrap_forward(model[1], log)
    x = torch.randn(16, 32)
    plain = model(x)
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native"))
    assert [type(m).__name__ for m in model] == ["NativeFP8Linear"] * 2
    seen.clear(), log.clear()
    fp8 = model(x)
    assert seen == [("pre", "NativeFP8Linear"), ("post", "NativeFP8Linear")]
    assert log == ["NativeFP8Linear"] and model[1]._is_hooked
    assert getattr(model[1], CARRIED) == ("forward", "_is_hooked")
    assert not torch.equal(fp8, plain) and (fp8 - plain).norm() / plain.norm() < 0.1  # FP8 ran, doubled
    assert fp8plug.fp8_coverage(model)["fp8_gemms"] == 2
    fp8plug.unconvert_model(model)
    seen.clear(), log.clear()
    assert torch.allclose(model(x), plain)
    assert seen == [("pre", "Linear"), ("post", "Linear")] and log == ["Linear"]
    assert all(type(h).__module__ != "fp8plug.layers.gemm_counts" for h in model[0]._forward_pre_hooks.values())
    assert CARRIED not in vars(model[1])  # nothing of fp8plug left on a plain module


def test_a_wrapper_calling_a_method_the_replacement_lacks_is_refused():
    class Custom(nn.Linear):
        def special(self, x):
            return x

    old = Custom(16, 16)
    old.forward = functools.partial(lambda bound, x: bound(x), old.special)
    with pytest.raises(ValueError, match="special.*modules_to_ignore"):
        carry_over(old, nn.Linear(16, 16))
