"""The `ao` engine on the CPU with a frozen weight (PEFT LoRA's base_layer): no weight-gradient
work (GEMMs and casts counted), the same bytes as torchao's own function, only the weight kept for
backward, one compiled graph. The engine's other tests are test_ao.py's, whose helpers these use."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402

import fp8plug  # noqa: E402
from fp8plug.backends import get_backend  # noqa: E402
from tests.cpu.test_ao import converted, recipe, single  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402


class CountFloat8Gemms(TorchDispatchMode):
    """Counts the GEMMs with a float8 operand (torch.mm on torchao's Float8TrainingTensor)."""

    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default) \
                and any(isinstance(a, Float8TrainingTensor) for a in args):
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def count_casts(monkeypatch):
    """Patch hp_tensor_to_float8_dynamic where torchao's Function and fp8plug's frozen-weight one
    look it up; returns the list of the roles cast, one entry per cast."""
    import torchao.float8.float8_linear as torchao_linear

    from fp8plug.backends.ao import frozen as _ao_frozen

    casts, real = [], _ao_frozen.hp_tensor_to_float8_dynamic

    def counting(*args, **kwargs):
        casts.append(kwargs["gemm_input_role"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torchao_linear, "hp_tensor_to_float8_dynamic", counting)
    monkeypatch.setattr(_ao_frozen, "hp_tensor_to_float8_dynamic", counting)
    return casts


def test_frozen_base_layers_do_no_weight_gradient_work(monkeypatch):
    """One LoRA Llama step: each frozen base layer casts input and weight and runs one GEMM forward,
    and casts grad_output and weight and runs one GEMM for the input gradient, nothing for its
    weight; layer 0's q/k/v (inputs that need no gradient) have no backward at all. The same model
    with every weight trainable runs torchao's three GEMMs and six casts per layer."""
    pytest.importorskip("peft")
    from tests.cpu.test_lora import lora_llama, step, tokens
    from tests.support.hf import tiny_llama

    ao = recipe(auto_filter=False, fp8_output_head=True)
    casts = count_casts(monkeypatch)
    results = []
    for model in (lora_llama(), tiny_llama()):
        report = fp8plug.convert_model(model, recipe=ao)
        assert len(report.converted) == 15  # 14 projections and the tied lm_head
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        casts.clear()
        with get_backend("ao").autocast(ao), CountFloat8Gemms() as mode:
            step(model, opt, tokens(0))
        results.append((mode.gemms, len(casts)))
        layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert all(m.weight.grad is None for m in layers if not m.weight.requires_grad)
    frozen, backward = 15, 15 - 3  # layer 0's q/k/v: no backward
    assert results[0] == (frozen + backward, 2 * frozen + 2 * backward)
    assert results[1] == (3 * frozen, 6 * frozen)  # trainable: the weight gradient's GEMM and casts


def autograd_nodes(out):
    """The names of `out`'s autograd nodes down to the leaves, the accumulators left out."""
    names, nodes = [], [out.grad_fn]
    while nodes:
        node = nodes.pop(0)
        if node is not None and type(node).__name__ != "AccumulateGrad":
            names.append(type(node).__name__)
            nodes += [n for n, _ in node.next_functions]
    return names


@pytest.mark.parametrize("scaling,options", [
    ("tensorwise", {}), ("rowwise", {}), ("rowwise_with_gw_hp", {}),
    ("tensorwise", {"override_linear_precision": (False, True, False)}),  # grad_input unscaled
    ("tensorwise", {"enable_fsdp_float8_all_gather": True}),  # the weight wrapped, not sharded
])
def test_frozen_weight_matches_torchaos_function_bit_for_bit(scaling, options):
    """Output and input gradient equal torchao's own Function's on the same module (its weight
    trainable for that run), and against float64 they show FP8's error; the frozen weight gets no
    gradient."""
    layer = single(scaling=scaling, **options)
    x, grad = torch.randn(4, 16, 64), torch.randn(4, 16, 96)
    layer.weight.requires_grad_(False)
    x1 = x.clone().requires_grad_()
    out = layer(x1)
    assert autograd_nodes(out) == ["AddBackward0", "FrozenWeightFloat8MatmulBackward"]
    out.backward(grad)
    assert layer.weight.grad is None
    layer.weight.requires_grad_(True)
    x2 = x.clone().requires_grad_()
    ref = layer(x2)
    ref.backward(grad)
    assert layer.weight.grad is not None  # torchao's Function did run this time
    assert torch.equal(out, ref) and torch.equal(x1.grad, x2.grad)
    wd = layer.weight.detach().double()
    xd = x.double().requires_grad_()
    F.linear(xd, wd, layer.bias.detach().double()).backward(grad.double())
    fp8_dgrad = "override_linear_precision" not in options
    assert 18 <= sqnr_db(x1.grad, xd.grad) <= (45 if fp8_dgrad else 200)  # FP8 ran (where asked), and ran right
    assert sqnr_db(x1.grad, xd.grad) >= (18 if fp8_dgrad else 100)


def test_frozen_weight_keeps_only_the_weight_for_backward():
    """What backward holds: the weight (a view of the Parameter), not the input torchao keeps."""
    layer = single()
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = torch.randn(32, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert len(saved) == 1 and saved[0].shape == (64, 96)  # the weight (transposed view); not the input
    assert saved[0].data_ptr() == layer.weight.data_ptr()


def test_frozen_weight_compiles_in_one_graph():
    """fullgraph=True: fp8plug's Function stays in the graph (allow_in_graph, as torchao's)."""
    model, eager = converted(), converted()
    for m in (model, eager):
        m[0].weight.requires_grad_(False)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 64, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    xe = x.detach().clone().requires_grad_()
    eager_out = eager(xe)
    eager_out.sum().backward()
    assert torch.equal(out, eager_out) and torch.equal(x.grad, xe.grad)
    assert model[0].weight.grad is None and torch.equal(model[2].weight.grad, eager[2].weight.grad)
    model[0].weight.requires_grad_(True)  # a guard: recompiles onto torchao's Function
    compiled(x).sum().backward()
    assert model[0].weight.grad is not None
