"""A Liger-patched transformers Llama trains in FP8 on the GPU.

`apply_liger_kernel_to_llama` (RoPE, RMSNorm, SwiGLU and the fused linear cross-entropy, its
defaults) on a small Llama; trained STEPS steps with labels under fp8plug.Accelerator's default
engine and under accelerate's bf16, same weights and data. Checked: Liger's fused loss is what
ran (lm_head's forward never runs in training, in either run); the conversion report names lm_head
as left in high precision with Liger's reason and every other Linear (LigerSwiGLUMLP's three
included) as FP8; the GEMM counters show each of those ran in FP8 on every step and none in high
precision; the FP8 loss (mean of the last 10 steps) is within LOSS_TOLERANCE of bf16's.

Skipped without liger-kernel (imported only inside the test). Run, with its wheel carried:
    python3 -m pip install --no-deps liger_kernel-*.whl   # or PYTHONPATH=<dir holding liger_kernel>
    python3 -m pytest tests/gpu/test_liger.py -q -s
"""

import pytest

from tests.support.record import record

SPEC = dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512, seq=256, batch=8)
STEPS = 150
LOSS_TOLERANCE = 0.02  # relative, FP8 vs bf16 after STEPS steps; the task's loss floor is about 1 nat


def test_liger_llama_trains_in_fp8_with_lm_head_reported(monkeypatch):
    pytest.importorskip("liger_kernel.transformers")
    from fp8plug.layers.rules import LIGER
    from tests.support.liger import tail_mean, train_with_liger

    bf16 = train_with_liger(monkeypatch, SPEC, STEPS, fp8=False, device="cuda")
    fp8 = train_with_liger(monkeypatch, SPEC, STEPS, fp8=True, device="cuda")
    report, coverage = fp8["report"], fp8["coverage"]
    others = sorted(n for n in fp8["linears"] if n != "lm_head")
    summary = dict(engine=report.backend, steps=STEPS, spec=SPEC, bf16_loss=tail_mean(bf16["losses"]),
                   fp8_loss=tail_mean(fp8["losses"]), fp8_gemms=coverage["fp8_gemms"],
                   high_precision_gemms=coverage["high_precision_gemms"], summary=report.summary())
    summary["loss_vs_bf16"] = summary["fp8_loss"] / summary["bf16_loss"] - 1
    record("liger_fp8", summary)

    assert bf16["lm_head_training_calls"] == 0 and fp8["lm_head_training_calls"] == 0  # Liger's fused loss ran
    assert report.kinds["lm_head"] == LIGER and "Liger's fused linear cross-entropy" in report.skipped["lm_head"]
    assert sorted(report.fp8_linears) == others and list(report.high_precision_linears) == ["lm_head"]
    assert len(others) == 7 * SPEC["layers"]
    assert sorted(coverage["layers"]) == others
    assert all(counts == (STEPS, 0) for counts in coverage["layers"].values()), coverage["layers"]
    assert coverage["high_precision_gemms"] == 0

    assert summary["bf16_loss"] < 0.6 * bf16["losses"][0]  # it learned
    assert abs(summary["loss_vs_bf16"]) < LOSS_TOLERANCE, summary
