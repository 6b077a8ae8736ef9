"""fp8plug.Accelerator: accelerate.Accelerator training in FP8 with whichever fp8plug engine runs.

Accelerate knows only its own FP8 handler classes (any other raises a bare KeyError) and only its
own engines, and `accelerate launch` hands it FP8 settings it cannot read (a lower-case
`--fp8_backend ao`, `backend: native`). This subclass takes FP8 over entirely:

- `FP8RecipeKwargs` is taken out of `kwargs_handlers` before accelerate sees it;
- mixed precision "fp8" (argument, `accelerate launch`, config file) becomes bf16 autocast for
  accelerate, so accelerate's own FP8 code never runs, while fp8plug's engine runs the Linears in
  FP8 and `accelerator.mixed_precision` still reports "fp8";
- `prepare()` converts each model once, before any DDP/FSDP2 wrapping and torch.compile, keeps
  optimizers pointing at the converted parameters, wraps the forward in the engine's autocast,
  and runs the engine's work after each optimizer step;
- state dicts stay the plain architecture's, and `save_state`/`load_state` carry the FP8 scaling
  state too, with its recipe; a save is whole or refused, a refused load changes nothing
  (fp8plug.checkpoints.resume, fp8plug.checkpoints.state).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import weakref
from typing import List, Optional

import accelerate
import accelerate.utils
import torch
from torch import nn

from fp8plug._upstream import (  # noqa: F401  (storage_view: public here)
    AcceleratorInternals,
    FP8EngineName,
    is_prepared,
    prepared_models,
    prepared_optimizers,
    restore_forward,
    shared_precision,
    storage_view,
)
from fp8plug.api import loaded_engines
from fp8plug.autocast import apply_fp8_autowrap
from fp8plug.backends import select_for
from fp8plug.backends.base import Engine, offers
from fp8plug.checkpoints import resume
from fp8plug.checkpoints.state import FP8CheckpointState, install_plain_state_dict
from fp8plug.conversion.apply import apply_plan
from fp8plug.conversion.plan import check_converted_like, plan_model
from fp8plug.conversion.tensor_parallel import check_tensor_parallel
from fp8plug.coverage import fp8_coverage, log_selection
from fp8plug.hf.regional_loss import compile_losses
from fp8plug.integrations import deepspeed_zero as ds
from fp8plug.integrations.cpu_processes import join_cpu_processes
from fp8plug.integrations.optim import convert_optimizer
from fp8plug.layers.gemm_counts import settle_all
from fp8plug.layers.rules import ConversionError, ConversionReport, check_convertible
from fp8plug.numerics.watch import numerics_stats, watch_of
from fp8plug.recipe.engines import BACKENDS, listed
from fp8plug.recipe.kwargs import FP8RecipeKwargs
from fp8plug.recipe.plans import Plan, make_plan

# accelerate's own FP8 handler classes (which exist depends on its version)
_ACCELERATE_FP8_HANDLERS = tuple(
    getattr(accelerate.utils, name)
    for name in ("AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs")
    if hasattr(accelerate.utils, name)
)
_INIT_SIGNATURE = inspect.signature(accelerate.Accelerator.__init__)


def requested_precision(mixed_precision) -> str:
    """The mixed precision asked for: the argument, else what `accelerate launch` exported."""
    if mixed_precision is None:
        return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    return str(getattr(mixed_precision, "value", mixed_precision)).strip().lower()


class Accelerator(AcceleratorInternals, accelerate.Accelerator):
    """accelerate.Accelerator that also takes `fp8plug.FP8RecipeKwargs` and trains in FP8 with any
    fp8plug engine (native, torchao, TransformerEngine, MS-AMP).

    Same arguments as accelerate.Accelerator. FP8 is on when mixed precision is "fp8" (the
    argument, or `accelerate launch --mixed_precision fp8`, or a config file); the recipe is the
    `FP8RecipeKwargs` in `kwargs_handlers`, else one read from the `ACCELERATE_FP8_*` environment.

    Attributes added: `fp8_recipe` (the FP8RecipeKwargs), `fp8_engine` (the Engine),
    `fp8_selection` (why that engine), `fp8_plan` (the engine's plan, made from the recipe once
    here: what conversion, autocast and the optimizer take), `fp8_reports` (one
    ConversionReport per converted model),
    `fp8_models` (the converted models);
    `fp8_coverage()` counts what ran in FP8. `fp8_backend` names the engine in use ("native",
    "ao", "te", "msamp": an FP8EngineName, equal to no FP8BackendType member, so accelerate's
    own FP8 code stays off), or FP8BackendType.NO without FP8.
    """

    def __init__(self, *args, **kwargs):
        bound = _INIT_SIGNATURE.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        handlers = list(arguments.get("kwargs_handlers") or [])
        recipe = _take_recipe(handlers)
        precision = requested_precision(arguments.get("mixed_precision"))
        fp8_on = precision == "fp8"
        if recipe is not None and not fp8_on:
            where = ""
            if arguments.get("mixed_precision") is None:
                where = (" (from ACCELERATE_MIXED_PRECISION)" if "ACCELERATE_MIXED_PRECISION" in os.environ
                         else ": no mixed_precision was given, and accelerate's default is 'no'")
            raise ValueError(
                f"FP8RecipeKwargs was passed in kwargs_handlers but mixed_precision is {precision!r}{where}; "
                "pass Accelerator(mixed_precision='fp8', ...) or launch with `--mixed_precision fp8` "
                "(or `mixed_precision: fp8` in the config file)."
            )
        if fp8_on:
            recipe = recipe or FP8RecipeKwargs()
            # bf16 is what runs outside the FP8 Linears. Where a plain accelerate.Accelerator was
            # built first in this process (a Trainer's, say), accelerate's shared state already
            # says "fp8" and refuses any change: keep it, accelerate runs bf16 autocast for "fp8"
            # too, and `fp8_backend` below keeps its own FP8 code off either way.
            arguments["mixed_precision"] = "fp8" if shared_precision() == "fp8" else "bf16"
        join_cpu_processes(arguments, handlers)
        arguments["kwargs_handlers"] = handlers
        with ds.clearer_init_errors(fp8_on):
            super().__init__(**arguments)
        if ds.is_deepspeed(self):
            ds.check_processes(self)

        self.fp8_enabled = fp8_on
        self.fp8_recipe: Optional[FP8RecipeKwargs] = recipe
        self.fp8_recipe_handler = recipe
        self.fp8_selection = None
        self.fp8_engine: Optional[Engine] = None
        self.fp8_plan: Optional[Plan] = None
        self.fp8_reports: List[ConversionReport] = []
        self._fp8_models: List[nn.Module] = []
        # the converted models' FP8 scaling state: save_state writes it (fp8plug.checkpoints.resume);
        # Trainer checkpoints too
        self.fp8_checkpoint_state: Optional[FP8CheckpointState] = None
        if fp8_on:
            # compiled: known only with a dynamo backend; otherwise the user may still compile the
            # model themselves, before or after prepare, so the choice is for either (None)
            self.fp8_selection = select_for(recipe, self.device, compiled=True if self._compiles_model() else None)
            self.fp8_engine = self.fp8_selection.backend
            recipe = self.fp8_recipe = self.fp8_recipe_handler = self.fp8_selection.tune(recipe)
            log_selection(self.fp8_selection)
            # the plan, once: a recipe the engine refuses fails here, not mid-prepare; the speed
            # filter on as the recipe says (docs/recipe.md#auto_filter)
            self.fp8_plan = make_plan(self.fp8_engine, self._recipe_for_run(recipe), self.fp8_selection.device,
                                      auto_filter=True)
            self.fp8_checkpoint_state = FP8CheckpointState(self.fp8_engine, self._fp8_models, recipe)
            if ds.is_deepspeed(self):
                ds.check_engine(self)

    def _recipe_for_run(self, recipe: FP8RecipeKwargs) -> FP8RecipeKwargs:
        """`recipe` as this run can use it: float8 all-gather only under FSDP2 (`accelerate launch`
        exports it as true by default; it means something only there)."""
        if recipe.enable_fsdp_float8_all_gather and not self.is_fsdp2:
            recipe = copy.copy(recipe)
            recipe.enable_fsdp_float8_all_gather = False
        return recipe

    def _compiles_model(self) -> bool:
        """Whether prepare() will torch.compile the model (a dynamo backend from the argument, the
        config file or `accelerate launch`): the automatic engine choice ranks engines by their
        speed in that mode."""
        backend = getattr(getattr(self.state, "dynamo_plugin", None), "backend", None)
        return backend is not None and str(getattr(backend, "value", backend)).upper() != "NO"

    # what accelerate sees -------------------------------------------------------------------------
    @property
    def mixed_precision(self):
        """"fp8" while FP8 is on (accelerate itself runs bf16 then); otherwise accelerate's value."""
        if getattr(self, "fp8_enabled", False) and getattr(self, "fp8_engine", None) is not None:
            return "fp8"
        return super().mixed_precision

    # fp8_backend, and the private accelerate methods fp8plug overrides: fp8plug._upstream

    @property
    def fp8_models(self) -> List[nn.Module]:
        """The models this Accelerator converted to FP8, in the order prepare() met them (as
        converted: the modules inside any DDP/DeepSpeed/compile wrapper)."""
        return list(self._fp8_models)

    def fp8_weights_may_lack_storage(self) -> bool:
        """Whether a loaded engine may hold weights as tensors without storage of their own
        (its `has_storageless_weights`), which accelerate's FSDP2 parameter lookup must unwrap."""
        return any(offers(engine, "has_storageless_weights") and engine.has_storageless_weights()
                   for engine in loaded_engines())

    # prepare ---------------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """accelerate's prepare, with every new model converted to FP8 first (see the module doc)."""
        if self.fp8_engine is None:
            return super().prepare(*args, device_placement=device_placement)
        args = list(args)
        self._take_back_freed(args)
        placements = device_placement or [None] * len(args)
        new_models = [
            i for i, obj in enumerate(args)
            if isinstance(obj, nn.Module) and not is_prepared(obj)
        ]
        for i, obj in enumerate(args):
            if isinstance(obj, nn.Module) and i not in new_models and not self._prepared_here(obj):
                raise ConversionError(
                    f"prepare(): argument {i}: {type(obj).__name__} was already prepared by another Accelerator, "
                    "so this one's FP8 recipe would not apply to it, its FP8 state would not be saved and "
                    "fp8_coverage() would not count it; prepare the plain model with one fp8plug.Accelerator "
                    "only (keep using the one that prepared it, or build the model again)."
                )
        for i in new_models:
            check_convertible(_compiled_inner(args[i]) or args[i], f"prepare(): argument {i}: ")
            check_tensor_parallel(self, _compiled_inner(args[i]) or args[i], self.fp8_engine, self.fp8_plan,
                                  f"prepare(): argument {i}: ")
            check_converted_like(_compiled_inner(args[i]) or args[i], self.fp8_engine, self.fp8_plan,
                                 f"prepare(): argument {i}: ")
        deepspeed = ds.is_deepspeed(self)
        if deepspeed:
            ds.check_models(self, [args[i] for i in new_models])
        optimizers = [obj for obj in args if isinstance(obj, torch.optim.Optimizer)]
        optimizers += [getattr(opt, "optimizer", opt) for opt in prepared_optimizers(self)]
        for i in new_models:
            inner = _compiled_inner(args[i])
            if inner is not None:  # compiled before prepare: convert the model inside, keep the wrapper
                self._convert(inner, optimizers, placements[i])
            else:
                args[i] = self._convert(args[i], optimizers, placements[i])
        for i, obj in enumerate(args):  # opt-in low-precision optimizer states (recipe.optimizer_states)
            if isinstance(obj, torch.optim.Optimizer):
                args[i] = convert_optimizer(obj, self.fp8_plan)
        self._pair_with_optimizers(args, [args[i] for i in new_models])
        # The end of each optimizer step needs nothing here: fp8plug.backends.steps' global optimizer hook
        # finds the converted models an optimizer trains, whenever it was prepared.
        result = super().prepare(*args, device_placement=device_placement)
        for model in self._fp8_models:  # counts made on meta that accelerate's FSDP2 gave memory
            settle_all(model)
        prepared = result if isinstance(result, (tuple, list)) else (result,)  # FSDP2's prepare gives a list
        if deepspeed:  # ZeRO's flat partitions hide the models from that hook (fp8plug.integrations.deepspeed_zero)
            ds.hook_engine_steps(self, prepared)
        compile_losses([prepared[i] for i in new_models], self.state.dynamo_plugin)  # under regional compilation
        return result

    def _prepared_here(self, model: nn.Module) -> bool:
        """Whether this Accelerator prepared `model` (as given back, or the model inside its
        DDP/compile wrappers): a model another Accelerator prepared is refused by prepare()."""
        inner = accelerate.utils.extract_model_from_parallel(model)
        inner = getattr(inner, "_orig_mod", inner)
        return any(m is model or m is inner for m in list(prepared_models(self)) + self._fp8_models)

    def _convert(self, model: nn.Module, optimizers, placement) -> nn.Module:
        """Convert one model (once), keep optimizers on its parameters, wrap its forward."""
        if any(model is m for m in self._fp8_models):
            return model
        if self._should_place(placement) and not _on_meta(model):
            model.to(self.device)  # engines build their modules where the weights already are
        before = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            report = apply_plan(model, plan_model(model, self.fp8_engine, self.fp8_plan))
        after = dict(model.named_parameters(remove_duplicate=False))
        _rebind_optimizers(optimizers, before, after, type(model).__name__)
        install_plain_state_dict(model, self.fp8_engine)
        apply_fp8_autowrap(model, self.fp8_plan, backend=self.fp8_engine)
        self.fp8_reports.append(report)
        self._fp8_models.append(model)
        watch = watch_of(model)
        if watch is not None:  # each check goes to the trackers the user configured, if any
            watch.on_check = self._log_numerics
        return model

    def _should_place(self, placement) -> bool:
        if placement is False or not self.device_placement:
            return False
        fsdp = self.state.fsdp_plugin if self.is_fsdp2 else None
        return not (fsdp is not None and getattr(fsdp, "cpu_ram_efficient_loading", False))

    def _pair_with_optimizers(self, args: list, models: List[nn.Module]) -> None:
        """Give engines that adapt a (model, optimizer) pair (those with `prepare`) their pair
        (MS-AMP: the optimizer in the same prepare() call that holds the model's parameters, or None)."""
        engine = self.fp8_engine
        if not offers(engine, "prepare"):
            return
        for model in models:
            holders = _holders(args, model)
            if len(holders) > 1:
                raise ValueError(
                    f"the {engine.title} engine adapts one optimizer per model, but {len(holders)} "
                    f"optimizers passed to prepare() hold parameters of {type(model).__name__}; "
                    "use one optimizer per model."
                )
            optimizer = args[holders[0]] if holders else None
            new_model, new_optimizer = engine.prepare(model, optimizer, self.fp8_plan)
            _replace(args, model, new_model)
            if optimizer is not None:
                args[holders[0]] = new_optimizer
            if new_model is not model:
                self._fp8_models[self._fp8_models.index(model)] = new_model

    def free_memory(self, *objects):
        """accelerate's free_memory (and `clear`, which calls it), which also forgets the converted
        models: their memory can then be freed, and the next save_state holds the FP8 state of the
        models prepared after it only (as accelerate's `find_executable_batch_size` retries need)."""
        self._forget_fp8_models()
        return super().free_memory(*objects)

    def _forget_fp8_models(self) -> None:
        # held weakly from now on, for _take_back_freed; emptied in place: fp8_checkpoint_state reads this very list
        freed = self.__dict__.setdefault("_fp8_freed", weakref.WeakKeyDictionary())
        freed.update(zip(self._fp8_models, self.fp8_reports))
        self._fp8_models.clear()
        self.fp8_reports.clear()

    def _take_back_freed(self, args) -> None:
        """Models this Accelerator converted before free_memory and given to prepare() again (a
        Trainer's next train(), a retry with the same model): its FP8 models again, as converted."""
        freed = self.__dict__.get("_fp8_freed")
        for obj in args if freed else ():
            inner = accelerate.utils.extract_model_from_parallel(obj) if isinstance(obj, nn.Module) else None
            inner = getattr(inner, "_orig_mod", inner)
            if inner is not None and inner in freed:
                self._fp8_models.append(inner)
                self.fp8_reports.append(freed.pop(inner))

    # training ----------------------------------------------------------------------------------------
    def fp8_coverage(self, reset: bool = False) -> dict:
        """How many GEMMs of the prepared models ran in FP8 and in high precision, in this process:
        {"fp8_gemms": int, "high_precision_gemms": int, "layers": {fqn: (fp8, high_precision)}}
        (fp8plug.coverage.fp8_coverage; with several models, layer names start "model<i>.").
        `reset=True` zeroes the counts after reading them."""
        results = [fp8_coverage(model, reset=reset) for model in self._fp8_models]
        if len(results) == 1:
            return results[0]
        layers = {f"model{i}.{fqn}": counts
                  for i, result in enumerate(results) for fqn, counts in result["layers"].items()}
        return {
            "fp8_gemms": sum(r["fp8_gemms"] for r in results),
            "high_precision_gemms": sum(r["high_precision_gemms"] for r in results),
            "layers": layers,
        }

    def fp8_numerics(self) -> dict:
        """The numerics watch's latest check of the prepared models as one flat dict
        {"fp8/<layer>/<operand>/<stat>": value, "fp8/<layer>/sqnr_db": value, ...}, once per check
        ({} on other steps, or without FP8RecipeKwargs.numerics_watch_interval): ready for
        `accelerator.log`. With trackers configured (init_trackers) each check is logged to them
        already. With several models, layer names start "model<i>."."""
        taken = [numerics_stats(model) for model in self._fp8_models]
        if len(taken) == 1:
            return taken[0]
        return {key.replace("fp8/", f"fp8/model{i}.", 1): value
                for i, stats in enumerate(taken) for key, value in stats.items()}

    def _log_numerics(self, stats: dict, step: int) -> None:
        if self.trackers:
            self.log(stats, step=step)

    @contextlib.contextmanager
    def accumulate(self, *models):
        """accelerate's accumulate; an engine with `microbatch` also learns whether this micro-batch
        is the first of its accumulation window (TransformerEngine then casts weights to FP8 once per
        window)."""
        with super().accumulate(*models):
            if self.fp8_engine is None or not offers(self.fp8_engine, "microbatch"):
                yield
                return
            num_steps = self.gradient_state.num_steps
            # None without accumulation: nothing to cache between micro-batches.
            first = None if num_steps <= 1 else (self.step - 1) % num_steps == 0
            with self.fp8_engine.microbatch(first):
                yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """accelerate's clip_grad_norm_, or the engine's own where torch's cannot read its
        gradients (MS-AMP's ScalingTensor gradients)."""
        engine = self.fp8_engine
        if engine is None or not offers(engine, "clip_grad_norm_"):
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return engine.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    # checkpoints -------------------------------------------------------------------------------------
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """accelerate's unwrap_model. With keep_fp32_wrapper=False accelerate would rebind the forward
        it saved as a method, which fp8plug's FP8 forward wrapper is not; here the bf16/fp32
        wrapper is dropped and the FP8 one kept (the model stays an FP8 model)."""
        if keep_fp32_wrapper or self.fp8_engine is None:
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        unwrapped = super().unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=keep_torch_compile)
        inner = getattr(unwrapped, "_orig_mod", unwrapped)
        if any(inner is m for m in self._fp8_models):
            restore_forward(inner)
            return unwrapped
        return super().unwrap_model(model, keep_fp32_wrapper=False, keep_torch_compile=keep_torch_compile)

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        """accelerate's save_state, plus the FP8 scaling state and its recipe (`fp8_state.pt`); written
        whole or not at all: a kill at any point leaves the old checkpoint or the new one
        (fp8plug.checkpoints.resume). Returns the checkpoint's directory."""
        return resume.save_state(self, super().save_state, output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, *, fp8_state: str = "saved", **load_model_func_kwargs):
        """accelerate's load_state, plus the FP8 scaling state, from a complete checkpoint only (the
        latest complete one with automatic checkpoint naming), checked first: a refused load
        changes nothing. `fp8_state="fresh"` leaves the FP8 scaling state as a new run's (to resume
        under a deliberately changed recipe)."""
        return resume.load_state(self, super().load_state, input_dir, load_kwargs, fp8_state, **load_model_func_kwargs)

    def get_state_dict(self, model, unwrap=True):
        """accelerate's get_state_dict with the plain architecture's keys (no engine entries)."""
        state_dict = super().get_state_dict(model, unwrap=unwrap)
        if self.fp8_engine is None or state_dict is None:
            return state_dict
        return self.fp8_engine.plain_state_dict(state_dict)


