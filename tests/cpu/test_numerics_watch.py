"""The numerics watch and its guard (fp8plug.numerics): exact statistics on known tensors, SQNR
against a float64 reference, the interval (hooks only on watch steps), the flat dict and the log
line, a real accelerate Accelerator with a tracker, the planted-outlier guard, and the guard's
moves through save_state / load_state."""

import json
import logging
import math

import pytest
import torch
from accelerate.tracking import GeneralTracker
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs, convert_model, fp8_coverage
from fp8plug.numerics import emulate
from fp8plug.numerics.guard import NumericsGuard
from fp8plug.numerics.watch import flat_stats, numerics_stats, summary_line, watch_of
from tests.support.threads import one_thread  # noqa: F401 - autouse: one torch thread

E4M3, E5M2 = emulate.E4M3, emulate.E5M2


# --- the statistics ------------------------------------------------------------------------------------


def test_flushed_and_saturated_fractions_are_exact():
    # scale 1: E4M3's smallest subnormal is 2**-9, so 2**-11 rounds to code 0; 500 > 448 saturates
    t = torch.tensor([[0.0, 2.0**-11, 2.0**-9, 1.0], [500.0, -1000.0, 3.0, 2.0**-12]])
    stats = emulate.operand_stats(t, torch.tensor(1.0), E4M3)
    assert stats["amax"] == 1000.0
    assert stats["flushed"] == pytest.approx(2 / 7)  # of the 7 nonzero values, 2**-11 and 2**-12
    assert stats["saturated"] == pytest.approx(2 / 8)  # of all 8 values, 500 and -1000
    # E5M2 reaches 57344 and down to 2**-16: nothing flushed or saturated
    assert emulate.operand_stats(t, torch.tensor(1.0), E5M2)["saturated"] == 0.0
    # its own amax's scale never counts as saturation, even with float32 rounding
    x = torch.randn(257, 33) * 7.3
    assert emulate.operand_stats(x, emulate.amax_scale(x, E4M3), E4M3)["saturated"] == 0.0


def test_sqnr_against_float64_reference():
    torch.manual_seed(0)
    x, w = torch.randn(128, 256), torch.randn(64, 256)
    reference = x.double() @ w.double().t()
    fp8 = (emulate.fake_quantize(x, emulate.amax_scale(x, E4M3), E4M3)
           @ emulate.fake_quantize(w, emulate.amax_scale(w, E4M3), E4M3).t())
    noise = ((reference - fp8.double()) ** 2).sum()
    expected = 10 * math.log10(float((reference**2).sum() / noise))
    assert emulate.sqnr_db(reference, fp8) == pytest.approx(expected, abs=1e-9)
    # E4M3 x E4M3 of Gaussian operands: about 28 dB (3 mantissa bits each)
    assert 25.0 < expected < 31.0
    assert emulate.sqnr_db(reference, reference) == math.inf


def test_finer_granularity_scales():
    t = torch.ones(4, 256)
    t[0] *= 100.0
    t[:, 200] *= 10.0
    row = emulate.amax_scale(t, E4M3, "rowwise")
    assert row.shape == (4, 1) and row[0, 0] == pytest.approx(448 / 1000) and row[1, 0] == pytest.approx(44.8)
    block = emulate.amax_scale(t, E4M3, "blockwise")  # 1x128 tiles
    assert block.shape == t.shape
    assert block[1, 0] == pytest.approx(448.0) and block[1, 200] == pytest.approx(44.8)
    weight = emulate.amax_scale(t, E4M3, "blockwise", weight=True)  # one 128x128 block per 128 columns
    assert weight[1, 0] == pytest.approx(4.48) and weight[3, 200] == pytest.approx(0.448)
    with pytest.raises(ValueError, match="granularity 'columnwise'"):
        emulate.amax_scale(t, E4M3, "columnwise")


# --- the watch ---------------------------------------------------------------------------------------


