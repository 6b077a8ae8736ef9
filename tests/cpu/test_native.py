"""The native engine: numerics against float64, TransformerEngine's delayed-scaling state,
fallbacks, eval policy, compile and checkpoints."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8plug
from fp8plug import sync_fp8_scaling
from fp8plug.backends.native.engine import NativeFP8Linear, native_fp8_autocast
from fp8plug.backends.native.scaling import E4M3, E5M2, FP8_MAX
from tests.support.numerics import sqnr_db

OPTIONS = dict(scaling="delayed", fp8_format="HYBRID", margin=0, interval=1, amax_history_len=16,
               amax_compute_algo="most_recent", override_linear_precision=(False, False, False))


def make(in_f=128, out_f=64, bias=True, **overrides):
    torch.manual_seed(0)
    return NativeFP8Linear.from_linear(nn.Linear(in_f, out_f, bias=bias), **{**OPTIONS, **overrides})


def reference_grads(layer, x, grad):
    xd = x.detach().double().requires_grad_()
    wd = layer.weight.detach().double().requires_grad_()
    bd = layer.bias.detach().double().requires_grad_() if layer.bias is not None else None
    out = F.linear(xd, wd, bd)
    out.backward(grad.double())
    return out, xd.grad, wd.grad, (bd.grad if bd is not None else None)


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
@pytest.mark.parametrize("k", [64, 256])
def test_numerics_against_float64(scaling, fmt, k):
    layer = make(in_f=k, out_f=96, scaling=scaling, fp8_format=fmt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # several steps, so delayed scaling runs on its history, not on step 0
        x = torch.randn(64, k, generator=gen, requires_grad=True)
        grad = torch.randn(64, 96, generator=gen)
        layer.weight.grad = layer.bias.grad = None
        out = layer(x)
        out.backward(grad)
    ref_out, ref_dx, ref_dw, ref_db = reference_grads(layer, x, grad)
    assert sqnr_db(out, ref_out) >= 20
    assert sqnr_db(x.grad, ref_dx) >= 18
    assert sqnr_db(layer.weight.grad, ref_dw) >= 18
    assert sqnr_db(layer.bias.grad, ref_db) >= 40  # the bias gradient is exact up to float32


def test_three_dimensional_input_and_bf16():
    layer = make(in_f=64, out_f=32).to(torch.bfloat16)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    assert out.shape == (4, 8, 32) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert sqnr_db(out, ref) >= 20


def test_scaling_state_stays_float32_when_the_module_is_cast():
    layer = make(in_f=64, out_f=32)
    for _ in range(3):
        layer(torch.randn(16, 64))
    history = layer.fp8_amax_history.clone()
    layer = layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_scale.dtype == torch.float32 and torch.equal(layer.fp8_amax_history, history)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # float32 scales reach _scaled_mm
    assert layer.fp8_scale.dtype == torch.float32


def test_output_follows_autocast_dtype():
    layer = make(in_f=64, out_f=32)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16


def scale_reference(amax, fmt_max, margin):
    return fmt_max / amax / 2**margin


@pytest.mark.parametrize("algo", ["most_recent", "max"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scaling_follows_transformer_engine(algo, margin):
    """scale = fp8_max / amax / 2**margin, amax from the history (newest or max), history rolls
    once per step: the scale set at the end of a step is the one the next step casts with."""
    history_len = 3
    layer = make(in_f=16, out_f=16, bias=False, amax_history_len=history_len, amax_compute_algo=algo, margin=margin)
    layer.weight.data.fill_(0.5)
    amaxes = [1.0, 4.0, 2.0, 0.5, 3.0]
    seen = []
    for amax in amaxes:
        x = torch.zeros(16, 16)
        x[0, 0] = amax
        layer(x)
        assert layer.fp8_amax_history[0, 0].item() == (seen[-1] if seen else 0.0)  # not yet pushed
        sync_fp8_scaling(layer)
        seen.append(amax)
        history = layer.fp8_amax_history[:, 0].tolist()
        expected_history = (list(reversed(seen)) + [0.0] * history_len)[:history_len]
        assert history == pytest.approx(expected_history)
        window = list(reversed(seen))[:history_len]
        reduced = window[0] if algo == "most_recent" else max(window)
        expected = scale_reference(reduced, FP8_MAX[E4M3], margin)
        assert layer.fp8_scale[0].item() == pytest.approx(expected, rel=1e-6)
        assert layer.fp8_scale[1].item() == pytest.approx(scale_reference(0.5, FP8_MAX[E4M3], margin), rel=1e-6)


def test_delayed_scaling_interval():
    layer = make(in_f=16, out_f=16, bias=False, interval=2, amax_history_len=4)
    scales = []  # the scale each step casts its input with
    for amax in [1.0, 2.0, 4.0, 8.0, 16.0]:
        x = torch.zeros(16, 16)
        x[0, 0] = amax
        scales.append(layer.fp8_scale[0].item() if layer.fp8_step[0] > 0 else "current")
        layer(x)
        sync_fp8_scaling(layer)
    m = FP8_MAX[E4M3]
    # step 0: its current amax; the first update seeds the scale (step 1 uses 1.0's); step 2
    # uses one recomputed from step 1's amax; step 3 keeps it; step 4 recomputes from step 3's
    assert scales[0] == "current" and scales[1:] == pytest.approx([m / 1, m / 2, m / 2, m / 8])


def test_grad_output_scaling_state_and_format():
    layer = make(in_f=32, out_f=32, amax_history_len=4)
    for value in [2.0, 8.0]:
        x = torch.randn(16, 32, requires_grad=True)
        layer(x).backward(torch.full((16, 32), value))
        sync_fp8_scaling(layer)
    assert layer.fp8_amax_history[:2, 2].tolist() == [8.0, 2.0]
    assert layer.fp8_scale[2].item() == pytest.approx(FP8_MAX[E5M2] / 8.0)
    assert layer.bwd_dtype == E5M2
    assert make(fp8_format="E4M3").bwd_dtype == E4M3


def test_saturates_instead_of_overflowing():
    layer = make(in_f=32, out_f=32, amax_history_len=2)
    for _ in range(2):
        layer(torch.randn(16, 32) * 0.01)
        sync_fp8_scaling(layer)
    out = layer(torch.randn(16, 32) * 1000)  # far beyond the delayed scale's range
    assert torch.isfinite(out).all()


def test_override_linear_precision_runs_those_gemms_in_high_precision():
    layer = make(in_f=64, out_f=32, override_linear_precision=(True, True, True))
    plain = nn.Linear(64, 32)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(16, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = layer(x)
    ref = plain(x2)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def test_override_wgrad_only_keeps_fp8_elsewhere():
    layer = make(in_f=64, out_f=32, override_linear_precision=(False, False, True))
    plain = nn.Linear(64, 32)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(16, 64)
    out = layer(x)
    out.sum().backward()
    ref = plain(x)
    ref.sum().backward()
    assert not torch.equal(out, ref)  # fprop in FP8
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)  # wgrad in high precision


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 64), (1, 64), (15, 64), (33, 64)])
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_any_token_count_runs_in_fp8_through_padding(shape, scaling):
    """Rows are zero-padded to 16 inside the layer: FP8 runs (the output differs from bf16's
    exact product), and output and gradients on the real rows match float64 as well as aligned
    inputs do; the padding leaves the recorded amaxes alone."""
    layer = make(in_f=64, out_f=32, scaling=scaling)
    x = (torch.randn(*shape) * 3).requires_grad_()
    out = layer(x)
    assert out.shape == (*shape[:-1], 32)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_out, ref_dx, ref_dw, _ = reference_grads(layer, x, grad)
    assert not torch.equal(out, F.linear(x, layer.weight, layer.bias))  # FP8, not high precision
    assert sqnr_db(out, ref_out) >= 20
    assert sqnr_db(x.grad, ref_dx) >= 18
    assert sqnr_db(layer.weight.grad, ref_dw) >= 18
    if scaling == "delayed":
        assert layer.fp8_amax_recorded[0].item() == pytest.approx(x.detach().abs().max().item())
        assert layer.fp8_amax_recorded[2].item() == pytest.approx(grad.abs().max().item())


def test_eval_runs_in_high_precision_unless_asked():
    layer = make(in_f=64, out_f=32)
    x = torch.randn(16, 64)
    layer.eval()
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    with native_fp8_autocast(enabled=True):
        assert not torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.train()
    with native_fp8_autocast(enabled=False):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_compiles_without_graph_breaks():
    layer = make(in_f=64, out_f=64)
    eager = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(3):
        x = torch.randn(32, 64)
        out_c = compiled(x)
        out_c.sum().backward()
        out_e = eager(x)
        out_e.sum().backward()
        sync_fp8_scaling(layer, eager)
    torch.testing.assert_close(out_c, out_e, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.fp8_amax_history, eager.fp8_amax_history)
    torch.testing.assert_close(layer.fp8_scale, eager.fp8_scale)
    assert layer.fp8_step.tolist() == [3, 3, 3]


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_dynamo_records_each_cast_as_one_operator(scaling):
    """Compiled, a cast is one node of dynamo's graph (`fp8plug::per_tensor_cast`), not its torch
    ops, which dynamo took seconds to interpret on a transformers Llama (backends.native.cast); the
    graph AOT autograd hands inductor holds the ops again, for the compiler to fuse them."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def ops_of(gm, into):
        into.extend(str(node.target) for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                    for node in module.graph.nodes if node.op in ("call_function", "call_method"))
        return make_boxed_func(gm.forward)

    dynamo_ops, inductor_ops = [], []
    aot = aot_autograd(fw_compiler=lambda gm, _: ops_of(gm, inductor_ops),
                       bw_compiler=lambda gm, _: ops_of(gm, inductor_ops),
                       partition_fn=min_cut_rematerialization_partition)
    # delayed scaling's in-place amax records go to inductor's own partitioning only: dynamo's graph alone there
    backend = (lambda gm, inputs: (ops_of(gm, dynamo_ops), aot(gm, inputs))[1]) if scaling == "dynamic" else (
        lambda gm, inputs: ops_of(gm, dynamo_ops) and gm.forward)
    torch._dynamo.reset()
    layer = make(in_f=64, out_f=64, scaling=scaling)
    torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(32, 64, requires_grad=True)).sum().backward()
    casts = [op for op in dynamo_ops if "per_tensor_cast" in op]
    assert len(casts) == 3, dynamo_ops  # the input's and the weight's, and backward's of grad_output
    assert not any("amax" in op or "clamp" in op for op in dynamo_ops), dynamo_ops
    if scaling == "dynamic":
        assert any("amax" in op for op in inductor_ops) and not any("per_tensor_cast" in op for op in inductor_ops)


