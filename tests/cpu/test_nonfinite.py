"""A bad batch stays visible and leaves no trace.

The native engine's cast saturated every value to FP8's range, inf included, so a batch whose
bf16 loss is inf/NaN gave a finite loss, the usual `isfinite(loss)` skip never fired, and the bad
batch was trained on. Now a non-finite value becomes NaN in FP8, so the output is non-finite
wherever bf16's is (per element for native; for torchao's per-tensor scaling an inf poisons the
whole tensor's scale, so at least there). And a skipped step (no optimizer step) used to leave its
NaN recorded, which then dropped the next good step's amax: the next good step must scale exactly
as in a run that never saw the bad batch."""

import warnings

import pytest
import torch
from torch import nn

from fp8plug import FP8RecipeKwargs, convert_model


def pair(backend, scaling=None, dtype=torch.float32):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).to(dtype)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).to(dtype)
    model.load_state_dict(reference.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_model(model, recipe=FP8RecipeKwargs(backend=backend, scaling=scaling))
    return reference.train(), model.train()


def bad_input(dtype):
    x = torch.randn(32, 32, dtype=dtype)
    x[3, 5] = float("inf")
    x[7, 1] = float("nan")
    x[9, 2] = -float("inf")
    return x


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_native_output_non_finite_exactly_where_high_precision_is(scaling):
    reference, model = pair("native", scaling)
    for step in range(2):  # before and after the first scale update
        x = bad_input(torch.float32) if step else torch.randn(32, 32)
        expected = torch.isfinite(reference(x))
        out = model(x)
        assert torch.equal(torch.isfinite(out), expected), f"step {step}"
        out.float().square().mean().backward()
        if step == 0:
            torch.optim.SGD(model.parameters(), lr=0.0).step()  # one end-of-step update
    assert not expected.all()
    loss = model(bad_input(torch.float32)).square().mean()
    assert not torch.isfinite(loss)


def test_native_grad_non_finite_where_high_precision_is():
    reference, model = pair("native")
    x = torch.randn(32, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(32, 16)
    grad[4, 0] = float("inf")
    model(x).backward(grad)
    reference(x_ref).backward(grad)
    assert not torch.isfinite(x.grad).all()
    assert torch.equal(torch.isfinite(x.grad), torch.isfinite(x_ref.grad))


def test_ao_output_non_finite_where_high_precision_is():
    pytest.importorskip("torchao")
    reference, model = pair("ao", dtype=torch.bfloat16)
    x = bad_input(torch.bfloat16)
    expected = torch.isfinite(reference(x))
    out = model(x)
    assert not expected.all()
    assert not torch.isfinite(out[~expected]).any()  # non-finite at least wherever bf16 is
    assert not torch.isfinite(out.float().square().mean())


def run(model, batches, skip_bad_before_backward):
    """A training loop that skips a batch whose loss is not finite, as users write it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    outputs = []
    for x in batches:
        out = model(x)
        loss = out.square().mean()
        if not torch.isfinite(loss):
            if not skip_bad_before_backward:
                loss.backward()
            optimizer.zero_grad()
            continue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs


@pytest.mark.parametrize("skip_bad_before_backward", [True, False])
@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_skipped_bad_batch_leaves_no_trace_in_scaling(skip_bad_before_backward, algo):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
        convert_model(model, recipe=FP8RecipeKwargs(backend="native", amax_compute_algo=algo))
        return model.train()

    generator = torch.Generator().manual_seed(1)
    good = [torch.randn(32, 32, generator=generator) for _ in range(4)]
    # finite at the first layer (which records a huge amax) and overflowing to inf after it
    bad = torch.randn(32, 32, generator=generator)
    bad[0, 0] = 3e38
    clean, skipped = build(), build()
    expected = run(clean, good, skip_bad_before_backward)
    outputs = run(skipped, good[:2] + [bad] + good[2:], skip_bad_before_backward)
    assert len(outputs) == len(expected) == 4
    for step, (out, ref) in enumerate(zip(outputs, expected)):
        assert torch.equal(out, ref), f"good step {step}: max difference {(out - ref).abs().max()}"
    for a, b in zip(skipped, clean):
        for name in ("fp8_scale", "fp8_amax_history", "fp8_step"):
            if hasattr(a, name):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