class Planted(nn.Module):
    """x -> fc1 -> relu -> fc2, where fc1's input has 4 outlier channels `boost` times the rest.
    fc1's weights for those channels are zero and stay so (their gradient is masked): the target
    never depends on them, as a model's massive activations act as no-ops, so in high precision
    the boost changes nothing."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.fc1.weight[:, :4] = 0.0
        mask = torch.ones_like(self.fc1.weight)
        mask[:, :4] = 0.0
        self.fc1.weight.register_hook(lambda g: g * mask)
        self.boost = 1.0

    def forward(self, x):
        x = torch.cat([x[:, :4] * self.boost, x[:, 4:]], dim=1)
        return self.fc2(torch.relu(self.fc1(x)))


def train_planted(recipe=None, growth=1.0, steps=24, seed=0):
    """Train Planted on a fixed linear teacher; the outliers start at 1000x and grow by `growth`
    each step (growth 1.0: no outliers at all). Returns the model and the losses."""
    torch.manual_seed(seed)
    model, teacher = Planted(), nn.Linear(60, 16)
    if recipe is not None:
        convert_model(model, recipe=recipe)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for step in range(steps):
        model.boost = 1000.0 * growth**step if growth != 1.0 else 1.0
        x = torch.randn(128, 64, generator=gen)
        loss = nn.functional.mse_loss(model(x), teacher(x[:, 4:]).detach())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def watched(interval=1, guard=False, **kwargs):
    return FP8RecipeKwargs(backend="native", numerics_watch_interval=interval, numerics_guard=guard, **kwargs)


def test_watch_acts_only_on_watch_steps_and_gives_a_flat_dict():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_model(model, recipe=watched(interval=3))
    watch = watch_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    armed, checked = [], []
    calls = []
    original = watch._observe
    watch._observe = lambda *args: (calls.append(args[0]), original(*args))
    for step in range(1, 8):
        armed.append(watch.armed)
        model(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
        stats = numerics_stats(model)
        checked.append(bool(stats))
        if stats:
            last = stats
    # steps 3 and 6 are watched: the hooks act during those steps only, a dict after them only
    assert armed == [False, False, True, False, False, True, False]
    assert calls == ["0", "2", "0", "2"]
    assert checked == [False, False, True, False, False, True, False]
    assert numerics_stats(model) == {}  # once per check
    keys = {f"fp8/{layer}/{op}/{stat}" for layer in ("0", "2") for op in ("input", "weight", "grad_output")
            for stat in ("amax", "flushed", "saturated")}
    keys |= {f"fp8/{layer}/{k}" for layer in ("0", "2") for k in ("sqnr_db", "dgrad_sqnr_db")}
    assert set(last) == keys and all(isinstance(v, float) for v in last.values())
    assert last["fp8/0/weight/amax"] == pytest.approx(float(model[0].weight.detach().abs().max()), rel=1e-2)
    assert 20.0 < last["fp8/0/sqnr_db"] < 35.0 and 15.0 < last["fp8/2/dgrad_sqnr_db"] < 35.0
    assert watch.checks == 2


def test_watch_sees_a_model_compiled_after_conversion():
    # torch.compile traces only the hooks a module has when it compiles: the watch's are put on at
    # conversion and act on watch steps only (a guard of the graph)
    model = nn.Sequential(nn.Linear(32, 32))
    convert_model(model, recipe=watched(interval=2))
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    found = []
    for _ in range(3):
        compiled(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
        found.append(len(numerics_stats(model)))
    assert found == [0, 11, 0]


def test_watch_off_by_default_and_recipe_checks():
    model = nn.Sequential(nn.Linear(32, 32))
    convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    assert watch_of(model) is None
    with pytest.raises(ValueError, match="FP8RecipeKwargs.guard_patience"):
        FP8RecipeKwargs(guard_patience=0)
    with pytest.raises(ValueError, match="FP8RecipeKwargs.numerics_guard=True .* numerics_watch_interval"):
        convert_model(nn.Sequential(nn.Linear(32, 32)), recipe=FP8RecipeKwargs(backend="native", numerics_guard=True))


def test_log_line_names_the_worst_layers(caplog):
    records = {"a": {"sqnr_db": 30.0, "input/saturated": 0.0}, "b": {"sqnr_db": 12.5, "grad_output/saturated": 0.02},
               "c": {"sqnr_db": 25.0, "weight/flushed": 0.001}, "d": {"sqnr_db": 28.0}}
    line = summary_line(records, 100)
    assert line.startswith("numerics at step 100: 4 FP8 layers; worst SQNR b 12.5 dB, c 25.0 dB, d 28.0 dB;")
    assert "most saturated 2% (b)" in line and "most flushed to zero 0.1% (c)" in line
    assert flat_stats(records)["fp8/b/grad_output/saturated"] == 0.02
    model = nn.Sequential(nn.Linear(32, 32))
    convert_model(model, recipe=watched(interval=1))
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        model(torch.randn(16, 32)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    lines = [r.getMessage() for r in caplog.records if "numerics at step" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("fp8plug: numerics at step 1: 1 FP8 layers; worst SQNR 0 ")


# --- the guard -----------------------------------------------------------------------------------------


def test_guard_catches_planted_outliers_and_the_loss_recovers(caplog):
    # the outliers grow 1.5x a step from 1000x: past ~10^4 x fc1's other channels lose their
    # precision in per-tensor E4M3 (subnormal, then flushed to zero), and its SQNR falls below 20 dB
    _, reference = train_planted(None, growth=1.5)  # high precision: the outliers change nothing
    _, unguarded = train_planted(FP8RecipeKwargs(backend="native"), growth=1.5)
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        guarded_model, guarded = train_planted(watched(interval=1, guard=True), growth=1.5)
    warnings = [r.getMessage() for r in caplog.records if "numerics guard" in r.getMessage()]
    # one warning per move: per tensor -> a finer scaling where native has one for fc1's shape
    # (blockwise needs 128-multiples) -> bf16, as the outliers keep growing
    assert 1 <= len(warnings) <= 2 and all(w.startswith("fp8plug: the numerics guard moved fc1 to ") for w in warnings)
    assert warnings[-1].startswith("fp8plug: the numerics guard moved fc1 to bf16 (")
    assert "SQNR" in warnings[-1] and "< 20 dB for 3 checks" in warnings[-1]
    assert type(guarded_model.fc1) is nn.Linear and type(guarded_model.fc2) is not nn.Linear
    moved = fp8_coverage(guarded_model)["moved"]
    assert list(moved) == ["fc1"] and moved["fc1"].startswith("moved to bf16 by the numerics guard (")
    # FP8 left alone: the grown outliers flush fc1's other channels and the loss climbs back up;
    # guarded: the run follows high precision's
    assert unguarded[-1] > 1.5 * reference[-1]
    assert guarded[-1] < 1.1 * reference[-1]


def test_guard_leaves_a_healthy_model_alone(caplog):
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        model, losses = train_planted(watched(interval=1, guard=True), growth=1.0)
    assert not [r for r in caplog.records if "numerics guard" in r.getMessage()]
    assert "moved" not in fp8_coverage(model) and losses[-1] < 0.5 * losses[0]
    assert watch_of(model).checks == 24


def test_guard_needs_patience_checks_in_a_row():
    guard = NumericsGuard(min_sqnr_db=20.0, max_saturation=1e-3, patience=3)
    assert guard.why_bad({"sqnr_db": 25.0, "dgrad_sqnr_db": 18.0}) == "SQNR 18.0 dB < 20 dB"
    assert guard.why_bad({"sqnr_db": 25.0, "input/saturated": 0.01}) == "saturated 1% > 0.1%"
    assert guard.why_bad({"sqnr_db": 25.0, "input/saturated": 1e-4}) is None
    model = nn.Sequential(nn.Linear(32, 32))
    convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    engine = fp8plug.get_backend("native")
    bad, good = {"0": {"sqnr_db": 5.0}}, {"0": {"sqnr_db": 28.0}}
    for records in (bad, bad, good, bad, bad):
        assert guard.check(model, engine, records, 0) == []
    # moved one step finer (32 features: rowwise, blockwise needing 128-multiples)
    assert guard.check(model, engine, bad, 7) == ["0"] and model[0].scaling == "rowwise"


# --- the Accelerator and checkpoints ------------------------------------------------------------------


class RecordingTracker(GeneralTracker):
    """A tracker as accelerate takes a user's own (log_with=[instance]): keeps what it is sent."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.logged = []

    @property
    def tracker(self):
        return self.logged

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))


