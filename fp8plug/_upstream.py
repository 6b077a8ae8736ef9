"""Every place fp8plug relies on accelerate's or transformers' private names, in one module.

A private name can change in any release without notice. Kept here, each reach says what it relies
on and which versions it was checked against, so an upgrade means reading one file (`grep
_upstream` finds every caller); nothing else in fp8plug may touch such a name. Checked against
accelerate 1.8.0 (the oldest setup.cfg allows, run by .ci/run) and 1.15.0, transformers 5.10.1 (the
oldest, run by .ci/run), 5.17.0 and 5.23.0. transformers is imported only inside the functions
that need it, so `import fp8plug` stays free of it.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import accelerate
import torch

# --- accelerate: what `Accelerator.fp8_backend` is compared with ----------------------------------
# accelerate's FP8 branches (_prepare_te, _prepare_ao, _prepare_msamp, TE autowrap) run when
# `self.fp8_backend == FP8BackendType.<X>` (1.15.0) or `== "<X>"` (1.8.0); FP8BackendType, a str
# enum whose values are those upper-case names, lives in accelerate.utils.dataclasses and is not
# exported from accelerate.utils. Checked: 1.8.0, 1.15.0 (members NO, TE, AO, MSAMP).
try:
    from accelerate.utils.dataclasses import FP8BackendType

    NO_FP8, AO_FP8 = FP8BackendType.NO, FP8BackendType.AO
except (ImportError, AttributeError):  # pragma: no cover - accelerate before the enum
    NO_FP8, AO_FP8 = None, "AO"


class FP8EngineName(str):
    """`Accelerator.fp8_backend` while fp8plug runs FP8: the engine's name ("native", "ao", "te",
    "msamp"). Lower-case, so it equals no FP8BackendType member ("NO", "TE", "AO", "MSAMP") and
    accelerate's own FP8 branches stay off; `.value` gives the name, as an enum member would."""

    @property
    def value(self) -> str:
        """The engine's name, as a plain str."""
        return str(self)

    def __repr__(self) -> str:
        return f"FP8EngineName({str(self)!r})"


class AcceleratorInternals:
    """What fp8plug.Accelerator overrides of accelerate.Accelerator's private workings; put
    before accelerate.Accelerator among its bases. The subclass provides `fp8_engine` and
    `fp8_weights_may_lack_storage()`."""

    # Relies on: accelerate.Accelerator._get_named_parameters(*models, drop_refs=...) calling
    # `self.fp8_backend` and, only when that equals FP8BackendType.AO, unwrapping torchao's float8
    # weight tensors (whose data_ptr() is 0) before mapping parameters by data pointer under
    # FSDP2. So `fp8_backend` says AO for exactly that call (`_fp8_as_ao`), where an engine's
    # weights may lack storage. Checked: 1.8.0, 1.15.0.
    _fp8_as_ao = False

    @property
    def fp8_backend(self):
        """The FP8 engine in use, by name ("native", "ao", "te", "msamp"), or FP8BackendType.NO
        without FP8. The name is an FP8EngineName: a str equal to no FP8BackendType member, so
        every `self.fp8_backend == FP8BackendType.X` branch of accelerate's stays off: fp8plug
        does that work. The engine object is `fp8_engine`."""
        if getattr(self, "_fp8_as_ao", False):
            return AO_FP8
        engine = getattr(self, "fp8_engine", None)
        return NO_FP8 if engine is None else FP8EngineName(engine.name)

    def _get_named_parameters(self, *args, drop_refs=False):
        self._fp8_as_ao = drop_refs and self.fp8_weights_may_lack_storage()
        try:
            return super()._get_named_parameters(*args, drop_refs=drop_refs)
        finally:
            self._fp8_as_ao = False

    # Relies on: accelerate.Accelerator._prepare_fsdp2(*args) receiving the optimizers among
    # `args` and finding each optimizer parameter's sharded replacement by data_ptr(). A tensor
    # subclass wrapping the weight (torchao's float8 all-gather weight) reports 0 there, so the
    # optimizer is handed the wrapped tensor, which shares the weight's storage. Checked: 1.8.0
    # (where _prepare_fsdp2 first appears), 1.15.0.
    def _prepare_fsdp2(self, *args):
        if self.fp8_engine is not None:
            for obj in args:
                if isinstance(obj, torch.optim.Optimizer):
                    for group in obj.param_groups:
                        group["params"] = [storage_view(p) for p in group["params"]]
        return super()._prepare_fsdp2(*args)


