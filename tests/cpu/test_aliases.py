"""One module registered under two names (`m.a = m.b = linear`, a block shared between two places)
is converted once: every name points at the one FP8 module, the report counts it once, and
fp8_coverage counts the GEMMs run under either name. Unconverting puts one plain Linear back under
both names."""

import pytest
import torch
from torch import nn

from fp8plug import FP8RecipeKwargs, convert_model, fp8_coverage
from fp8plug.api import unconvert_model


class Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = self.a  # the same Linear under a second name
        self.block = nn.Sequential(nn.Linear(32, 32))
        self.shared_block = self.block  # a shared block: its Linear has two names too

    def forward(self, x):
        return self.shared_block(self.b(self.a(x)) + self.block(x))


@pytest.mark.parametrize("backend", ["native", "ao"])
def test_aliased_linear_converted_once_under_every_name(backend):
    if backend == "ao":
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = Aliased()
    weight = model.a.weight
    report = convert_model(model, recipe=FP8RecipeKwargs(backend=backend))
    assert type(model.a) is not nn.Linear
    assert model.b is model.a and model.shared_block[0] is model.block[0]
    assert model.a.weight is weight  # the same Parameter: optimizers stay valid
    assert sorted(report.converted) == ["a", "block.0"]
    assert report.summary().startswith("model: 2 of 2 Linear layers run in FP8")

    model.train()
    model(torch.randn(16, 32)).sum().backward()
    coverage = fp8_coverage(model)
    # a runs twice (as a and as b), block.0 twice (as block.0 and shared_block.0): 4 GEMM calls
    assert coverage["fp8_gemms"] == 4 and coverage["high_precision_gemms"] == 0, coverage

    unconvert_model(model)
    assert type(model.a) is nn.Linear and model.b is model.a and model.a.weight is weight
    assert type(model.block[0]) is nn.Linear and model.shared_block[0] is model.block[0]


def test_modules_to_ignore_by_an_alias_name():
    model = Aliased()
    report = convert_model(model, recipe=FP8RecipeKwargs(backend="native", modules_to_ignore=["b"]))
    assert type(model.a) is nn.Linear and model.b is model.a
    assert report.converted == ["block.0"]