def test_accelerator_logs_checks_to_its_tracker():
    tracker = RecordingTracker()
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[watched(interval=2)],
                                      log_with=[tracker])
    accelerator.init_trackers("watch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    got = []
    for _ in range(4):
        accelerator.backward(model(torch.randn(8, 32)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        got.append(accelerator.fp8_numerics())
    accelerator.end_training()
    assert [bool(g) for g in got] == [False, True, False, True]
    assert [step for step, _ in tracker.logged] == [2, 4]
    assert tracker.logged[1][1] == got[3] and "fp8/0/sqnr_db" in got[3] and "fp8/2/grad_output/saturated" in got[3]


def test_guard_move_survives_save_and_load_state(tmp_path):
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8",
                                      kwargs_handlers=[watched(interval=2, guard=True)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    watch = watch_of(model)
    watch.guard.check(model, accelerator.fp8_engine, {"2": {"sqnr_db": 3.0}}, 5)
    watch.guard.check(model, accelerator.fp8_engine, {"2": {"sqnr_db": 3.0}}, 6)
    watch.guard.check(model, accelerator.fp8_engine, {"2": {"sqnr_db": 3.0}}, 7, accelerator.fp8_reports[0])
    assert model[2].scaling == "rowwise"  # one step finer (blockwise needs 128-multiples)
    # still FP8, so among the converted layers, with the move as its note
    note = "moved to rowwise by the numerics guard (SQNR 3.0 dB < 20 dB for 3 checks)"
    assert accelerator.fp8_reports[0].notes["2"] == note
    accelerator.backward(model(torch.randn(8, 32)).square().mean())
    optimizer.step()
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    from tests.support.hf import fresh
    fresh()
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8",
                                      kwargs_handlers=[watched(interval=2, guard=True)])
    torch.manual_seed(1)
    resumed = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    resumed, optimizer = accelerator.prepare(resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-3))
    assert resumed[2].scaling != "rowwise"
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert resumed[2].scaling == "rowwise" and resumed[0].scaling != "rowwise"
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in saved.items())
    assert json.dumps(fp8_coverage(resumed)["moved"]) == json.dumps(
        {"2": "moved to rowwise by the numerics guard (SQNR 3.0 dB < 20 dB for 3 checks)"})
    # the resumed optimizer trains the moved layer's very parameters
    before = resumed[2].weight.detach().clone()
    accelerator.backward(resumed(torch.randn(8, 32)).square().mean())
    optimizer.step()
    assert not torch.equal(before, resumed[2].weight)
