"""The settings of a scaling family, declared once each.

As TransformerEngine gives each scaling recipe its own dataclass, the settings that only one
family of scaling reads live here in one frozen dataclass per family, each with its default, its
check, its environment variables and whether saved FP8 state depends on it. FP8RecipeKwargs, the
plans, the engines, the checkpoint record and docs/recipe.md read them from here. Only delayed
scaling has settings of its own; the other families read only fields that every family shares
(`fp8_format`, `override_linear_precision`), which stay on FP8RecipeKwargs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, Optional, Tuple

from fp8plug.recipe.checks import Integer, OneOf, parse_bool

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def setting(default, check, env: Tuple[str, Optional[str]], *, in_state: bool = True):
    """A family's setting: its default; `check(value, label)`, giving the canonical value or a
    ValueError; `env`, the variable `accelerate launch` exports and the one named after
    `accelerate config`'s key (fp8plug.recipe.environment); `in_state`, whether the FP8 scaling
    state a checkpoint saves depends on it (fp8plug.checkpoints.state refuses to resume it changed)."""
    return field(default=default, metadata={"check": check, "env": env, "in_state": in_state})


@dataclass(frozen=True, kw_only=True)
class DelayedScaling:
    """TransformerEngine's delayed scaling (native and te, scaling="delayed"): each tensor keeps a
    history of its amaxes, and its scale is worked out from that history at the end of a step.

    Args:
        margin: scale = fp8_max / amax / 2**margin.
        amax_history_len: how many past amaxes each tensor keeps.
        amax_compute_algo: the amax a scale is worked out from: "max" over the history, or
            "most_recent".
        interval: the scale is recomputed every `interval` optimizer steps.
        reduce_amax: each step's amaxes are reduced (max) across all ranks, so every rank casts
            with one scale, as TransformerEngine does; False keeps one scale per rank.

    Checked on construction, as FP8RecipeKwargs checks the same fields.
    """

    applies_to: ClassVar[str] = "delayed scaling (scaling='delayed')"  # the "ignored" warning's reason

    # E4M3's largest value is 448 = 2**8.8: a larger margin pushes the small values below its
    # smallest subnormal (2**-9) and zeroes them.
    margin: int = setting(0, Integer(0, 8, "a larger margin maps the largest value below 1.0 in E4M3 and flushes "
                                     "small values to zero"), ("ACCELERATE_FP8_MARGIN", None))
    # 8192 entries x 3 tensors of float32 per Linear, read at every end-of-step update
    amax_history_len: int = setting(1024, Integer(1, 8192, "a longer history costs memory and time at every step "
                                                  "and reacts no better"),
                                    ("ACCELERATE_FP8_AMAX_HISTORY_LEN", "ACCELERATE_FP8_AMAX_HISTORY_LENGTH"))
    amax_compute_algo: str = setting("most_recent", OneOf(AMAX_COMPUTE_ALGOS, str.lower),
                                     ("ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "ACCELERATE_FP8_AMAX_COMPUTE_ALGORITHM"))
    interval: int = setting(1, Integer(1, 10_000, "a scale recomputed less often cannot follow the tensors it scales"),
                            ("ACCELERATE_FP8_INTERVAL", None))
    reduce_amax: bool = setting(True, parse_bool, ("FP8PLUG_REDUCE_AMAX", "ACCELERATE_FP8_REDUCE_AMAX"),
                                in_state=False)

    def __post_init__(self):
        for f in fields(DelayedScaling):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f"DelayedScaling.{f.name}"))


# What the rest of fp8plug reads, by field name.
DELAYED_FIELDS: Tuple[str, ...] = tuple(f.name for f in fields(DelayedScaling))
DELAYED_CHECKS = {f.name: f.metadata["check"] for f in fields(DelayedScaling)}
DELAYED_ENV_NAMES = {f.name: f.metadata["env"] for f in fields(DelayedScaling)}
DELAYED_STATE_FIELDS: Tuple[str, ...] = tuple(f.name for f in fields(DelayedScaling) if f.metadata["in_state"])


def delayed_values(source) -> Dict[str, Any]:
    """The delayed-scaling settings of anything that carries them as attributes (a DelayedScaling,
    a recipe, a plan, a layer), by name."""
    return {name: getattr(source, name) for name in DELAYED_FIELDS}


DELAYED_DEFAULTS = delayed_values(DelayedScaling())