def _take_recipe(handlers: list) -> Optional[FP8RecipeKwargs]:
    """Remove fp8plug's FP8RecipeKwargs from `handlers` (in place) and return it."""
    ours = [h for h in handlers if isinstance(h, FP8RecipeKwargs)]
    theirs = [h for h in handlers if isinstance(h, _ACCELERATE_FP8_HANDLERS)]
    if theirs:
        raise ValueError(
            f"fp8plug.Accelerator: kwargs_handlers holds accelerate's own {type(theirs[0]).__name__}; "
            f"use fp8plug.FP8RecipeKwargs instead (backend={listed(BACKENDS)} and the same "
            "recipe fields), which works with every engine."
        )
    if len(ours) > 1:
        raise ValueError("fp8plug.Accelerator: pass at most one FP8RecipeKwargs in kwargs_handlers.")
    for handler in ours:
        handlers.remove(handler)
    return ours[0] if ours else None


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _holders(args: list, model: nn.Module) -> List[int]:
    """Indices of the optimizers in `args` that step any parameter of `model`."""
    params = {id(p) for p in model.parameters()}
    return [
        i for i, obj in enumerate(args)
        if isinstance(obj, torch.optim.Optimizer)
        and any(id(p) in params for group in obj.param_groups for p in group["params"])
    ]


