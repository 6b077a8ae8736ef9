"""Under torch.compile the granular, grouped and frozen FP8 layers reach the graph as fp8plug
operators, not as their autograd.Functions (backends/native/compiled_ops.py says why: torch 2.11's
dynamo gave those Functions zero gradients and kept their GEMM outputs through activation
checkpointing, on an H200). The CPU's torch (2.13) traces the Functions correctly, so what a
regression back to them would break shows only on the GPU machine's torch; this pins the path
itself: the operator is in the graph dynamo hands the backend, no autograd.Function of ours is,
and a frozen layer's compiled input gradient is eager's to the bit.
"""

import torch

from fp8plug.backends.native import granular, grouped
from fp8plug.backends.native.frozen_base import FrozenFP8Linear
from tests.support.threads import one_thread  # noqa: F401


def _graph_targets(fn, *inputs):
    """The call targets of the FX graph(s) dynamo builds for `fn(*inputs)` (run once, forward and backward)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    out.float().sum().backward()
    return targets


def _ours(targets, name):
    return [t for t in targets if f"fp8plug.{name}" in t]


def test_a_compiled_granular_layer_is_an_operator():
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, 128, requires_grad=True)
    targets = _graph_targets(lambda x, w: granular.granular_linear(x, w, "rowwise", torch.bfloat16), x, w)
    assert _ours(targets, "granular_linear"), targets
    assert not any("autograd_function_apply" in t for t in targets), targets
    assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0


def test_compiled_grouped_experts_are_an_operator():
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 96, 128, requires_grad=True)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    targets = _graph_targets(lambda x, w: grouped.grouped_fp8_linear(x, w, offs), x, w)
    assert _ours(targets, "grouped_fp8_linear"), targets
    assert not any("autograd_function_apply" in t for t in targets), targets
    assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0


def test_a_compiled_frozen_fp8_layer_is_an_operator_with_eager_gradients():
    torch.manual_seed(0)
    weight = (torch.randn(96, 128) * 0.05).to(torch.float8_e4m3fn)
    layer = FrozenFP8Linear.from_fp8(weight, torch.tensor(0.02), compute_dtype=torch.bfloat16).train()
    x = torch.randn(2, 32, 128, dtype=torch.bfloat16)
    grads = []
    for compiled in (False, True):
        xi = x.clone().requires_grad_()
        if compiled:
            targets = _graph_targets(layer, xi)
            assert _ours(targets, "frozen_fp8_linear"), targets
            assert not any("autograd_function_apply" in t for t in targets), targets
        else:
            layer(xi).float().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
