"""The engines fp8plug knows, one row each: the name and its other spellings, where the engine's
code lives, and what was measured of it (its training speed, which ranks the automatic choice;
its roofline costs, which the automatic layer filter predicts with).

Adding an engine is its code under fp8plug/backends/ and one row here. The rows are data and
import nothing of fp8plug's, so the recipe (which checks backend names) and the speed filter,
both below the engines, read them; the registry (fp8plug.backends) imports an engine from its
row when it is first asked for. The rows' order is the automatic choice's order wherever
measured speed does not decide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Speed:
    """A training speed-up measured for an engine over bf16 under torch.compile (MEASURED_ON), and
    the `scaling` it was measured with, which the automatic choice then uses where the user set
    none (None: the engine's default)."""

    speedup: float
    scaling: Optional[str] = None


@dataclass(frozen=True)
class Costs:
    """The achieved (not datasheet) speed of one kernel family on one device.

    peak_tflops: dense GEMM throughput reached on large shapes.
    bandwidth_gbs: memory bandwidth reached by memory-bound GEMMs and the FP8 casts.
    overhead_us: fixed cost of one Linear forward+backward (launches, autograd, scale bookkeeping).
    note: where the numbers come from ("calibrated on ...").
    """

    peak_tflops: float
    bandwidth_gbs: float
    overhead_us: float
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Costs":
        return cls(float(data["peak_tflops"]), float(data["bandwidth_gbs"]), float(data["overhead_us"]),
                   str(data.get("note", "")))


@dataclass(frozen=True)
class EngineRow:
    """One engine.

    name: its canonical name (FP8RecipeKwargs.backend, get_backend); its Engine's `name`.
    engine: "module:Class" of its Engine subclass, imported on first use.
    aliases: the other spellings FP8RecipeKwargs.backend accepts (any case).
    measured: its training speed by how the model runs ("compiled", "eager"; MEASURED_ON); on an
        FP8 GPU the automatic choice ranks by it, an engine without a figure after those with one.
    costs: its roofline constants (fp8plug.tuning.roofline) by CUDA compute capability, measured
        with `costs_scaling`, the engine's default scaling; without them no automatic layer filter.
    costs_also: other scalings the same constants predict (the same bytes moved per cast), so that
        the filter stays on where the automatic choice runs the engine with one of them (`measured`'s
        scaling).
    scaling_costs: constants of scalings that run other kernels and move other bytes (the finer
        scalings: per-row and per-tile casts, rowwise and blockwise GEMMs), by scaling, then compute
        capability; the filter predicts a Linear under such a scaling with its own constants.
    """

    name: str
    engine: str
    aliases: Tuple[str, ...] = ()
    measured: Mapping[str, Speed] = field(default_factory=dict)
    costs: Mapping[Tuple[int, int], Costs] = field(default_factory=dict)
    costs_scaling: Optional[str] = None
    costs_also: Tuple[str, ...] = ()
    scaling_costs: Mapping[str, Mapping[Tuple[int, int], Costs]] = field(default_factory=dict)


# where the Speed figures come from, for `fp8plug env` and the selection's explanation; "compiled"
# is the whole model under one torch.compile (Accelerate's dynamo_backend or torch.compile after
# prepare), which regional compilation (one graph per decoder layer) matches within a few percent
MEASURED_ON = ("H100, transformers LlamaForCausalLM 4x4096, compiled = whole-model torch.compile, "
               "benchmarks/training/hf_llama.py (docs/performance.md)")
# where the Costs come from: fitted by fp8plug.tuning.roofline_fit.calibrate to
# docs/results/h200/bench_sweep_queued.json (bf16, native and ao compiled) and
# bench_sweep_queued_te_eager.json (te; TE runs outside torch.compile). Used for every compute
# capability 9.0 GPU: H100 and H200 share the tensor cores. Not checked on an H100 (none was free);
# its lower memory bandwidth slows bf16's memory-bound work and FP8's casts alike, and the
# filter's 15% margin (roofline.AUTO_MIN_SPEEDUP) absorbs the rest.
H200_CALIBRATION = ("calibrated on one H200 (torch 2.11, TE 2.20.2, torchao 0.18), fp8plug bench --shapes sweep, "
                    "queued timing, 20 shapes; rms relative error {err}; docs/results/h200/bench_sweep_queued*.json")
GRANULAR_CALIBRATION = ("calibrated on one H200 (torch 2.11, Triton 3.6), fp8plug bench --modes compiled, queued "
                        "timing, 7 shapes from 2048x1024x1024 to 16384x8192x8192; rms relative error {err}; "
                        "docs/results/h200x4/2026-11-28/bench_granular.json")
SM90 = (9, 0)  # the compute capability of H100 and H200

ENGINES: Dict[str, EngineRow] = {row.name: row for row in (
    EngineRow(
        "msamp", "fp8plug.backends.msamp.engine:MSAMPEngine", aliases=("ms-amp", "ms_amp"),
    ),
    EngineRow(
        "te", "fp8plug.backends.te.engine:TEEngine",
        aliases=("transformer_engine", "transformer-engine", "transformerengine"),
        # against bf16 compiled on the benchmark Llama, H100: eager 1.07x (1.27x bf16 eager)
        measured={"compiled": Speed(1.17), "eager": Speed(1.07)},
        costs={SM90: Costs(peak_tflops=1493.0, bandwidth_gbs=4280.0, overhead_us=43.4,
                           note=H200_CALIBRATION.format(err="5.2%"))},
        costs_scaling="delayed",
    ),
    EngineRow(
        "ao", "fp8plug.backends.ao.engine:AOEngine", aliases=("torchao",),
        measured={"compiled": Speed(1.29), "eager": Speed(0.44)},
        costs={SM90: Costs(peak_tflops=1453.0, bandwidth_gbs=2483.0, overhead_us=37.7,
                           note=H200_CALIBRATION.format(err="3.7%"))},
        costs_scaling="tensorwise",
    ),
    EngineRow(
        "native", "fp8plug.backends.native.engine:NativeEngine",
        # The Hugging Face Llama of benchmarks/training/hf_llama.py on an H100, against bf16 compiled:
        # compiled 1.45x, dynamic tying delayed and reaching its first step sooner; eager 1.22x
        # (1.45x bf16 eager, which runs at 0.84x bf16 compiled; TE 1.27x beside it), dynamic, whose
        # casts of a shared input are made once and take the fused norms' amax, which delayed
        # scaling's per-layer scales cannot
        measured={"compiled": Speed(1.45, "dynamic"), "eager": Speed(1.22, "dynamic")},
        costs={SM90: Costs(peak_tflops=1400.0, bandwidth_gbs=3150.0, overhead_us=62.3,
                           note=H200_CALIBRATION.format(err="4.5%"))},
        costs_scaling="delayed",
        # per-tensor dynamic casts move the bytes the model counts (an amax read, the cast read, the
        # FP8 writes) and tied delayed end to end; without this the automatic choice (dynamic) would
        # run with no filter at all on sm_90 (Qwen3-MoE's experts, predicted 0.70x, run FP8 at 0.66x
        # bf16)
        costs_also=("dynamic",),
        # the finer scalings' own constants (their per-row and per-tile casts, rowwise and blockwise
        # GEMMs), fitted with the same bf16 to one Linear's compiled forward + backward at 7 shapes
        scaling_costs={
            "rowwise": {SM90: Costs(peak_tflops=1583.9, bandwidth_gbs=1643.4, overhead_us=141.3,
                                    note=GRANULAR_CALIBRATION.format(err="5.7%"))},
            "blockwise": {SM90: Costs(peak_tflops=1380.3, bandwidth_gbs=1275.6, overhead_us=92.3,
                                      note=GRANULAR_CALIBRATION.format(err="5.9%"))},
        },
    ),
)}

# The canonical names in the automatic order, and every spelling (lower case) of each.
BACKENDS = tuple(ENGINES)
BACKEND_ALIASES = {spelling: row.name for row in ENGINES.values() for spelling in (row.name, *row.aliases)}


def listed(names) -> str:
    """Names for a message: "'te', 'ao' or 'native'"."""
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
