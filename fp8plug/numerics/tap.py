"""The numerics watch inside a compiled graph: two opaque custom ops in place of a graph break.

Why: the watch's forward hook used to run its statistics in a `torch.compiler.disable`d method.
In a model compiled after `prepare`, that broke the armed step's graph at every converted Linear
(84 breaks in a 12-layer Llama); dynamo then compiled the resumed frames once per decoder layer
(each specializes on its layer), ran past its recompile limit (8), and from then on ran those
frames eagerly on every step, armed or not: after the first watch step every ordinary step lost
the compiled graph (2.2x slower on an H100), and the watch step itself recompiled for seconds.

Here the armed hook calls `numerics_tap(output, input, token, fqn)` instead, a custom op dynamo
and AOTAutograd keep as one opaque call in the graph: no break, so the armed step is one more
graph, compiled once (`armed` is a guard of the graph), and the ordinary steps keep theirs.
Since compiling that graph costs a whole model's compile, a compiled model's watch step normally
runs eagerly instead (fp8plug.numerics.watch, `_EagerWatchStep`); these ops are what runs where
it cannot: a check every step, or a torch without `torch.compiler.set_stance`.
At run time the op's body is plain eager Python: it hands the layer's input to its watch, which
measures it (and the weight, with the scales the layer casts with now) exactly as the eager path
does, and returns a copy of the output. Its backward is a second opaque op, `numerics_grad_tap`,
which hands the gradient arriving at the output to the watch and passes on a copy: the one way to
read an intermediate's gradient from a compiled backward without compiled autograd (dynamo
refuses `Tensor.register_hook` on an intermediate there). The copies are the price, on watch
steps only: an op must not return its input, and an output nobody uses would be dead code.

The ops find their watch through `token` (an int, as op arguments must be), kept here with a weak
reference, and the layer by its name. Eager models keep the plain hook path (no copies); so do
inputs or outputs that are not plain tensors (a DTensor, a tuple), which these ops have no rules
for: they still break the graph there, as before.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from typing import Dict

import torch

_WATCHES: Dict[int, "weakref.ref"] = {}
_TOKENS = itertools.count(1)
# CUDA graphs (torch.compile mode="reduce-overhead") would replay the ops' copies without their
# Python bodies, so no statistics after the capture: the tag, where this torch has it, keeps the
# armed graph's ops out of any captured graph.
_TAGS = ({"tags": (torch.Tag.cudagraph_unsafe,)}
         if hasattr(torch.Tag, "cudagraph_unsafe") and "tags" in inspect.signature(torch.library.custom_op).parameters
         else {})


def register(watch) -> int:
    """A token the ops below find `watch` by, for as long as it lives."""
    token = next(_TOKENS)
    _WATCHES[token] = weakref.ref(watch, lambda _, token=token: _WATCHES.pop(token, None))
    return token


def _watch(token: int):
    ref = _WATCHES.get(token)
    return ref() if ref is not None else None


def fits(args, output) -> bool:
    """Whether the ops can take this layer call: a plain tensor input and output."""
    return len(args) > 0 and type(args[0]) is torch.Tensor and type(output) is torch.Tensor


@torch.library.custom_op("fp8plug::numerics_tap", mutates_args=(), **_TAGS)
def numerics_tap(output: torch.Tensor, x: torch.Tensor, token: int, fqn: str) -> torch.Tensor:
    """The watch of `token` measures layer `fqn`'s forward with input `x`; a copy of `output`."""
    watch = _watch(token)
    if watch is not None:
        watch.record_forward(fqn, x)
    return output.clone()


@numerics_tap.register_fake
def _(output, x, token, fqn):
    return torch.empty_like(output)


@torch.library.custom_op("fp8plug::numerics_grad_tap", mutates_args=(), **_TAGS)
def numerics_grad_tap(grad: torch.Tensor, token: int, fqn: str) -> torch.Tensor:
    """The watch of `token` measures layer `fqn`'s input-gradient GEMM with `grad`; a copy of it."""
    watch = _watch(token)
    if watch is not None:
        watch.record_grad(fqn, grad)
    return grad.clone()


@numerics_grad_tap.register_fake
def _(grad, token, fqn):
    return torch.empty_like(grad)


def _setup_context(ctx, inputs, output):
    ctx.token, ctx.fqn = inputs[2], inputs[3]


def _backward(ctx, grad):
    return numerics_grad_tap(grad, ctx.token, ctx.fqn), None, None, None


numerics_tap.register_autograd(_backward, setup_context=_setup_context)
