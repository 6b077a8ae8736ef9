"""Visible FP8 on the CPU (ao engine, torchao's CPU path): the GEMM counts per converted Linear
(eager, torch.compile without recompiles, activation checkpointing, pickling, DDP leaving them
alone), the one log line at conversion (main process only, a warning when nothing runs in FP8),
`Accelerator.fp8_backend` and `fp8_coverage()`, and a transformers Llama trained through
fp8plug.Accelerator on odd sequence lengths with every GEMM in FP8."""

import logging
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs  # noqa: E402
from fp8plug.coverage import COUNTS, fp8_coverage  # noqa: E402
from tests.support.hf import train_on_lengths  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def ao(**kwargs):
    return FP8RecipeKwargs(backend="ao", **kwargs)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def converted(model=None, **kwargs):
    model = model if model is not None else mlp()
    fp8plug.convert_model(model, recipe=ao(**kwargs))
    return model


def records(caplog, level):
    """fp8plug's log lines at `level`, less the attention switch's (fp8plug.hf.attention), which is
    logged once per model class and process, so whether it shows depends on the tests run before."""
    return [r.getMessage() for r in caplog.records
            if r.name == "fp8plug" and r.levelno == level and "attention through" not in r.getMessage()]


# --- the counts -------------------------------------------------------------------------------------


def test_counts_fp8_calls_per_layer_and_leaves_state_dict_alone():
    model = converted()
    for tokens in (32, 7, 31):  # odd token counts are padded, so they run FP8 too
        model(torch.randn(tokens, 64)).sum().backward()
    assert fp8_coverage(model) == {"fp8_gemms": 6, "high_precision_gemms": 0, "layers": {"0": (3, 0), "2": (3, 0)}}
    with fp8plug.get_backend("ao").autocast(ao(), enabled=False):  # a region that turns FP8 off
        model(torch.randn(16, 64))
    assert fp8_coverage(model)["layers"]["0"] == (3, 1)
    model.eval()
    model(torch.randn(16, 64))  # eval in high precision (the default policy): not counted
    assert fp8_coverage(model, reset=True)["high_precision_gemms"] == 2
    assert fp8_coverage(model) == {"fp8_gemms": 0, "high_precision_gemms": 0, "layers": {"0": (0, 0), "2": (0, 0)}}
    assert set(model.state_dict()) == set(mlp().state_dict())  # the counts are not checkpointed
    assert model[0]._buffers[COUNTS].dtype == torch.int64
    assert model._ddp_params_and_buffers_to_ignore == [f"0.{COUNTS}", f"2.{COUNTS}"]


def test_a_model_without_converted_layers_has_empty_coverage():
    assert fp8_coverage(mlp()) == {"fp8_gemms": 0, "high_precision_gemms": 0, "layers": {}}


def test_compiled_counts_without_recompiling():
    from torch._dynamo.utils import counters

    model = converted()
    fp8plug.apply_fp8_autowrap(model, ao())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(5):
        compiled(torch.randn(32, 64)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1  # the counts are buffers: no recompile per step
    assert fp8_coverage(compiled)["layers"] == {"0": (5, 0), "2": (5, 0)}  # names without _orig_mod.


def test_activation_checkpointing_counts_a_forward_once():
    from torch.utils.checkpoint import checkpoint

    model = converted()
    for reentrant in (False, True):
        x = torch.randn(32, 64, requires_grad=True)
        checkpoint(model, x, use_reentrant=reentrant).sum().backward()  # the forward runs twice
        assert fp8_coverage(model, reset=True)["layers"] == {"0": (1, 0), "2": (1, 0)}


def test_converted_models_still_pickle_and_copies_count_on_their_own():
    import copy

    model = converted()
    twin = pickle.loads(pickle.dumps(model))
    clone = copy.deepcopy(model)
    twin(torch.randn(16, 64))
    clone(torch.randn(16, 64))
    clone(torch.randn(16, 64))
    assert fp8_coverage(twin)["fp8_gemms"] == 2 and fp8_coverage(clone)["fp8_gemms"] == 4
    assert fp8_coverage(model)["fp8_gemms"] == 0


def _ddp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("fp8plug").addHandler(handler)
    model = converted()
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=True)
    for _ in range(rank + 1):  # rank 1 runs one more step outside DDP: its counts differ
        model(torch.randn(16, 64))
    ddp(torch.randn(16, 64)).sum().backward()  # DDP would broadcast rank 0's buffers here
    result = {"counts": fp8_coverage(ddp)["layers"], "logged": len(seen),
              "ignored": sorted(ddp.parameters_to_ignore)}
    Path(out_dir, f"rank{rank}.txt").write_text(repr(result))
    # Skip interpreter teardown: freeing DDP's reducer there can deadlock gloo's worker thread on
    # the GIL (torch 2.13, ProcessGroupGloo::~ProcessGroupGloo joins it while holding the GIL).
    os._exit(0)


