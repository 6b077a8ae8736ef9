"""The default speed filter on a real sm_90 GPU: on without being asked, it keeps the small layers
of a model in bf16 and converts the large ones, through convert_model and fp8plug.Accelerator; and
what it keeps in bf16 really is faster there (measured here, with a wide margin)."""

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs


@pytest.fixture(autouse=True)
def default_filter(monkeypatch):
    monkeypatch.delenv("FP8PLUG_AUTO_FILTER")  # tests/gpu/conftest.py turns it off for the others
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the shipped calibration is for compute capability 9.0")


def model():
    return nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 256, bias=False),
                         nn.Linear(256, 4096, bias=False)).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("backend", ["native", "ao", "te"])
def test_convert_model_filters_only_when_asked(backend):
    """Accelerate's contract for convert_model: every eligible layer; the filter on request."""
    pytest.importorskip({"native": "torch", "ao": "torchao", "te": "transformer_engine.pytorch"}[backend])
    assert fp8plug.convert_model(model(), backend=backend).converted == ["0", "1", "2"]
    report = fp8plug.convert_model(model(), recipe=FP8RecipeKwargs(backend=backend, auto_filter=True))
    assert report.converted == ["0"], report
    assert all(reason.startswith("auto_filter:") for reason in report.skipped.values()), report


def test_default_filter_through_the_accelerator_and_off_when_asked():
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="native")])
    accelerator.prepare(model())
    assert accelerator.fp8_reports[0].converted == ["0"]
    accelerator = fp8plug.Accelerator(mixed_precision="fp8",
                                      kwargs_handlers=[FP8RecipeKwargs(backend="native", auto_filter=False)])
    accelerator.prepare(model())
    assert accelerator.fp8_reports[0].converted == ["0", "1", "2"]


def test_a_layer_the_filter_keeps_in_bf16_is_slower_in_fp8():
    """8192 tokens through a 256 -> 4096 Linear: the filter's verdict against a measurement."""
    from fp8plug.backends import get_backend

    def time_fwd_bwd(layer, x, grad):
        for _ in range(3):
            layer(x).backward(grad)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            layer(x).backward(grad)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    x = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    bf16 = nn.Sequential(nn.Linear(256, 4096, bias=False)).to("cuda", torch.bfloat16)
    fp8 = nn.Sequential(nn.Linear(256, 4096, bias=False)).to("cuda", torch.bfloat16)
    recipe = FP8RecipeKwargs(backend="native", auto_filter=False)
    get_backend("native").convert(fp8, recipe)
    with get_backend("native").autocast(recipe, enabled=True):
        fp8_ms = time_fwd_bwd(fp8, x, grad)
    assert fp8_ms > time_fwd_bwd(bf16, x, grad)
