"""The protocol every FP8 engine implements, the small records it returns, and the errors it raises.

An engine is one Engine subclass (fp8plug/backends/<name>/engine.py, or one file) plus its row in
fp8plug.recipe.engines. Its core, which every engine answers: whether it can run (`probe`), its
frozen plan made once from the recipe fields it honours (`make_plan`, through
fp8plug.recipe.plans), what it converts in a model (`eligible`, asked while a conversion is
planned), converting exactly the modules a plan lists to its own (`convert_listed`) and back,
its grouped GEMM for MoE experts or why it has none (`grouped_gemm`), the context a forward
runs in (`autocast`), the work due once per optimizer step (`end_step`), and its FP8 scaling state
for checkpoints. Anything more is an optional capability (OPTIONAL): a method Engine does not
define, which an engine has exactly when it defines it, and which callers ask about with
`offers` before calling it. Code outside fp8plug/backends/ talks to an engine only through these
methods and never asks which engine it has. An engine imports this module and shared helpers
(fp8plug.layers.rules, backends.padding, backends.region, ...), never a sibling engine or the
registry (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, FrozenSet, Mapping, Optional, Tuple

import torch
from torch import nn

from fp8plug.layers.rules import ConversionReport, Eligibility, ModulePlan, decide_modules, linear_alignment_problem
from fp8plug.recipe.kwargs import FP8RecipeKwargs
from fp8plug.recipe.plans import Plan, Settings, default_acts_as, default_why, make_plan
from fp8plug.tuning.hardware import DeviceInfo


class BackendUnavailableError(RuntimeError):
    """FP8 was asked for where no engine (or not the requested one) can run; the message says why
    and what to install."""


@dataclass(frozen=True)
class Probe:
    """Whether an engine's package imports, with its version or the reason it does not."""

    available: bool
    version: Optional[str] = None
    reason: str = ""


# Lines engines' packages log when fp8plug imports them that say nothing about the user's run:
# (logger, start of the message, only on a machine without CUDA). torchao tries its CUDA kernel
# libraries and Triton, which cannot load without a GPU (on a GPU a failure there stays visible);
# torch's pytree deprecation is addressed to torchao's code, not to its users.
IMPORT_NOISE = (
    ("torchao", "Failed to load ", True),
    ("torchao.kernel.intmm", "Warning: Detected no triton", True),
    ("torch.utils._pytree", "<enum ", False),
)


class _DropNoise(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start) and not record.getMessage().startswith(self.start)


@contextlib.contextmanager
def quiet_import_noise():
    """Within the block, drop exactly the IMPORT_NOISE lines (by logger and message start); every
    other record of those loggers, and every other logger, passes. Used around engine imports."""
    attached = []
    for name, start, cpu_only in IMPORT_NOISE:
        if cpu_only and torch.cuda.is_available():
            continue
        drop = _DropNoise(start)
        logging.getLogger(name).addFilter(drop)
        attached.append((name, drop))
    try:
        yield
    finally:
        for name, drop in attached:
            logging.getLogger(name).removeFilter(drop)


