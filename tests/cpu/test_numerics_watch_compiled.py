"""The numerics watch in a model compiled after prepare: watch steps must not cost
the ordinary steps their compiled graph. A model of nested blocks is compiled with a counting
backend over aot_eager; the watch runs every other step. A watch step runs eagerly (torch's
eager_on_recompile stance: no compile for it at all) or, where that stance cannot be set, compiles one
more graph, without graph breaks, once per run; either way every ordinary step must run the very
graph the first one ran, and each check must report what the eager watch reports for the same
run (up to the drift of bf16 rounding between compiled and eager)."""

import math

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.numerics import watch as watch_module
from fp8plug.numerics.watch import watch_of
from tests.support.hf import fresh
from tests.support.threads import one_thread  # noqa: F401 - autouse: one torch thread


class Block(nn.Module):
    """A residual MLP block: the watched Linears sit two calls deep, as in a decoder layer, where a
    graph break restarts dynamo's analysis above the hook."""

    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CountingBackend:
    """A torch.compile backend (`inner`: aot_eager, inductor) counting the graphs dynamo hands it
    and every call of each."""

    def __init__(self, inner="aot_eager"):
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs, self.calls = 0, []

    def __call__(self, gm, example_inputs):
        index = self.graphs
        self.graphs += 1
        self.calls.append(0)
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.calls[index] += 1
            return compiled(*args)
        return run


def train(compiled: bool, steps=7, interval=2, engine="native", device="cpu", inner="aot_eager"):
    """`steps` AdamW steps of Stack under fp8plug with the watch every `interval` steps; per step,
    the checks' dicts and (compiled) the graphs that ran and the graph breaks seen."""
    fresh()
    torch._dynamo.reset()
    accelerator = fp8plug.Accelerator(cpu=device == "cpu", mixed_precision="fp8", kwargs_handlers=[
        FP8RecipeKwargs(backend=engine, numerics_watch_interval=interval)])
    torch.manual_seed(0)
    model = Stack()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    backend = CountingBackend(inner)
    run = torch.compile(model, backend=backend) if compiled else model
    gen = torch.Generator().manual_seed(1)
    breaks = torch._dynamo.utils.counters["graph_break"]
    checks, ran, broke = [], [], []
    for _ in range(steps):
        before, breaks_before = list(backend.calls), sum(breaks.values())
        x = torch.randn(32, 64, generator=gen).to(accelerator.device)
        accelerator.backward(run(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        checks.append(accelerator.fp8_numerics())
        ran.append({i for i, n in enumerate(backend.calls) if n > (before[i] if i < len(before) else 0)})
        broke.append(sum(breaks.values()) - breaks_before)
    layers = [fqn for fqn, _ in watch_of(model).layers()]
    watch_of(model).close()  # the 7th step armed the 8th: its eager window closed (the stance put back)
    return checks, ran, broke, backend.graphs, layers


def check_graphs(checks, ran, broke, graphs, eager_watch=True):
    """The watch steps are the 2nd, 4th, 6th; no graph break; the ordinary steps run the first
    step's graphs throughout. `eager_watch`: the watch steps run the model eagerly (the
    eager_on_recompile stance: of the ordinary graphs only those whose guards still hold run,
    accelerate's wrapper's) and nothing more is compiled; else they run one armed graph, compiled
    once."""
    watched = [bool(c) for c in checks]
    assert watched == [False, True, False, True, False, True, False]
    assert broke == [0] * 7
    ordinary, armed = ran[0], ran[1]
    if eager_watch:
        assert armed < ordinary and graphs == len(ordinary)
    else:
        # one graph more for the whole run than the first step compiled (the armed step's model
        # graph; accelerate's wrapper around the model compiles a graph of its own)
        assert graphs == len(ordinary) + 1
        assert len(armed - ordinary) == 1 and len(ordinary - armed) == 1
    # every ordinary step runs the graphs the first one ran, every watch step the same armed ones
    assert ran == [armed if w else ordinary for w in watched]


def without_eager_stance(monkeypatch):
    """The watch as it runs where torch.compiler.set_stance cannot be set: the armed graph compiled."""
    monkeypatch.setattr(watch_module, "eager_stance", lambda: None)


@pytest.mark.slow  # four compiled graphs: about 10-15 s each
@pytest.mark.parametrize("eager_watch", [True, False])
def test_compiled_watch_keeps_the_ordinary_steps_graph(monkeypatch, eager_watch):
    if not eager_watch:
        without_eager_stance(monkeypatch)
    checks, ran, broke, graphs, layers = train(compiled=True)
    check_graphs(checks, ran, broke, graphs, eager_watch)
    # every layer reported, finite SQNRs, and the same numbers as the eager watch's
    eager_checks, _, _, _, eager_layers = train(compiled=False)
    assert layers == eager_layers and len(layers) == 7
    for got, expected in zip(checks, eager_checks):
        assert set(got) == set(expected)
        for fqn in layers if got else ():
            for key in ("sqnr_db", "dgrad_sqnr_db"):
                value = got[f"fp8/{fqn}/{key}"]
                assert math.isfinite(value) and 15.0 < value < 40.0, (fqn, key, value)
        # the runs part by bf16 rounding (autocast; compiled and eager round alike only up to
        # the order of operations), so the weights drift apart a little step by step: the same
        # tensors measured, up to that drift (layers' gradient amaxes differ by 2x and more)
        for key, value in got.items():
            if key.endswith("sqnr_db"):
                assert abs(value - expected[key]) < 1.0, key
            elif key.endswith("amax"):
                assert value == pytest.approx(expected[key], rel=0.1), key
            else:
                assert abs(value - expected[key]) < 2e-3, key


def test_the_watch_step_stance_is_the_watch_steps_only():
    """Armed after a step that ran the model compiled, the watch sets torch's eager_on_recompile
    stance (after an eager step it does not); disarmed or closed, it puts back the stance it found."""
    fresh()
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[
        FP8RecipeKwargs(backend="native", numerics_watch_interval=2)])
    model, optimizer = accelerator.prepare(Stack(), torch.optim.AdamW(Stack().parameters()))
    watch = watch_of(model)
    assert torch._dynamo.eval_frame._stance.stance == "default" and not watch.armed
    model(torch.randn(4, 64))  # an eager model: its watch steps need no window
    watch.end_step()
    assert watch.armed and torch._dynamo.eval_frame._stance.stance == "default"
    watch.end_step()
    watch.end_step()  # a step that ran no hook eagerly (a compiled graph's) armed the next: the window
    assert watch.armed and torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"
    watch.end_step()
    assert not watch.armed and torch._dynamo.eval_frame._stance.stance == "default"
    watch.end_step()
    assert torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"
    watch.close()
    assert torch._dynamo.eval_frame._stance.stance == "default"
