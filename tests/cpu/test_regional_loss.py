"""Under Accelerate's regional compilation fp8plug.Accelerator compiles a transformers model's own
loss too (fp8plug.hf.regional_loss): the loss and its gradients are the uncompiled loss's, a loss
the user set is left alone, whole-model compilation and unwrap_model(keep_torch_compile=False)
get no compiled loss. What it saves on a GPU is benchmarks/training/hf_llama.py's regional rows."""

import pytest
import torch

pytest.importorskip("transformers")

from accelerate.utils import TorchDynamoPlugin  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

import fp8plug  # noqa: E402
from tests.support.hf import VOCAB, fresh, tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state():
    fresh()
    torch._dynamo.reset()
    yield
    fresh()
    torch._dynamo.reset()


def prepared(regional=True, model=None):
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=regional)
    acc = fp8plug.Accelerator(mixed_precision="fp8", cpu=True, dynamo_plugin=plugin)
    return acc, acc.prepare(model if model is not None else tiny_llama())


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_regional_compilation_compiles_the_models_own_loss_and_computes_what_it_did():
    acc, model = prepared()
    compiled = model.loss_function
    assert getattr(compiled, "_torchdynamo_orig_callable", None) is ForCausalLMLoss
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, grads = loss_and_grads(model, ids)
    del model._loss_function  # transformers' own again, uncompiled
    assert model.loss_function is ForCausalLMLoss
    plain_loss, plain_grads = loss_and_grads(model, ids)
    assert torch.isfinite(loss) and abs(loss.item() - plain_loss.item()) <= 1e-6 * abs(plain_loss.item())
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in grads.items():
        err = (grad - plain_grads[name]).norm() / plain_grads[name].norm().clamp_min(1e-30)
        assert err <= 1e-5, name
    inner = acc.unwrap_model(model, keep_torch_compile=False)
    assert "_loss_function" not in vars(inner)


def test_a_loss_the_user_set_is_left_alone_and_whole_model_compilation_adds_none():
    def my_loss(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

    model = tiny_llama()
    model.loss_function = my_loss
    _, prepared_model = prepared(model=model)
    assert prepared_model.loss_function is my_loss
    fresh()
    _, whole = prepared(regional=False)
    assert "_loss_function" not in vars(whole._orig_mod)