def _replace(args: list, old, new) -> None:
    for i, obj in enumerate(args):
        if obj is old:
            args[i] = new


def _rebind_optimizers(optimizers, before: dict, after: dict, model_name: str) -> None:
    """Point optimizers at the converted parameters where conversion made new Parameter objects,
    and refuse to go on if an optimizer would keep a parameter the model no longer has."""
    mapping = {}
    gone = set()
    for name, old in before.items():
        new = after.get(name)
        if new is None:
            gone.add(id(old))
        elif new is not old:
            mapping[id(old)] = new
    if not mapping and not gone:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            stale = [p for p in group["params"] if id(p) in gone]
            if stale:
                names = [n for n, p in before.items() if any(p is s for s in stale)]
                raise ConversionError(
                    f"FP8 conversion of {model_name} removed parameter(s) {names} that an optimizer "
                    "steps; create the optimizer over parameters the converted model keeps."
                )
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        for p_id, new in mapping.items():
            for old in [p for p in list(optimizer.state) if id(p) == p_id]:
                optimizer.state[new] = optimizer.state.pop(old)


__all__ = ["Accelerator", "FP8EngineName", "requested_precision"]


def _compiled_inner(model: nn.Module) -> Optional[nn.Module]:
    """The model inside torch.compile's wrapper (a model compiled before prepare), or None. The
    wrapper traces lazily, at its first call, so converting the model inside it in place is
    converting before compiling; a wrapper that already ran recompiles once for the new modules."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return None