def probe_import(module_name: str, version_of: Optional[Callable] = None) -> Probe:
    """Import `module_name` and report, never raise: a broken install (RuntimeError, OSError, a
    missing shared library) is an unavailable engine with its reason, not a crash."""
    try:
        with quiet_import_noise():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.split(".")[0] == exc.name.split(".")[0]:
            return Probe(False, reason="not installed")
        return Probe(False, reason=f"installed but not importable: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return Probe(False, reason=f"installed but not importable: {type(exc).__name__}: {exc}")
    version = version_of(module) if version_of else getattr(module, "__version__", None)
    return Probe(True, version=str(version) if version is not None else None)


# The optional capabilities: methods Engine does not define. An engine has one exactly when its
# class defines the method; a caller asks `offers(engine, name)` first and otherwise takes its own
# plain path. So what an engine can do is said once, by the method, never by a flag beside it.
OPTIONAL = {
    "frozen_fp8_layer": "frozen_fp8_layer(fp8, scale, bias, compute_dtype, name) -> nn.Linear: a frozen Linear "
                        "keeping an FP8 checkpoint's codes and per-tensor scale in FP8, fed to the engine's FP8 GEMMs "
                        "with no weight gradient (LoRA on an FP8 release: fp8plug.checkpoints.fp8_base)",
    "prepare": "prepare(model, optimizer, plan) -> (model, optimizer): adapt a converted model and its optimizer "
               "together; fp8plug.Accelerator finds the one optimizer holding each model's parameters for it",
    "clip_grad_norm_": "clip_grad_norm_(parameters, max_norm, norm_type): fp8plug.Accelerator clips with it instead "
                       "of accelerate's, which cannot read the engine's gradients",
    "runs_fp8": "runs_fp8(module, input) -> bool: whether this call of a converted Linear runs its GEMMs in FP8, "
                "decided as its forward decides, in plain traceable code; converted Linears then count their "
                "calls (fp8plug.layers.gemm_counts)",
    "microbatch": "microbatch(is_first) -> context: one micro-batch of gradient accumulation, the first since the "
                  "last optimizer step or not (fp8plug.Accelerator.accumulate)",
    "plain_entries": "plain_entries(state_dict) -> dict: the state dict without the engine's own entries, its value "
                     "types made plain (Engine.plain_state_dict, fp8plug.checkpoints.state)",
    "engine_recipe": "engine_recipe(recipe_object) -> plan: the engine's own recipe object, taken where an "
                     "FP8RecipeKwargs is expected (fp8plug.autocast)",
    "has_storageless_weights": "has_storageless_weights() -> bool: whether converted models may now hold weights "
                               "without storage of their own, which accelerate's FSDP2 preparation must look "
                               "through (fp8plug.Accelerator)",
    "deepspeed_problem": "deepspeed_problem(stage, partitioned) -> str or None: why the engine cannot train under "
                         "DeepSpeed ZeRO `stage` (fp8plug.integrations.deepspeed_zero)",
    "operand_scales": "operand_scales(module) -> {'input'|'weight'|'grad_output': scale}: how a converted Linear "
                      "scales each operand now: a float32 tensor (the scale it casts with, e.g. delayed scaling's), "
                      "a granularity word ('rowwise', 'blockwise': from the current amax at that granularity) or "
                      "None (the current amax, per tensor); the numerics watch emulates the cast with it "
                      "(fp8plug.numerics.watch). Without it, every operand counts as None",
    "rescale_layer": "rescale_layer(model, fqn, scaling): move the one converted Linear `fqn` to the finer "
                     "`scaling` ('rowwise', 'blockwise') or to high precision ('bf16'), keeping its Parameters; "
                     "ValueError for a scaling it lacks (the numerics guard then tries the next, "
                     "fp8plug.numerics.guard)",
}


def offers(engine, capability: str) -> bool:
    """Whether `engine` has the optional `capability` (a name in OPTIONAL): its class defines it."""
    if capability not in OPTIONAL:
        raise ValueError(f"{capability!r} is not an optional engine capability; those are {', '.join(OPTIONAL)}.")
    return callable(getattr(engine, capability, None))


class Engine:
    """One FP8 engine behind one protocol: the core every engine answers. Subclasses set the class
    attributes, override what their engine does (the defaults are what an engine that needs
    nothing there would do) and define the optional capabilities they have (OPTIONAL)."""

    name: ClassVar[str]  # its row's name (fp8plug.recipe.engines)
    title: ClassVar[str]
    install_hint: ClassVar[str]
    runs_on_cpu: ClassVar[bool] = False  # read by `supports`
    # the scaling recipes FP8RecipeKwargs.scaling may name for this engine; the default comes first
    scalings: ClassVar[Tuple[str, ...]] = ()
    # The recipe fields this engine reads (besides fp8plug.recipe.plans.SHARED), under every scaling and
    # under one scaling only: `make_plan` can read exactly these, and a field the user passes that
    # is not among them is warned about (fp8plug.recipe.plans), so a new field needs no other edit.
    honours: ClassVar[FrozenSet[str]] = frozenset()
    honours_by_scaling: ClassVar[Mapping[str, FrozenSet[str]]] = {}
    # the engine's plan: `make_plan` returns one, and what its methods take
    plan_class: ClassVar[type] = Plan

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

    def require(self) -> Any:
        """Make sure the engine's package imports, or raise BackendUnavailableError saying why and
        how to install it. Engines return their imported package where they have one."""
        probe = self.probe()
        if not probe.available:
            raise self.unavailable(probe.reason)
        return None

    def unavailable(self, reason: str, install: bool = True) -> BackendUnavailableError:
        """The error for this engine asked for where it cannot run, in one line: why, then the fix:
        how to install it (`install`, where the package is the problem), else another engine."""
        fix = f"install it with `{self.install_hint}`, or" if install else "use"
        return BackendUnavailableError(
            f"FP8 backend {self.name!r} ({self.title}) cannot run here: {reason}; {fix} another backend "
            "or backend=None for the automatic choice (`fp8plug env` lists what runs here)."
        )

    # the recipe, once -----------------------------------------------------------------------------
    def honoured(self, scaling: str) -> FrozenSet[str]:
        """The recipe fields this engine reads under `scaling` (`honours`, `honours_by_scaling`)."""
        return self.honours | self.honours_by_scaling.get(scaling, frozenset())

    def acts_as(self, name: str, scaling: str):
        """What the engine does about a field it ignores under `scaling`, as a value of that field:
        a user's value equal to it changes nothing, so it is not warned about. Default: the
        recipe's default."""
        return default_acts_as(name)

    def why_ignored(self, name: str, scaling: str) -> str:
        """The reason in the warning for a field this engine ignores (fp8plug.recipe.plans words it).
        Default: what the field applies to (recipe.APPLIES_TO)."""
        return default_why(self, name)

    def make_plan(self, settings: Settings) -> Plan:
        """This engine's frozen plan from the fields it honours (`settings`, fp8plug.recipe.plans.Settings),
        refusing with a ValueError naming the field what it cannot do; called once per selection by
        fp8plug.recipe.plans.make_plan, which fills in the plan's shared part. Default: no settings of its
        own."""
        return self.plan_class()

    def plan_of(self, plan) -> Plan:
        """`plan` as this engine's plan: its own plan as is; an FP8RecipeKwargs (or None: one from
        the environment and the defaults) made into one (fp8plug.recipe.plans.make_plan, on the current
        device). Where the engine's methods are called directly with a recipe, this is the one
        place it becomes a plan."""
        if isinstance(plan, self.plan_class):
            return plan
        if plan is None or isinstance(plan, FP8RecipeKwargs):
            return make_plan(self, plan)
        raise TypeError(
            f"the {self.title} engine takes an fp8plug.FP8RecipeKwargs or its own {self.plan_class.__name__}, "
            f"not {type(plan).__name__}."
        )

    def offers_scaling(self, scaling) -> bool:
        """Whether FP8RecipeKwargs.scaling = `scaling` names a recipe of this engine (None: its
        default, always): what the automatic choice asks before it picks an engine."""
        try:
            self.scaling_name(scaling)
        except ValueError:
            return False
        return True

    def scaling_name(self, scaling: Optional[str]) -> str:
        """The scaling recipe this engine will use for FP8RecipeKwargs.scaling = `scaling`: that
        one, checked, or the default (the first of `scalings`) for None."""
        if scaling is None:
            return self.scalings[0]
        if scaling not in self.scalings:
            raise ValueError(
                f"FP8RecipeKwargs.scaling: {scaling!r} is not a {self.title} recipe; "
                f"use one of {', '.join(self.scalings)}."
            )
        return scaling

    # conversion ---------------------------------------------------------------------------------
    def convert(self, model: nn.Module, plan, linear: bool = True, norm: bool = True) -> "ConversionReport":
        """Swap the eligible modules of `model` (in place) for this engine's FP8 modules, as `plan`
        says (its plan; a recipe is made into one, `plan_of`): its Linear layers where `linear`,
        and the norms it converts, if any, where `norm` (Accelerate's convert_model(_convert_linear,
        _convert_ln)). The decisions first, as data (fp8plug.layers.rules.decide_modules, asking
        `eligible`), then `convert_listed` carries them out; engines do not override this."""
        plan = self.plan_of(plan)
        modules = decide_modules(model, self, plan, linear, norm)
        report = modules.report()
        self.convert_listed(model, plan, modules, report)
        return report

    def eligible(self, model: nn.Module, plan, linear: bool = True, norm: bool = True) -> Eligibility:
        """What this engine converts in `model` under `plan` (fp8plug.layers.rules.Eligibility): the
        module types, each with why one cannot convert; asked once per conversion, before anything
        changes. Default: exact nn.Linear layers with aligned features, where `linear`, under the
        plan's filter."""
        checks = {nn.Linear: linear_alignment_problem} if linear else {}
        return Eligibility(checks, module_filter_fn=plan.module_filter_fn)

    def convert_listed(self, model: nn.Module, plan, modules: "ModulePlan", report: "ConversionReport") -> None:
        """Swap exactly the modules `modules` lists as converting (fp8plug.layers.report.ModulePlan,
        made by `decide_modules` for this engine and `plan`) for this engine's FP8 modules, in place,
        recording each in `report` (fp8plug.layers.rules.swap_modules, record_converted). It
        decides nothing: what it cannot do here it refuses before touching the model."""
        raise NotImplementedError

    def grouped_gemm(self, plan=None, device=None):
        """The engine's grouped FP8 GEMM for a mixture-of-experts projection under `plan` on
        `device` (None: not a CUDA device), fn(x [S, K], weight [E, N, K], offs [E] int32,
        transposed) -> [S, N], or why it has none (a str); a model's experts run in FP8 through it
        (fp8plug.hf.experts). Its `scaling` attribute, where it has one, names the scaling it
        applies whatever the recipe's (the conversion report says it). Default: none."""
        return f"the {self.name} engine has no grouped FP8 GEMM"

    def tensor_parallel_problem(self, plan) -> Optional[str]:
        """Why this engine cannot train a tensor-parallel model (Linears whose weights a sharding plan
        made DTensors: Accelerate's ParallelismConfig(tp_size=N), a transformers `tp_plan`, torch's
        parallelize_module) under `plan`, naming the fix; None where it can. Asked before a
        tensor-parallel model is converted (fp8plug.conversion.tensor_parallel). Default: it cannot."""
        return (f"the {self.title} engine (backend={self.name!r}) has no FP8 Linear that runs on DTensor shards. "
                "Use backend='native', whose FP8 Linear runs tensor-parallel layers; or train with tp_size=1 and "
                "shard with FSDP2 (ParallelismConfig(dp_shard_size=<number of GPUs>) or "
                "FullyShardedDataParallelPlugin(fsdp_version=2))")

    def unconvert(self, model: nn.Module) -> nn.Module:
        """Swap this engine's modules back for plain torch modules with the same weights."""
        raise NotImplementedError

    def is_converted(self, module: nn.Module) -> bool:
        """Whether `module` is one of this engine's FP8 modules."""
        return False

    # running ------------------------------------------------------------------------------------
    def autocast(self, plan, enabled: bool = True):
        """The context a forward runs in: FP8 when `enabled`, high precision otherwise, as `plan`
        says (engines whose context needs nothing from it ignore it)."""
        return contextlib.nullcontext()

    def end_step(self, models, group=None) -> None:
        """Work due once per applied optimizer step, after the update, for `models` (every model
        this engine converted when the list is empty), with collectives over the ranks of `group`
        (all ranks when None): native's delayed scaling update, torchao's FSDP2 float8 all-gather
        scales. Reached only through fp8plug.backends.steps.end_step, once per step whatever runs the
        loop; an engine with such work tracks the models it converts (fp8plug.backends.steps.track).
        Default: nothing."""

    # checkpoints --------------------------------------------------------------------------------
    def fp8_state(self, model: nn.Module) -> Dict[str, Dict[str, torch.Tensor]]:
        """The FP8 scaling state of `model`'s converted modules ({module fqn: {name: tensor}}),
        which the plain state dict leaves out; `Accelerator.save_state` stores it beside the
        weights so a resumed run continues identically. Engines without such state return {}."""
        return {}

    def load_fp8_state(self, model: nn.Module, state: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Put back what `fp8_state` returned (into a model converted the same way)."""

    def plain_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
        """`state_dict` without this engine's own entries: only the plain architecture's keys remain
        (the engine's part is its `plain_entries`, where it has one; engines do not override this).

        The result is an OrderedDict in the input's key order, with its `_metadata`, as
        `nn.Module.state_dict()` returns: accelerate removes tied and other shared tensors before
        a safetensors save only from an OrderedDict (a plain dict reaches safetensors with both
        names of a tied weight, and it refuses to write: "Some tensors share memory")."""
        kept = OrderedDict(state_dict)
        if offers(self, "plain_entries"):
            kept = self.plain_entries(kept)
        out = OrderedDict((key, kept[key]) for key in state_dict if key in kept)
        out.update((key, value) for key, value in kept.items() if key not in out)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata
        return out