def test_compiled_layers_sharing_an_input_keep_one_fp8_copy_of_it():
    """q, k and v (gate and up) read one tensor. Compiled with dynamic scaling (the compiled
    default), their casts of it are one cast, and backward keeps one transposed FP8 copy of it,
    not one per layer: 1.9 GB of the Llama of benchmarks/training/hf_llama.py (the copies were not
    merged while the cast spelled NaN as a constant, since NaN != NaN). Read from the graph
    torch.compile's partitioner hands backward, the one inductor compiles. (Delayed scaling casts
    with each layer's own scale: one copy per layer there.)"""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    class SharedInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(64, 128, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) + self.k(x) + self.v(x)

    saved = []

    def backward_inputs(gm, _inputs):
        saved.extend(node.meta["val"] for node in gm.graph.nodes
                     if node.op == "placeholder" and not node.name.startswith("tangents"))
        return gm.forward

    backend = aot_autograd(fw_compiler=lambda gm, _inputs: gm.forward, bw_compiler=backward_inputs,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    model = SharedInput()
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic", auto_filter=False))
    x = torch.randn(32, 64, requires_grad=True)
    torch.compile(model, backend=backend, fullgraph=True)(x).float().sum().backward()
    fp8_inputs = [t for t in saved if isinstance(t, torch.Tensor) and t.dtype == E4M3 and t.numel() == x.numel()]
    fp8_weights = [t for t in saved if isinstance(t, torch.Tensor) and t.dtype == E4M3 and t.numel() == 64 * 128]
    assert len(fp8_inputs) == 1 and len(fp8_weights) == 3


def test_compiled_delayed_model_compiles_once():
    """The skipped-step guard (a forward pre-hook of a model with delayed layers) must not make a
    compiled model compile twice: it used to look its layers up at the first forward, so the
    second saw an attribute no longer None and dynamo compiled the hook again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="delayed", auto_filter=False))
    compiled = torch.compile(model, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            compiled(torch.randn(16, 64)).float().sum().backward()
            sync_fp8_scaling(model)


def test_conversion_keeps_parameters_and_state_dict():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    params_before = [id(p) for p in model.parameters()]
    plain_state = copy.deepcopy(model.state_dict())
    report = fp8plug.convert_model(model, backend="native")
    assert report.converted == ["0", "2"]
    assert [id(p) for p in model.parameters()] == params_before
    assert model.state_dict().keys() == plain_state.keys()
    model(torch.randn(16, 64)).sum().backward()
    fresh = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    fresh.load_state_dict(model.state_dict(), strict=True)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    model.load_state_dict(plain_state, strict=True)  # a plain checkpoint loads into the converted model
    fp8plug.unconvert_model(model)
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, plain_state["0.weight"])


def test_cpu_tensors_never_take_the_triton_cast():
    """The one-pass cast is for CUDA tensors only; on the CPU the layer casts with torch ops, and
    building the op where there is no GPU is a no-op, not an import of Triton."""
    from fp8plug.backends.native import fused_cast as _fused_cast

    ready = _fused_cast.load()
    assert ready == (torch.cuda.is_available() and _fused_cast._can_build())
    assert not _fused_cast.usable(torch.zeros(16, 16))


def test_a_layer_added_to_a_converted_model_is_updated_once_per_step():
    """A directly built layer and the converted model holding it are trained by one optimizer:
    the end of the step updates each delayed layer once (one history entry per step)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    fp8plug.convert_model(model, backend="native")
    model.append(make(in_f=64, out_f=32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):
        model(torch.randn(16, 64)).sum().backward()
        optimizer.step()
    assert model[0].fp8_step.tolist() == [2, 2, 2] and model[2].fp8_step.tolist() == [2, 2, 2]


def test_compiled_norm_is_fused_into_the_fp8_cast():
    """The norm and the FP8 cast fused into the projections that follow, compiled: inductor
    computes the RMSNorm in the kernels that take the amax and cast q/k/v's shared input to FP8,
    so the forward allocates that input only in FP8, never in high precision. C++ kernels here;
    tests/gpu/test_native.py checks the Triton ones."""
    from tests.support.fusion import check_norm_fused_into_the_cast

    check_norm_fused_into_the_cast("cpu", tokens=512)