def storage_view(param: torch.Tensor) -> torch.Tensor:
    """`param`, or the plain tensor inside it when it is a wrapper subclass without storage of its
    own (data_ptr() == 0) that keeps the real one as `_tensor`, as torchao's float8 weights do."""
    inner = getattr(param, "_tensor", None)
    if isinstance(inner, torch.Tensor):
        try:
            if param.data_ptr() == 0:
                return inner
        except RuntimeError:
            return inner
    return param


# --- accelerate: process-wide state ----------------------------------------------------------------
# Relies on: AcceleratorState and PartialState being borg singletons whose attributes live in the
# class-level dict `_shared_state`, with the mixed precision under "_mixed_precision" and an
# "initialized" flag; reading it never builds the state (building PartialState would start
# distributed). Checked: 1.8.0, 1.15.0.
def shared_precision() -> Optional[str]:
    """The mixed precision accelerate's process-wide state was fixed at, if any Accelerator was
    built before this one."""
    state = accelerate.state.AcceleratorState._shared_state
    if not state.get("initialized", False) and "_mixed_precision" not in state:
        return None
    return str(state.get("_mixed_precision", "")).lower() or None


def process_state_exists() -> bool:
    """Whether accelerate's PartialState was set up in this process (without setting it up)."""
    return bool(accelerate.state.PartialState._shared_state)


# --- accelerate: what an Accelerator holds ----------------------------------------------------------
# Relies on: Accelerator keeping the objects prepare() handled in the lists `_models` and
# `_optimizers`, and those register_for_checkpointing() took in `_custom_objects`, in order,
# which save_state/load_state walk (its model_i / optimizer_i / custom_checkpoint_i files).
# Checked: 1.8.0, 1.15.0.
def prepared_models(accelerator) -> List:
    """The models `accelerator.prepare` handled, in order (save_state's model_<i> files)."""
    return accelerator._models


def prepared_optimizers(accelerator) -> List:
    """The optimizers `accelerator.prepare` handled, in order (save_state's optimizer_<i> files)."""
    return accelerator._optimizers


def registered_objects(accelerator) -> List:
    """The objects given to `accelerator.register_for_checkpointing`, in order."""
    return accelerator._custom_objects


# Relies on: prepare() marking a model it handled with `model._is_accelerate_prepared = True`
# and, where it wraps the forward in autocast, keeping the forward it replaced as
# `model._original_forward` (an instance attribute). Checked: 1.8.0, 1.15.0.
def is_prepared(model) -> bool:
    """Whether some Accelerator's prepare() has handled `model`."""
    return bool(getattr(model, "_is_accelerate_prepared", False))


def restore_forward(model) -> None:
    """Put back the forward that prepare() wrapped in autocast, if it wrapped one."""
    original = model.__dict__.pop("_original_forward", None)
    if original is not None:
        model.forward = original


def forget_prepared(accelerator, model) -> None:
    """Take `model` back to unprepared: its forward unwrapped, its prepared mark off, out of
    `accelerator`'s model list."""
    restore_forward(model)
    model.__dict__.pop("_is_accelerate_prepared", None)
    accelerator._models[:] = [m for m in accelerator._models if m is not model]


@contextlib.contextmanager
def launcher_fp8_check(decide):
    """Within the block, accelerate's launcher asks `decide(original)` whether FP8 is available,
    `original` being its own check; the name is put back whatever happens.

    Relies on: accelerate.utils.launch's command builders (prepare_simple_launcher_cmd_env,
    prepare_multi_gpu_env) calling the module-level name `is_fp8_available()` it imported, when
    mixed precision is fp8. An accelerate without that name has nothing to widen. Checked: 1.8.0,
    1.15.0."""
    import accelerate.utils.launch as launch_utils

    original = getattr(launch_utils, "is_fp8_available", None)
    if original is None:
        yield
        return
    launch_utils.is_fp8_available = lambda: decide(original)
    try:
        yield
    finally:
        launch_utils.is_fp8_available = original


