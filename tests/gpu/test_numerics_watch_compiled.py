"""The numerics watch in a model compiled with inductor after prepare, on the GPU, for the
engines whose layers dynamo traces (native, ao): watch steps cost no graph break, run eagerly (or,
where torch's eager_on_recompile stance cannot be set, compile the armed graph once), and leave the
ordinary steps their graph (tests/cpu/test_numerics_watch_compiled.py on the CPU with aot_eager)."""

import math

import pytest

from fp8plug.backends import get_backend
from tests.cpu.test_numerics_watch_compiled import check_graphs, train, without_eager_stance


@pytest.mark.parametrize("eager_watch", [True, False])
@pytest.mark.parametrize("engine", ["native", "ao"])
def test_compiled_watch_keeps_the_graph_on_the_gpu(monkeypatch, engine, eager_watch):
    if not get_backend(engine).probe().available:
        pytest.skip(f"{engine} is not installed")
    if not eager_watch:
        without_eager_stance(monkeypatch)
    checks, ran, broke, graphs, layers = train(compiled=True, engine=engine, device="cuda", inner="inductor")
    check_graphs(checks, ran, broke, graphs, eager_watch)
    assert len(layers) == 7
    for check in checks[1::2]:
        for fqn in layers:
            for key in ("sqnr_db", "dgrad_sqnr_db"):
                value = check[f"fp8/{fqn}/{key}"]
                assert math.isfinite(value) and 15.0 < value < 40.0, (fqn, key, value)
