"""The grouped GEMM's padded token layout (fp8plug/backends/native/token_layout.py) is made once per
offsets tensor: a layer's two expert projections, forward and backward, read one layout (and, with
few experts, one host copy of the groups' bounds), eagerly and compiled; a changed or different
offsets tensor gets its own."""

import pytest
import torch

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.backends.native import token_layout
from tests.support.moe_models import VOCAB, builder


@pytest.fixture
def layouts_made(monkeypatch):
    """The rows of every layout made (not returned again) from here on."""
    made = []
    original = token_layout.group_layout

    def counting(offs, num_rows):
        made.append(num_rows)
        return original(offs, num_rows)

    monkeypatch.setattr(token_layout, "group_layout", counting)
    return made


@pytest.mark.parametrize("compiled", [None, "aot_eager"])
def test_each_layer_makes_its_layout_once_a_step(layouts_made, compiled):
    model = builder("mixtral")(num_hidden_layers=2)
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    run = torch.compile(model, backend=compiled) if compiled else model
    for step in range(2):
        layouts_made.clear()
        ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(step))
        run(ids, labels=ids).loss.backward()
        # two layers, each: gate_up and down, forward and backward, on one layout
        assert layouts_made == [96, 96], (step, layouts_made)  # 48 tokens, top 2


def test_a_changed_or_other_offsets_tensor_gets_its_own_layout(layouts_made):
    offs = torch.tensor([5, 5, 22, 32], dtype=torch.int32)
    first, _ = token_layout.layout_of(offs, 32)
    assert token_layout.layout_of(offs, 32)[0] is first and len(layouts_made) == 1
    assert token_layout.layout_of(offs.clone(), 32)[0] is not first  # another tensor, equal values
    offs[1] = 10  # written in place: the version counter moves
    changed, _ = token_layout.layout_of(offs, 32)
    assert changed is not first and changed.offs.tolist() == [16, 32, 48, 64]
    assert token_layout.layout_of(offs, 40)[0] is not changed  # other rows
    assert len(layouts_made) == 4
    with torch.inference_mode():  # an inference tensor has no version counter: never kept
        frozen = torch.tensor([5, 5, 22, 32], dtype=torch.int32)
        assert token_layout.layout_of(frozen, 32)[0] is not token_layout.layout_of(frozen, 32)[0]


def test_a_dead_offsets_tensor_leaves_no_layout_behind():
    token_layout.layout_of(torch.tensor([3, 9], dtype=torch.int32), 9)
    token_layout.layout_of(torch.tensor([4, 9], dtype=torch.int32), 9)  # the first is gone by now
    assert all(made.offs() is not None for made in token_layout._MADE.values())