# --- transformers: how Trainer builds and checkpoints ------------------------------------------------
@contextlib.contextmanager
def trainer_builds_accelerator_with(factory):
    """Within the block, transformers.trainer's `Accelerator` name is `factory`.

    Relies on: Trainer.create_accelerator_and_postprocess calling `Accelerator(**args)` on the
    name transformers.trainer imported at module level, and doing a good deal of setup around
    that call (gradient accumulation, dataloader and FSDP settings, DeepSpeed, checks) that should
    stay Trainer's own; this swaps only the one call and puts the name back whatever happens.
    Checked: 5.10.1, 5.17.0, 5.23.0."""
    import transformers
    import transformers.trainer as trainer_module

    if not hasattr(trainer_module, "Accelerator"):
        raise RuntimeError(
            f"transformers {transformers.__version__}: transformers.trainer has no `Accelerator` to swap "
            "for fp8plug's; this transformers version is not supported by fp8plug.integrations.trainer."
        )
    original = trainer_module.Accelerator
    trainer_module.Accelerator = factory
    try:
        yield
    finally:
        trainer_module.Accelerator = original


class TrainerInternals:
    """What fp8plug's Trainer mixin overrides of transformers.Trainer's private methods; put
    before the Trainer class among the bases. The subclass provides `fp8_before_training_wrap()`,
    `fp8_save_checkpoint(output_dir)` and `fp8_load_checkpoint(checkpoint, load_rest)`.

    Relies on (checked: 5.10.1, 5.17.0, 5.23.0):
    - `_wrap_model(model, training=True, dataloader=None)`: called by the training loop with
      training=True before it prepares the model, and by evaluation with training=False;
    - `_save_optimizer_and_scheduler(output_dir)`: writes a checkpoint's optimizer and scheduler
      files into its folder, on every process that saves;
    - `_load_optimizer_and_scheduler(checkpoint)`: called on resume after `prepare`, with the
      checkpoint folder or None.
    """

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if training:
            self.fp8_before_training_wrap()
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        self.fp8_save_checkpoint(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        load_rest = super()._load_optimizer_and_scheduler
        self.fp8_load_checkpoint(checkpoint, lambda: load_rest(checkpoint))


__all__ = [
    "AO_FP8", "AcceleratorInternals", "FP8EngineName", "NO_FP8", "TrainerInternals", "forget_prepared",
    "is_prepared", "launcher_fp8_check", "prepared_models", "prepared_optimizers", "process_state_exists",
    "registered_objects",
    "restore_forward", "shared_precision", "storage_view", "trainer_builds_accelerator_with",
]


# --- transformers: attention implementation names and packed-sequence detection -------------------
# Relies on: `PretrainedConfig._attn_implementation`, the name model code looks up in
# ALL_ATTENTION_FUNCTIONS and ALL_MASK_ATTENTION_FUNCTIONS (set through the public
# `set_attn_implementation`); and `transformers.masking_utils.find_packed_sequence_indices(
# position_ids)`, which create_causal_mask's argument preparation looks up as a module global
# and calls where position ids come without an attention mask or a cache, and which returns a
# tensor ("maybe packed") whenever it is traced, since it cannot read the positions then.
# Checked: 5.10.1, 5.17.0, 5.23.0.
def attention_implementation(config) -> Optional[str]:
    """The attention implementation `config` names ("sdpa", "eager", ...), or None."""
    return getattr(config, "_attn_implementation", None)


def report_unpacked_while(predicate) -> None:
    """Make transformers' packed-sequence detection answer "not packed" whenever `predicate()` is
    true, and ask transformers otherwise (installed once per process)."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    if getattr(original, "fp8plug_predicate", None) is not None:
        return

    def find_packed_sequence_indices(position_ids):
        return None if predicate() else original(position_ids)

    find_packed_sequence_indices.fp8plug_predicate = predicate
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


# --- transformers: which Linears its FP8 loader keeps in high precision ----------------------------
# Relies on: `PreTrainedModel._keep_in_fp32_modules` (and `_keep_in_fp32_modules_strict`), name
# patterns that every quantizer, the FP8 one included, adds to the modules it does not convert
# (HfQuantizer.get_modules_to_not_convert), matched as `transformers.quantizers.quantizers_utils.
# should_convert_module` matches them. Checked: 5.23.0, 5.24.0.
def keep_in_fp32_patterns(model) -> List[str]:
    """The module name patterns transformers keeps in float32 for `model`'s class."""
    patterns: List[str] = []
    for name in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        patterns += list(getattr(model, name, None) or ())
    return patterns


def matches_module_patterns(name: str, patterns: List[str]) -> bool:
    """Whether transformers' quantizers would leave module `name` alone for `patterns`."""
    if not patterns:
        return False
    try:
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:  # pragma: no cover - a transformers without it: suffix match, its rule 3
        return any(name == p or name.endswith("." + p) for p in patterns)
    return not should_convert_module(name, patterns)


# --- accelerate: the forward prepare() wrapped ------------------------------------------------------
# Relies on: what restore_forward relies on (`model._original_forward`, set by prepare() where it
# wraps the forward in autocast). For a model compiled before prepare(), accelerate 1.15.0 leaves
# there the compiled module's call (Module._wrapped_call_impl), not a forward, so fp8plug.checkpoints.export
# only drops it and unwinds the wrappers itself. Checked: 1.8.0, 1.15.0.
def drop_original_forward(model) -> bool:
    """Forget the forward prepare() kept; whether there was one (the forward is accelerate's wrapper)."""
    return model.__dict__.pop("_original_forward", None) is not None


# --- transformers: the experts-implementation registry (mixture-of-experts blocks) ----------------
# Relies on: `@use_experts_implementation` (transformers.integrations.moe) wrapping an experts
# class's forward with functools.wraps (so `forward.__wrapped__` is the class's own eager forward)
# and dispatching every call on `self.config._experts_implementation` through
# `ALL_EXPERTS_FUNCTIONS` (an `ExpertsInterface`, registered to with its `register(name, fn)`);
# the public `PreTrainedModel.set_experts_implementation(name)`, which accepts any registered name;
# the experts' `_apply_gate` and `_is_expert_parallel`.
# Checked: 5.24 (read); 5.17 must hold the same names (the GPU tests run there): where
# set_experts_implementation is missing, the config attribute is set directly.
def experts_implementation(config) -> Optional[str]:
    """The experts implementation `config` names ("grouped_mm", "eager", ...), or None."""
    return getattr(config, "_experts_implementation", None)


def set_experts_implementation(model, name: str) -> None:
    """Put transformers model `model` (and its sub-models) on experts implementation `name`."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter(name)
    else:  # pragma: no cover - a transformers without the public setter
        model.config._experts_implementation = name


def register_experts_function(name: str, function) -> None:
    """Register `function` under `name` with transformers' experts registry (once)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if name not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(name, function)


def experts_function(module, name: Optional[str]):
    """The forward transformers would run for experts `module` under implementation `name`: the
    class's own (eager) forward for "eager" or None, else the registered function."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    eager = original_experts_forward(module)
    if name in (None, "eager") or name not in ALL_EXPERTS_FUNCTIONS:
        return eager
    return ALL_EXPERTS_FUNCTIONS[name]


def is_expert_parallel(module) -> bool:
    """Whether transformers runs experts `module` under expert parallelism (`_is_expert_parallel`,
    set by its tensor-parallel plan; then routed ids past the local experts are sentinels)."""
    return bool(getattr(module, "_is_expert_parallel", False))


def apply_gate(module, gate_up):
    """The experts class's own gate over a gate/up projection (`_apply_gate`, which GPT-OSS
    overrides for its interleaved layout and clamped activation), else transformers' default:
    concatenated halves, act(gate) * up."""
    own = getattr(module, "_apply_gate", None)
    if own is not None:
        return own(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def original_experts_forward(module):
    """The experts class's own forward beneath `@use_experts_implementation`, or None for a module
    not decorated with it."""
    return getattr(type(module).forward, "__wrapped__", None)


# --- transformers: the names save_pretrained writes ------------------------------------------------
# transformers 5 renames, merges and splits weights between a model's parameters and its checkpoint
# through per-model conversion mappings (Mixtral's experts: `experts.{e}.w1/w2/w3` on disk, 3-D
# `gate_up_proj`/`down_proj` in the model); `save_pretrained` runs
# `transformers.core_model_loading.revert_weight_conversion(model, state_dict)` to go back. Checked:
# 5.17.0 (exists; Mixtral's w2 comes back in a layout fp8plug's export does not read, so experts stay
# high precision there) and 5.24.0; absent in releases without conversion mappings, where the
# model's own names are the checkpoint's.
def checkpoint_state_names(model, state: dict) -> dict:
    """`state` (model names -> tensors) under the names save_pretrained writes."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict(state)
    return dict(revert_weight_conversion(model, dict(state)))

