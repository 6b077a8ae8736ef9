"""A model built on the meta device, converted, then given memory trains from its first step exactly
like the same model converted on the CPU: the native engine's non-persistent scaling state and the
GEMM counters start afresh when materialised, instead of holding whatever memory held (which gave
NaN, or with amax_compute_algo="max" a 93% output error that persisted)."""

import copy

import pytest
import torch
from torch import nn

from fp8plug import FP8RecipeKwargs, convert_model, fp8_coverage

STEPS = 3


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def run(model):
    """STEPS training steps of SGD; each step's output, and the scaling state at the end."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    outputs = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(32, 32, generator=generator)
        out = model(x)
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs, [m.fp8_scale.clone() for m in model if hasattr(m, "fp8_scale")]


def materialise_to_empty(model, state):
    model.to_empty(device="cpu")
    model.load_state_dict(state)


def materialise_assign(model, state):  # how transformers' low-memory loading fills a meta model
    model.load_state_dict(state, assign=True)


@pytest.mark.parametrize("algo", ["most_recent", "max"])
@pytest.mark.parametrize("materialise", [materialise_to_empty, materialise_assign])
@pytest.mark.parametrize("empty", ["device", "init_empty_weights"])
def test_meta_converted_model_trains_like_cpu_converted(algo, materialise, empty):
    recipe = FP8RecipeKwargs(backend="native", amax_compute_algo=algo)
    reference = build()
    state = copy.deepcopy(reference.state_dict())
    convert_model(reference, recipe=recipe)
    if empty == "device":
        with torch.device("meta"):
            model = build()
    else:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = build()
    assert model[0].weight.is_meta
    convert_model(model, recipe=recipe)
    materialise(model, state)

    expected_outputs, expected_scales = run(reference)
    outputs, scales = run(model)
    for step, (out, expected) in enumerate(zip(outputs, expected_outputs)):
        assert torch.isfinite(out).all(), f"step {step}"
        assert torch.equal(out, expected), f"step {step}: max difference {(out - expected).abs().max()}"
    assert all(torch.equal(a, b) for a, b in zip(scales, expected_scales))
    # the counters started at zero too: STEPS forward calls of each of the two Linears
    assert fp8_coverage(model) == fp8_coverage(reference)
    assert fp8_coverage(model)["fp8_gemms"] == 2 * STEPS
