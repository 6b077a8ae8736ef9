"""Real transformers models through fp8plug: the wrapped forward keeps its signature, and
save_state/load_state work with tied and otherwise shared weights (safetensors, the default).

Trainer picks dataset columns from `inspect.signature(model.forward)`, and accelerate removes
shared tensors before a safetensors save only from an OrderedDict state dict; both broke on
converted models before.
"""

import copy
import inspect
from collections import OrderedDict

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

import fp8plug
from fp8plug import FP8RecipeKwargs, apply_fp8_autowrap, remove_fp8_autowrap
from tests.support.hf import VOCAB, fresh, tiny_llama
from tests.support.training import hf_loss
from tests.support.training import train as shared_train


def accelerator(backend):
    return fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend=backend)])


# --- forward signature ------------------------------------------------------------------------------


def test_wrapped_forward_keeps_signature_name_doc_and_wrapped():
    model = tiny_llama()
    original = model.forward
    signature = inspect.signature(original)
    assert list(signature.parameters)[:2] == ["input_ids", "attention_mask"]

    apply_fp8_autowrap(model, FP8RecipeKwargs(backend="native"))
    assert inspect.signature(model.forward) == signature
    assert model.forward.__wrapped__ == original
    assert model.forward.__name__ == "forward" and model.forward.__doc__ == LlamaForCausalLM.forward.__doc__
    apply_fp8_autowrap(model, FP8RecipeKwargs(backend="native"))  # twice: still one wrapper
    assert inspect.signature(model.forward) == signature and model.forward.__wrapped__ == original
    assert inspect.signature(copy.deepcopy(model).forward) == signature
    remove_fp8_autowrap(model)
    assert "forward" not in model.__dict__ and inspect.signature(model.forward) == signature


def test_signature_after_prepare_under_accelerates_autocast_wrapper():
    model = tiny_llama()
    signature = inspect.signature(model.forward)
    acc = accelerator("native")
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert inspect.signature(model.forward) == signature
    tokens = torch.randint(0, VOCAB, (2, 16))
    assert model(tokens, labels=tokens).loss.isfinite()  # input_ids still the first positional argument


class OddSignature(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, /, scale=1.0, *rest, self_=None, **extra):
        return self.proj(x) * scale


def test_any_parameter_kinds_survive():
    model = OddSignature()
    signature = inspect.signature(model.forward)
    apply_fp8_autowrap(model, FP8RecipeKwargs(backend="native"))
    assert inspect.signature(model.forward) == signature
    assert ([p.kind for p in inspect.signature(model.forward).parameters.values()][0]
            == inspect.Parameter.POSITIONAL_ONLY)


# --- save_state / load_state with tied and shared weights ---------------------------------------------


def train(acc, model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(steps)]
    return shared_train(model, optimizer, batches, loss=hf_loss, accelerator=acc)


@pytest.mark.parametrize("backend", ["native", "ao"])
def test_save_state_load_state_tied_llama_bit_exact(tmp_path, backend):
    acc = accelerator(backend)
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    train(acc, model, optimizer, 2, seed=1)

    state = acc.get_state_dict(model)
    assert isinstance(state, OrderedDict)  # what accelerate de-duplicates before safetensors
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    acc.save_state(tmp_path / "ckpt")  # safetensors by default
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    reference = train(acc, model, optimizer, 2, seed=2)
    reference_weights = {k: v.clone() for k, v in acc.get_state_dict(model).items()}

    fresh()
    acc2 = accelerator(backend)
    model2 = tiny_llama(seed=5)  # other weights: the load must replace them all
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2, optimizer2 = acc2.prepare(model2, optimizer2)
    acc2.load_state(tmp_path / "ckpt")
    assert model2.lm_head.weight is model2.model.embed_tokens.weight  # still tied after the load
    assert train(acc2, model2, optimizer2, 2, seed=2) == reference  # bit-identical
    for key, value in acc2.get_state_dict(model2).items():
        assert torch.equal(value, reference_weights[key]), key


def test_save_model_of_tied_llama_loads_with_from_pretrained(tmp_path):
    acc = accelerator("native")
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    train(acc, model, optimizer, 1, seed=1)
    acc.save_model(model, tmp_path)  # accelerate's own writer, tie de-duplicated
    acc.unwrap_model(model).config.save_pretrained(tmp_path)
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


class SharedWeights(nn.Module):
    """Sharing that is not a transformers tie: one weight in two Linears, one Linear at two names."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.b.weight = self.a.weight
        self.again = self.a
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        return self.out(self.again(torch.relu(self.b(torch.relu(self.a(x))))))


def test_save_state_load_state_with_shared_weights(tmp_path):
    def run(seed, load=False, save=False):
        fresh()
        acc = accelerator("native")
        torch.manual_seed(seed)
        model = SharedWeights()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
        if load:
            acc.load_state(tmp_path / "ckpt")
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
        losses = []
        for _ in range(2):
            loss = model(x).float().pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if save:
            acc.save_state(tmp_path / "ckpt")
        return losses, model

    run(seed=0, save=True)
    after_save, model = run(seed=0, load=True)
    resumed, model2 = run(seed=9, load=True)
    assert resumed == after_save
    assert model2.b.weight is model2.a.weight
    for key, value in model.state_dict().items():
        assert torch.equal(value, model2.state_dict()[key]), key
