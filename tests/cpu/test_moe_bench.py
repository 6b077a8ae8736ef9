"""benchmarks/moe's bookkeeping without launching a row: the loss against the bf16 row of the
same compile mode, the issue's model shapes, every base in every compile mode, and the
unfused-casts switch of grouped_gemm.py putting the fused casts back, its per-expert dense weight
gradient against the grouped kernel. (A toy row end to end:
`python3 benchmarks/moe/moe_llm.py --device cpu --model toy --steps 4 --backend native
--compile-backend aot_eager`, about 2 minutes here, mostly imports.)"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "moe"))
import grouped_gemm  # noqa: E402
import moe_llm  # noqa: E402


def test_loss_is_compared_with_bf16_of_the_same_compile_mode():
    rows = [dict(row="bf16-eager", tokens_per_s=1.0, loss=2.0),
            dict(row="bf16-usercompiled", tokens_per_s=2.0, loss=2.5),
            dict(row="fp8plug-eager", tokens_per_s=1.5, loss=2.02),
            dict(row="fp8plug-compiled", tokens_per_s=3.0, loss=2.5),
            dict(row="fp8plug-usercompiled", error="timed out", loss=None)]
    moe_llm.save(None, dict(), rows)
    by = {r["row"]: r for r in rows}
    assert by["fp8plug-eager"]["loss_vs_bf16_pct"] == pytest.approx(1.0)
    assert by["fp8plug-eager"]["loss_vs_bf16_of"] == "bf16-eager"
    # no bf16-compiled row: against the table's reference, bf16-usercompiled
    assert by["fp8plug-compiled"]["loss_vs_bf16_of"] == "bf16-usercompiled"
    assert by["fp8plug-compiled"]["loss_vs_bf16_pct"] == pytest.approx(0.0)
    assert by["fp8plug-usercompiled"]["loss_vs_bf16_pct"] is None


def test_the_issue_shapes_and_rows():
    assert moe_llm.MODELS["qwen3moe"] == dict(arch="qwen3moe", layers=4, hidden=2048, expert_ffn=768, experts=128,
                                              top_k=8, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                                              seq=2048, batch=4, norm_topk_prob=True)
    mixtral = moe_llm.MODELS["mixtral"]
    assert (mixtral["hidden"], mixtral["experts"], mixtral["top_k"], mixtral["expert_ffn"], mixtral["heads"],
            mixtral["kv_heads"], mixtral["layers"], mixtral["vocab"], mixtral["batch"], mixtral["seq"]) == (
        4096, 8, 2, 14336, 32, 8, 2, 32000, 4, 2048)
    for base in ("bf16", "bf16-bf16weights", "fp8plug", "accelerate-ao", "fp8plug-nofilter-unfusedcasts"):
        for mode in ("eager", "compiled", "usercompiled"):
            assert f"{base}-{mode}" in moe_llm.ALL_ROWS
    args = moe_llm.parse_args(["--rows", "fp8plug-nofilter-unfusedcasts-eager"])
    assert args.row_list == ["fp8plug-nofilter-unfusedcasts-eager"]


def test_the_qwen3_model_renormalises_its_top_k_weights_as_qwen3_30b_a3b_does():
    import torch

    small = dict(moe_llm.MODELS["qwen3moe"], layers=1, hidden=32, expert_ffn=16, experts=4, top_k=2, heads=2,
                 kv_heads=1, head_dim=16, vocab=64, seq=16)
    assert moe_llm.build_model(small, torch.device("cpu")).config.norm_topk_prob is True


def test_unfused_run_restores_the_fused_casts():
    from fp8plug.backends.native import grouped

    fused, seen = grouped._fused, []
    grouped_gemm.unfused(lambda: seen.append(grouped._fused(None)))()
    assert seen == [False] and grouped._fused is fused


def test_the_dense_gemms_per_expert_are_the_grouped_kernels():
    """grouped_gemm.py's per-expert dense GEMMs (one scaled GEMM per expert's rows or columns)
    against the grouped kernel's, both emulated here, for the forward, input-gradient and
    weight-gradient operands: the same values, groups of any size (an empty one included: 16
    zero rows), the bounds read from the layout."""
    import torch

    from fp8plug.backends.native import dense_experts, grouped

    torch.manual_seed(0)
    sizes = torch.tensor([37, 0, 90, 5])
    layout = grouped.group_layout(sizes.cumsum(0).to(torch.int32), int(sizes.sum()))
    x, g = torch.randn(int(sizes.sum()), 48), torch.randn(int(sizes.sum()), 32)
    w = torch.randn(4, 32, 48)
    x8, x_inv = grouped.rowwise(grouped.pad_groups(x, layout))
    g8, g_inv = grouped.rowwise(grouped.pad_groups(g, layout))
    w8, w_inv = grouped.rowwise(w)
    w_kn8, w_kn_inv = grouped.cast_weight_input_grad(w, grouped.expert_inverse_scales(w_inv))
    g_t8, g_t_inv = grouped.groupwise_columns(grouped.pad_groups(g, layout), layout)
    x_t8, x_t_inv = grouped.groupwise_columns(grouped.pad_groups(x, layout), layout)
    cases, facts = grouped_gemm.dense_cases({"fwd": (x8, w8.transpose(-2, -1), x_inv, w_inv),
                                             "dgrad": (g8, w_kn8.transpose(-2, -1), g_inv, w_kn_inv),
                                             "wgrad": (g_t8, x_t8.t(), g_t_inv, x_t_inv)}, layout)
    assert facts == {"fwd_dense_max_rel_diff": 0.0, "dgrad_dense_max_rel_diff": 0.0, "wgrad_dense_max_rel_diff": 0.0}
    assert dense_experts.group_bounds(layout.offs) == [(0, 48), (48, 64), (64, 160), (160, 176)]
    assert cases["fp8_gemm_fwd_dense"]().shape == (layout.padded_rows, 32)
    assert cases["fp8_gemm_dgrad_dense_sync"]().shape == (layout.padded_rows, 48)
    assert cases["fp8_gemm_wgrad_dense"]().shape == (4, 32, 48)

