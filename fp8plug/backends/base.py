"""The protocol every FP8 engine implements, and the small records it returns.

An engine is one class in one file: it says whether it can run (and why not), converts a model's
modules to its own and back, gives the autocast context its modules need, and may adapt the
optimizer and the state dict. Which modules to convert, the eval policy, checkpoints and the
Accelerate wiring are shared and live outside the engines.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Dict, Optional, Tuple

import torch
from torch import nn

from ..hardware import DeviceInfo

if TYPE_CHECKING:
    from ..convert import ConversionReport
    from ..recipe import FP8RecipeKwargs


@dataclass(frozen=True)
class Probe:
    """Whether an engine's package imports, with its version or the reason it does not."""

    available: bool
    version: Optional[str] = None
    reason: str = ""


def probe_import(module_name: str, version_of: Optional[Callable] = None) -> Probe:
    """Import `module_name` and report, never raise: a broken install (RuntimeError, OSError, a
    missing shared library) is an unavailable engine with its reason, not a crash."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.split(".")[0] == exc.name.split(".")[0]:
            return Probe(False, reason="not installed")
        return Probe(False, reason=f"installed but not importable: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return Probe(False, reason=f"installed but not importable: {type(exc).__name__}: {exc}")
    version = version_of(module) if version_of else getattr(module, "__version__", None)
    return Probe(True, version=str(version) if version is not None else None)


class Backend:
    """One FP8 engine behind one protocol. Subclasses set the class attributes and override what
    their engine does; the defaults are what an engine that needs nothing there would do."""

    name: ClassVar[str]
    title: ClassVar[str]
    install_hint: ClassVar[str]
    runs_on_cpu: ClassVar[bool] = False
    # name -> (human description); the engine's default comes first
    scalings: ClassVar[Tuple[str, ...]] = ()

    # availability -----------------------------------------------------------------------------
    def probe(self) -> Probe:
        """Import the engine's package lazily and say whether it works here."""
        raise NotImplementedError

    def supports(self, device: DeviceInfo) -> Tuple[bool, str]:
        """Whether this engine can run FP8 on `device`, and the reason if not."""
        if device.type == "cuda":
            if device.fp8_gemm:
                return True, ""
            major, minor = device.capability
            return False, (
                f"{device.name} has compute capability {major}.{minor}; FP8 GEMMs need 8.9 or newer "
                "(Ada, Hopper, Blackwell)"
            )
        if device.type == "cpu" and self.runs_on_cpu:
            return True, ""
        return False, f"needs a CUDA GPU with compute capability 8.9 or newer, not {device.describe()}"

    def scaling_name(self, recipe: "FP8RecipeKwargs") -> str:
        """The scaling recipe this engine will use: the recipe's choice, checked, or the default."""
        if recipe.scaling is None:
            return self.scalings[0]
        if recipe.scaling not in self.scalings:
            raise ValueError(
                f"FP8RecipeKwargs.scaling: {recipe.scaling!r} is not a {self.title} recipe; "
                f"use one of {', '.join(self.scalings)}."
            )
        return recipe.scaling

    # conversion ---------------------------------------------------------------------------------
    def convert(self, model: nn.Module, recipe: "FP8RecipeKwargs") -> "ConversionReport":
        """Swap the eligible modules of `model` (in place) for this engine's FP8 modules."""
        raise NotImplementedError

    def unconvert(self, model: nn.Module) -> nn.Module:
        """Swap this engine's modules back for plain torch modules with the same weights."""
        raise NotImplementedError

    def is_converted(self, module: nn.Module) -> bool:
        """Whether `module` is one of this engine's FP8 modules."""
        return False

    # running ------------------------------------------------------------------------------------
    def autocast(self, recipe: "FP8RecipeKwargs", enabled: bool = True):
        """The context a forward runs in: FP8 when `enabled`, high precision otherwise."""
        return contextlib.nullcontext()

    def runs_fp8(self, module: nn.Module, input) -> Optional[bool]:
        """Whether this call of the converted Linear `module` on `input` runs its GEMMs in FP8,
        decided exactly as its forward decides (fp8plug.coverage counts calls with it; it runs
        inside compiled graphs, so it must be plain, traceable code). An engine that does not
        override it gets no GEMM counts."""
        return None

    def prepare(self, model: nn.Module, optimizer, recipe: "FP8RecipeKwargs"):
        """Adapt a (model, optimizer) pair after conversion; most engines need nothing."""
        return model, optimizer

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Work due once the optimizer has stepped (e.g. precomputing FSDP float8 scales)."""

    def deepspeed_problem(self, stage: int, partitioned: bool) -> Optional[str]:
        """Why this engine cannot train under DeepSpeed ZeRO `stage` (with the model's weights
        already `partitioned` by deepspeed.zero.Init when True), or None where it can
        (fp8plug.deepspeed turns the reason into the error)."""
        return None

    def sync_scaling(self, models, group=None) -> None:
        """End a step of delayed scaling for `models` (every model this engine converted when
        empty): reduce amaxes across the ranks of `group` and update the scales. Engines whose
        scaling has no state across steps, or that do this themselves, need nothing here."""

    # checkpoints --------------------------------------------------------------------------------
    def plain_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The state dict with the engine's own entries removed: the plain architecture's keys."""
        return state_dict

    def microbatch(self, is_first: Optional[bool]):
        """Context for one micro-batch of gradient accumulation: `is_first` says whether it is the
        first since the last optimizer step (engines that cache FP8 weights use it). Default: no-op."""
        return contextlib.nullcontext()

    def fp8_state(self, model: nn.Module) -> Dict[str, Dict[str, torch.Tensor]]:
        """The FP8 scaling state of `model`'s converted modules ({module fqn: {name: tensor}}),
        which the plain state dict leaves out; `Accelerator.save_state` stores it beside the
        weights so a resumed run continues identically. Engines without such state return {}."""
        return {}

    def load_fp8_state(self, model: nn.Module, state: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Put back what `fp8_state` returned (into a model converted the same way)."""
