"""Per-layer scaling: which converted Linear runs with which scaling, or stays in bf16.

Why: the first and last layers of a transformer see the least regular tensors (embeddings'
outputs, the logits' inputs), and Megatron keeps them in bf16 (`first_last_layers_bf16`); a layer
whose activations grew outliers may want a finer scaling than the rest. The recipe's
`layer_scaling` maps fnmatch patterns of module names to a scaling word or "bf16"; the first
pattern that matches a module decides it, and a module no pattern matches takes the recipe's
`scaling`. Patterns are checked when the recipe is built (`check_layer_scaling`); an engine
that runs them says so when a model's conversion is planned (its `eligible`: each layer's word
with `word_for`, the bf16 ones kept out with `bf16_filter`).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Optional, Sequence, Tuple

HIGH_PRECISION = "bf16"
# the words a pattern may name; which of them an engine runs is the engine's check
LAYER_WORDS = (HIGH_PRECISION, "delayed", "dynamic", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")
KEPT_KIND = "kept in high precision by layer_scaling"

Rules = Tuple[Tuple[str, str], ...]


def check_layer_scaling(value, label: str = "FP8RecipeKwargs.layer_scaling") -> Optional[Rules]:
    """`value` (a mapping, or pairs, of fnmatch pattern -> word) as a tuple of (pattern, word)
    pairs in the given order, words lower-cased; a ValueError naming `label` and the pattern
    otherwise."""
    if value is None:
        return None
    pairs = list(value.items()) if hasattr(value, "items") else value
    try:
        pairs = [(pattern, word) for pattern, word in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"{label}: give a dict of module-name pattern -> scaling, e.g. "
                         "{'model.layers.0.*': 'bf16', '*.down_proj': 'blockwise'}, not "
                         f"{value!r}.") from None
    rules = []
    for pattern, word in pairs:
        if not isinstance(pattern, str) or not isinstance(word, str):
            raise ValueError(f"{label}: pattern {pattern!r} -> {word!r}: both must be strings.")
        word = word.strip().lower()
        if word in ("bfloat16", "high", "none", "hp"):
            word = HIGH_PRECISION
        if word not in LAYER_WORDS:
            raise ValueError(f"{label}: pattern {pattern!r} names {word!r}; use one of {', '.join(LAYER_WORDS)}.")
        rules.append((pattern, word))
    return tuple(rules)


def rule_for(rules: Optional[Rules], fqn: str) -> Optional[Tuple[str, str]]:
    """The first (pattern, word) of `rules` whose pattern matches module name `fqn`, else None."""
    for pattern, word in rules or ():
        if fnmatch.fnmatchcase(fqn, pattern):
            return pattern, word
    return None


def word_for(rules: Optional[Rules], fqn: str) -> Optional[str]:
    """The scaling `rules` give module `fqn` (None: the recipe's)."""
    rule = rule_for(rules, fqn)
    return rule[1] if rule else None


def layer_note(word: str) -> str:
    """The report's note on a module whose scaling layer_scaling chose ("rowwise (layer_scaling)")."""
    return f"{word} (layer_scaling)"


def bf16_filter(rules: Optional[Rules], module_filter_fn: Optional[Callable]) -> Optional[Callable]:
    """`module_filter_fn` with the modules `rules` keep in bf16 refused too, each refusal worded
    (skip_reason, skip_kind, skip_note, as fp8plug.layers.rules.decide_modules reads them)."""
    if not any(word == HIGH_PRECISION for _, word in rules or ()):
        return module_filter_fn

    def keep(module, fqn: str) -> bool:
        if word_for(rules, fqn) == HIGH_PRECISION:
            return False
        return module_filter_fn is None or module_filter_fn(module, fqn)

    def reason(fqn: str) -> str:
        rule = rule_for(rules, fqn)
        if rule and rule[1] == HIGH_PRECISION:
            return f"layer_scaling: {rule[0]!r} -> bf16"
        inner = getattr(module_filter_fn, "skip_reason", None)
        return inner(fqn) if inner else "module_filter_fn returned False"

    def kind(fqn: str):
        if word_for(rules, fqn) == HIGH_PRECISION:
            return KEPT_KIND
        inner = getattr(module_filter_fn, "skip_kind", None)
        return inner(fqn) if inner else None

    def note(fqn: str) -> str:
        if word_for(rules, fqn) == HIGH_PRECISION:
            return layer_note(HIGH_PRECISION)
        inner = getattr(module_filter_fn, "skip_note", None)
        return inner(fqn) if inner else ""

    keep.skip_reason, keep.skip_kind, keep.skip_note = reason, kind, note
    return keep


def first_last_bf16(names: Sequence[str]) -> Rules:
    """Rules keeping in bf16 the first and last blocks of the longest numbered run of modules
    (`model.layers.0` ... `model.layers.31` in a transformers model: Megatron's
    first_last_layers_bf16), given every module name of a model."""
    runs = {}
    for name in names:
        parent, _, index = name.rpartition(".")
        if index.isdigit():
            runs.setdefault(parent, set()).add(int(index))
    if not runs:
        return ()
    parent = max(runs, key=lambda p: len(runs[p]))
    prefix = f"{parent}." if parent else ""
    ends = sorted({min(runs[parent]), max(runs[parent])})
    return tuple((f"{prefix}{i}.*", HIGH_PRECISION) for i in ends)
