"""What a sharding plan (or another wrapper) put on a module, carried to the module replacing it.

Why: converting swaps a Linear for an engine's FP8 module (and unconverting swaps it back), while
tensor parallelism lives on the Linear module object itself. torch's `parallelize_module`
registers forward pre-hooks and hooks on it (the input's redistribution, a row-wise layer's
reduction); transformers' `tp_plan` replaces the instance's `forward` with a function closing over
the module and its original bound `forward`, and marks it (`_is_hooked`); accelerate's big-model
hooks keep `_hf_hook` and `_old_forward`. A replacement that dropped them would run the bare GEMM
on shards and return partial sums unreduced. So every replacement (fp8plug.layers.rules
`replace_module`, the one place modules are swapped) carries over:

- the hooks, except fp8plug's own (the GEMM counter, the numerics watch: each layer gets its own);
- the instance attributes the replaced module has and a fresh replacement lacks (`forward`,
  `_is_hooked`, ...); of a module fp8plug built, exactly those it was given this way (CARRIED);
- with every reference they hold to the replaced module (a closure cell, a partial's argument, a
  method bound to it) made one to the replacement: its original `forward` becomes the
  replacement's class's `forward`, so the plan's wrapper now runs the FP8 GEMM.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from torch import nn

CARRIED = "_fp8plug_carried"  # on a replacement: the names of the attributes carried onto it
# the hook dicts, each with the dicts of flags keyed like it (which hooks take kwargs, run always)
_HOOK_DICTS = {"_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
               "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
               "_backward_pre_hooks": (), "_backward_hooks": ()}
_DEPTH = 3  # how far into closures and partials references to the replaced module are followed


def _ours(hook: Any) -> bool:
    """Whether `hook` is fp8plug's own (each converted layer gets its own, never a carried one)."""
    target = hook.func if isinstance(hook, functools.partial) else hook
    where = getattr(target, "__module__", None) or type(target).__module__
    return str(where).startswith("fp8plug.")


def _rebound(value: Any, old: nn.Module, new: nn.Module, depth: int = _DEPTH) -> Any:
    """`value` with each reference to `old` made one to `new` (the module doc); `value` itself
    where it holds none."""
    if value is old:
        return new
    if isinstance(value, types.MethodType) and value.__self__ is old:
        method = getattr(type(new), value.__func__.__name__, None)
        if not callable(method):
            raise ValueError(
                f"cannot replace {type(old).__name__} by {type(new).__name__}: a wrapper on it calls its method "
                f"{value.__func__.__name__!r}, which {type(new).__name__} lacks; leave the module out of the "
                "conversion (modules_to_ignore), or add the wrapper after converting.")
        return types.MethodType(method, new)
    if depth == 0:
        return value
    if isinstance(value, functools.partial):
        func = _rebound(value.func, old, new, depth - 1)
        args = tuple(_rebound(a, old, new, depth - 1) for a in value.args)
        keywords = {k: _rebound(v, old, new, depth - 1) for k, v in value.keywords.items()}
        if func is value.func and all(a is b for a, b in zip(args, value.args)) and all(
                keywords[k] is value.keywords[k] for k in keywords):
            return value
        rebound = functools.partial(func, *args, **keywords)
        rebound.__dict__.update({k: _rebound(v, old, new, depth - 1) for k, v in vars(value).items()})
        return rebound
    if isinstance(value, types.FunctionType) and value.__closure__:
        contents = []
        for cell in value.__closure__:
            try:
                contents.append(cell.cell_contents)
            except ValueError:  # an empty cell (a name bound later): nothing to rebind
                contents.append(cell)
        rebound_contents = [c if isinstance(c, types.CellType) else _rebound(c, old, new, depth - 1) for c in contents]
        if all(a is b for a, b in zip(rebound_contents, contents)):
            return value
        cells = tuple(c if isinstance(c, types.CellType) else types.CellType(c) for c in rebound_contents)
        function = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        function.__kwdefaults__ = value.__kwdefaults__
        function.__qualname__ = value.__qualname__
        function.__dict__.update({k: _rebound(v, old, new, depth - 1) for k, v in vars(value).items()})
        return function
    return value


def _carried_names(old: nn.Module, new: nn.Module):
    """The instance attributes of `old` to put on `new` (the module doc)."""
    if type(old).__module__.startswith("fp8plug."):
        return [name for name in getattr(old, CARRIED, ()) if name in vars(old)]
    return [name for name in vars(old) if name not in vars(new) and name != CARRIED
            and (name == "forward" or not hasattr(type(new), name))]


def carry_over(old: nn.Module, new: nn.Module) -> None:
    """Put on `new`, which replaces `old`, the hooks and instance attributes a sharding plan or
    another wrapper put on `old` (the module doc); nothing where `old` has none."""
    for name, flag_dicts in _HOOK_DICTS.items():
        hooks = {key: hook for key, hook in getattr(old, name, {}).items() if not _ours(hook)}
        if not hooks:
            continue
        getattr(new, name).update({key: _rebound(hook, old, new) for key, hook in hooks.items()})
        for flags in flag_dicts:
            getattr(new, flags).update({key: flag for key, flag in getattr(old, flags).items() if key in hooks})
        if name == "_backward_hooks":  # full or not: how the module runs them
            new._is_full_backward_hook = old._is_full_backward_hook
    names = _carried_names(old, new)
    for name in names:
        new.__dict__[name] = _rebound(vars(old)[name], old, new)
    if names and type(new).__module__.startswith("fp8plug."):  # a plain module keeps nothing of fp8plug
        new.__dict__[CARRIED] = tuple(names)
