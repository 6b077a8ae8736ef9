"""Smoke checks of the MS-AMP operations that opt levels O1 and O2 use, on a CUDA GPU.

Run by build.sh after the build. Each check runs on its own, so one failure does not hide the
others; it prints PASS/FAIL with the numbers or the traceback, writes the lot to
$OUT/msamp/smoke.json, and exits 1 if any check failed.
"""

import copy
import json
import os
import sys
import traceback

import torch

RESULTS = {}


def check(name):
    def wrap(fn):
        try:
            detail = fn()
            RESULTS[name] = {"ok": True, "detail": detail}
            print(f"PASS {name}: {detail}")
        except Exception:
            RESULTS[name] = {"ok": False, "error": traceback.format_exc()}
            print(f"FAIL {name}:\n{traceback.format_exc()}")
        return fn
    return wrap


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@check("import")
def _import():
    import msamp
    import msamp_adamw  # noqa: F401  (the CUDA extension O1/O2's optimizers need)
    from msamp.common.utils import transformer_engine_wrapper as tew

    return {"msamp": msamp.__version__, "msamp_file": msamp.__file__, "fp8_ops": tew.tex.__name__,
            "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}


@check("fp8_cast_round_trip")
def _cast():
    from msamp.common.dtype import Dtypes

    x = torch.randn(64, 128, device="cuda")
    e4m3 = rel(x.cast(Dtypes.kfloat8_e4m3).float(), x)
    e5m2 = rel(x.cast(Dtypes.kfloat8_e5m2).float(), x)
    fp16 = rel(x.cast(Dtypes.kfloat16).float(), x)
    assert e4m3 < 0.05 and e5m2 < 0.1 and fp16 < 1e-3, (e4m3, e5m2, fp16)
    return {"e4m3_rel": e4m3, "e5m2_rel": e5m2, "fp16_rel": fp16}


@check("fp8_gemm")
def _gemm():
    from msamp.common.dtype import Dtypes
    from msamp.operators.gemm import Gemm

    a = torch.randn(48, 64, device="cuda").cast(Dtypes.kfloat8_e4m3)
    b = torch.randn(40, 72, device="cuda")[:, :64].contiguous().cast(Dtypes.kfloat8_e5m2)  # N=40: padded
    out = Gemm.fp8_gemm(a, b, Dtypes.kfloat32)
    reference = b.float() @ a.float().t()
    error = rel(out, reference)
    assert out.shape == (40, 48) and error < 1e-4, (out.shape, error)
    return {"rel_vs_dequantized_operands": error}


@check("fp8_gemm_flattened_metas")
def _gemm_flattened_metas():
    """The GEMM with scale_inv views 4 bytes into one buffer, as MS-AMP's flattened metas are
    (cuBLAS refuses scale pointers that are not 16-byte aligned)."""
    from msamp.common.dtype import Dtypes
    from msamp.common.tensor import ScalingMeta
    from msamp.operators.gemm import Gemm

    flat = torch.ones(4, device="cuda")
    a_meta, b_meta = ScalingMeta(Dtypes.kfloat8_e4m3), ScalingMeta(Dtypes.kfloat8_e4m3)
    a_meta.scale, a_meta.scale_inv = flat[0].clone(), flat[1]
    b_meta.scale, b_meta.scale_inv = flat[2].clone(), flat[3]
    a = torch.randn(256, 512, device="cuda").cast(Dtypes.kfloat8_e4m3, meta=a_meta)
    b = torch.randn(4096, 512, device="cuda").cast(Dtypes.kfloat8_e4m3, meta=b_meta)
    assert b.meta.scale_inv.data_ptr() % 16 != 0
    out = Gemm.fp8_gemm(a, b, Dtypes.kbfloat16)
    error = rel(out.float(), b.float() @ a.float().t())
    assert error < 1e-2, error
    return {"rel_vs_dequantized_operands": error}


def _pair(opt_class):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    return model, opt_class(model.parameters(), lr=1e-3)


@check("initialize_types")
def _types():
    import msamp

    found = {}
    for opt_class in (torch.optim.Adam, torch.optim.AdamW):
        for level in ("O1", "O2"):
            model, optimizer = _pair(opt_class)
            model, optimizer = msamp.initialize(model, optimizer, opt_level=level)
            found[f"{opt_class.__name__}/{level}"] = [type(model[0]).__name__, type(optimizer).__name__,
                                                       str(optimizer.exp_avg_dtype)]  # an attribute, not a default
    assert found["AdamW/O2"][:2] == ["FP8Linear", "LBAdamW"] and found["Adam/O1"][1] == "LBAdam", found
    return found


@check("fp8linear_forward_backward")
def _linear():
    import msamp

    model, optimizer = _pair(torch.optim.AdamW)
    reference = copy.deepcopy(model)
    model, optimizer = msamp.initialize(model, optimizer, opt_level="O2")
    x = torch.randn(256, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        ref = reference(x)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    forward = rel(out.float(), ref.float())
    grad = rel(model[0].weight.grad.float(), reference[0].weight.grad.float())
    assert out.dtype == torch.bfloat16 and forward < 0.1 and grad < 0.2, (out.dtype, forward, grad)
    return {"forward_rel": forward, "weight_grad_rel": grad}


@check("lbadamw_o2_training")
def _train():
    import msamp

    torch.manual_seed(1)
    teacher = torch.randn(64, 128, device="cuda") / 128 ** 0.5
    result = {}
    for level in ("O1", "O2"):
        model, optimizer = _pair(torch.optim.AdamW)
        model, optimizer = msamp.initialize(model, optimizer, opt_level=level)
        losses = []
        for step in range(60):
            x = torch.randn(128, 128, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = (model(x).float() - x @ teacher.t()).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.all_reduce_grads(model)
            optimizer.step()
            losses.append(loss.item())
        state = optimizer.state[next(iter(optimizer.state))]
        result[level] = {"first": losses[0], "last": losses[-1],
                         "exp_avg": str(getattr(state.get("exp_avg"), "dtype", None))}
        assert losses[-1] < 0.5 * losses[0], (level, losses[0], losses[-1])
    return result


if __name__ == "__main__":
    out = os.environ.get("OUT")
    if out:
        os.makedirs(os.path.join(out, "msamp"), exist_ok=True)
        with open(os.path.join(out, "msamp", "smoke.json"), "w") as handle:
            json.dump(RESULTS, handle, indent=1)
    failed = [name for name, result in RESULTS.items() if not result["ok"]]
    print(f"smoke: {len(RESULTS) - len(failed)} passed, {len(failed)} failed {failed}")
    sys.exit(1 if failed else 0)