@pytest.mark.slow
def test_ddp_leaves_each_ranks_counts_alone_and_only_rank0_logs(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = {r: eval(Path(tmp_path, f"rank{r}.txt").read_text()) for r in (0, 1)}
    assert results[0]["counts"] == {"0": (2, 0), "2": (2, 0)}
    assert results[1]["counts"] == {"0": (3, 0), "2": (3, 0)}  # not overwritten by rank 0's
    assert results[0]["ignored"] == [f"0.{COUNTS}", f"2.{COUNTS}"]
    assert results[0]["logged"] == 1 and results[1]["logged"] == 0


# --- the log line -----------------------------------------------------------------------------------


def test_one_info_line_with_the_engine_the_count_and_grouped_reasons(caplog):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
            self.odd = nn.ModuleList(nn.Linear(64, 10) for _ in range(5))
            self.head = nn.Linear(64, 64)

    with caplog.at_level(logging.DEBUG, logger="fp8plug"):
        report = fp8plug.convert_model(Net(), recipe=ao(modules_to_ignore=["head"]))
    (line,) = records(caplog, logging.INFO)
    assert line.startswith("fp8plug: FP8 with ao (torchao float8 0.18") and "tensorwise scaling" in line
    assert "Net: 6 of 12 Linear layers run in FP8" in line
    assert "5 not eligible (odd.0: in_features=64" not in line  # the note is the reason itself
    assert "5 not eligible (odd.0: out_features=10 not divisible by 16, odd.1: out_features=10 not divisible by 16, " \
           "odd.2: out_features=10 not divisible by 16, +2 more)" in line
    assert "1 listed in modules_to_ignore (head)" in line
    assert not records(caplog, logging.WARNING)
    assert str(report) in records(caplog, logging.DEBUG)[0]  # the whole report, at DEBUG


def test_warning_when_no_linear_runs_in_fp8(caplog):
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        fp8plug.convert_model(nn.Sequential(nn.Linear(10, 10), nn.ReLU()), recipe=ao())
        fp8plug.convert_model(nn.Sequential(nn.LayerNorm(64)), recipe=ao())
    first, second = records(caplog, logging.WARNING)
    assert "Sequential: none of its 1 Linear layers runs in FP8" in first
    assert "in_features=10 and out_features=10 not divisible by 16" in first
    assert first.endswith("it trains in high precision although FP8 was asked for")
    assert "no nn.Linear layer to convert" in second
    assert not records(caplog, logging.INFO)


def test_only_the_main_process_logs(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # a launcher's second process, before torch.distributed starts
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        fp8plug.convert_model(mlp(), recipe=ao())
    assert not records(caplog, logging.INFO)


# --- nn.MultiheadAttention, nn.TransformerEncoder ---------------------------------------------------------


def test_transformer_encoder_converts_its_linears_and_says_why_not_attention(caplog):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    reference = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double()
    reference.load_state_dict(encoder.state_dict())
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        report = fp8plug.convert_model(encoder, recipe=ao())
    assert report.converted == [f"layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)]
    for i in (0, 1):
        assert "nn.MultiheadAttention" in report.skipped[f"layers.{i}.self_attn.out_proj"]
        assert "in_proj_weight" in report.skipped[f"layers.{i}.self_attn"]
    (line,) = records(caplog, logging.INFO)
    assert "4 of 6 Linear layers run in FP8" in line
    assert "2 output projections of nn.MultiheadAttention" in line and "2 Q/K/V projections" in line
    assert "never calling a Linear module" in line

    x, g = torch.randn(2, 24, 64), torch.randn(2, 24, 64)  # 48 tokens; g: a loss whose gradient reaches inside
    out = encoder(x)
    (out * g).sum().backward()
    expected = reference(x.double())
    (expected * g.double()).sum().backward()
    from tests.support.numerics import sqnr_db

    assert 20 <= sqnr_db(out, expected) < 60  # FP8 ran in the feed-forward Linears, and ran right
    # linear1's weight gradient passes through linear2's FP8 input-gradient GEMM first (E5M2 gradients
    # twice quantised): measured ~15 dB against ~22 dB for linear2
    for (i, name), floor in {(1, "linear2"): 18, (1, "linear1"): 12, (0, "linear2"): 18, (0, "linear1"): 12}.items():
        grad = getattr(encoder.layers[i], name).weight.grad
        assert sqnr_db(grad, getattr(reference.layers[i], name).weight.grad) >= floor, (i, name)
    assert fp8_coverage(encoder)["layers"] == {f"layers.{i}.linear{j}": (1, 0) for i in (0, 1) for j in (1, 2)}


# --- fp8plug.Accelerator ------------------------------------------------------------------------------------


def test_fp8_backend_names_the_engine_and_keeps_accelerates_fp8_off(monkeypatch):
    import accelerate
    from accelerate.utils.dataclasses import FP8BackendType

    for name in ("_prepare_te", "_prepare_ao", "_prepare_msamp"):
        monkeypatch.setattr(accelerate.Accelerator, name, lambda *a, **k: pytest.fail("accelerate's FP8 ran"))
    acc = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[ao()])
    assert acc.fp8_backend == "ao" and repr(acc.fp8_backend) == "FP8EngineName('ao')"
    assert all(acc.fp8_backend != member for member in FP8BackendType)
    model, optimizer = acc.prepare(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1))
    assert acc.fp8_coverage()["layers"] == {"0": (0, 0), "2": (0, 0)}
    # FSDP2's parameter mapping still sees through torchao's float8 all-gather weight (data_ptr 0)
    wrapped = mlp()
    fp8plug.get_backend("ao").convert(wrapped, ao(enable_fsdp_float8_all_gather=True))
    pointers = acc._get_named_parameters(wrapped, drop_refs=True)
    assert pointers["0.weight"] == wrapped[0].weight._tensor.data_ptr() != 0
    assert acc.fp8_backend == "ao"
    plain = fp8plug.Accelerator(cpu=True, mixed_precision="bf16")
    assert plain.fp8_backend == FP8BackendType.NO


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, tie_word_embeddings=True, max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_llama_on_odd_lengths_runs_every_gemm_in_fp8(caplog):
    """Dynamic padding gives lengths like 31: 8x31 tokens used to run with zero FP8 GEMMs."""
    acc = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[ao()])
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        model, optimizer = acc.prepare(model, optimizer)
    (line,) = records(caplog, logging.INFO)
    assert "LlamaForCausalLM: 14 of 15 Linear layers run in FP8; in high precision: 1 output head (lm_head" in line
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    losses = train_on_lengths(acc, model, optimizer, (31, 33, 7, 31), batch=8, vocab=128)
    coverage = acc.fp8_coverage()
    assert coverage["fp8_gemms"] == 14 * 4 and coverage["high_precision_gemms"] == 0
    assert coverage["layers"]["model.layers.0.self_attn.k_proj"] == (4, 0)
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (8, 31)))
    assert acc.fp8_coverage(reset=True)["fp8_gemms"] == 14 * 4  # eval, in high precision, is not counted
    assert all(torch.isfinite(torch.tensor(losses)))
