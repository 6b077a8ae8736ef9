"""Exports that ship right: `export_model` leaves a plain model with nothing of fp8plug in it, and
`save_fp8_checkpoint` writes a whole checkpoint or nothing, refusing what no client could load.

Checked on a real tied-embedding LlamaForCausalLM built from a config, converted with the native
engine through fp8plug.Accelerator (compiled before or after prepare, or not) and by
fp8plug.convert_model, on a PEFT LoRA model, and on a plain MLP (torch.jit.script):
- the exported model pickles (torch.save), has no fp8plug hook, attribute or forward wrapper, and
  gives bit-for-bit the outputs of the same architecture never converted, with these weights;
- an export replaces an older (sharded) checkpoint completely and keeps the other files there;
  a failure or a SIGKILL at any write leaves the older checkpoint exactly as it was;
- `modules_to_ignore` is checked as FP8RecipeKwargs checks it; an unmerged PEFT model and a model
  on the meta device are refused before anything is written;
- config.json names the architecture and dtype as save_pretrained does.
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug.checkpoints.export import export_model, save_fp8_checkpoint
from fp8plug.layers.rules import ConversionError
from tests.support.hf import VOCAB, fresh, tiny_llama
from tests.support.processes import ROOT, child_env

RECIPE = fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False)


def tokens(seed, batch=4, seq=16):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def trained(model, how, steps=2):
    """`model` trained `steps` steps in FP8 `how`: through fp8plug.Accelerator (compiled before or
    after prepare, or not), or converted by hand; returns what a user would pass to export_model."""
    fresh()
    if how == "convert_model":
        fp8plug.convert_model(model, recipe=RECIPE)
        fp8plug.apply_fp8_autowrap(model, RECIPE)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        prepared = model
    else:
        accelerator = fp8plug.Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[RECIPE])
        if how == "compiled_before":
            model = torch.compile(model, backend="eager")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        prepared, opt = accelerator.prepare(model, opt)
        if how == "compiled_after":
            prepared = torch.compile(prepared, backend="eager")
    prepared.train()
    for i in range(steps):
        ids = tokens(i)
        prepared(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return accelerator.unwrap_model(prepared) if how != "convert_model" else prepared


def fp8plug_leftovers(model: nn.Module):
    """Every trace of fp8plug or a wrapper on `model`: hooks whose code is fp8plug's, `_fp8plug*`
    attributes, instance forwards, accelerate's kept forward, compiled wrappers."""
    found = []
    for name, module in model.named_modules():
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
                      "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks"):
            for hook in getattr(module, hooks).values():
                hook = getattr(hook, "hook", hook)
                origin = getattr(hook, "__module__", None) or type(hook).__module__
                if str(origin).startswith("fp8plug"):
                    found.append(f"{name or '<root>'}.{hooks}: {getattr(hook, '__qualname__', type(hook).__name__)}")
        for attribute in module.__dict__:
            if attribute.startswith("_fp8plug") or attribute in ("forward", "_original_forward"):
                found.append(f"{name or '<root>'}.{attribute}")
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or module._compiled_call_impl is not None:
            found.append(f"{name or '<root>'}: compiled")
        if getattr(module, "_ddp_params_and_buffers_to_ignore", None):
            found.append(f"{name or '<root>'}._ddp_params_and_buffers_to_ignore")
    return found


def never_converted_with(plain: nn.Module, build) -> nn.Module:
    reference = build()
    reference.load_state_dict(plain.state_dict())
    return reference


# --- export_model: a plain model -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["accelerator", "compiled_before", "compiled_after", "convert_model"])
def test_exported_llama_has_nothing_of_fp8plug_and_runs_as_never_converted(how):
    plain = export_model(trained(tiny_llama(), how))
    assert type(plain).__name__ == "LlamaForCausalLM" and not fp8plug.has_fp8_layers(plain)
    assert fp8plug_leftovers(plain) == []
    assert plain.config._attn_implementation == "sdpa"
    assert plain.lm_head.weight is plain.model.embed_tokens.weight  # still tied
    buffer = io.BytesIO()
    torch.save(plain, buffer)  # failed on fp8plug's state-dict hooks (local functions)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    reference = never_converted_with(plain, tiny_llama)
    ids = tokens(7)
    for mode in ("eval", "train"):
        for m in (plain, reloaded, reference):
            getattr(m, mode)()
        with torch.no_grad():
            expected = reference(input_ids=ids).logits
            assert torch.equal(plain(input_ids=ids).logits, expected), mode  # bit for bit
            assert torch.equal(reloaded(input_ids=ids).logits, expected), mode


def test_exported_mlp_scripts_and_runs_as_never_converted():
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    fresh()
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[RECIPE])
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    for i in range(2):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(i))
        accelerator.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    plain = export_model(accelerator.unwrap_model(model))
    assert fp8plug_leftovers(plain) == []
    scripted = torch.jit.script(plain)  # failed on the native engine's _SkippedStepGuard hook
    reference = never_converted_with(plain, mlp)
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert torch.equal(plain(x), reference(x)) and torch.equal(scripted(x), reference(x))


def test_exported_lora_model_has_nothing_of_fp8plug_and_merges():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    plain = export_model(trained(lora, "accelerator"))
    assert fp8plug_leftovers(plain) == [] and not fp8plug.has_fp8_layers(plain)
    torch.save(plain, io.BytesIO())
    merged = plain.merge_and_unload()
    ids = tokens(3)
    with torch.no_grad():
        merged.eval()
        reference = never_converted_with(merged, tiny_llama).eval()
        assert torch.equal(merged(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_export_model_is_a_top_level_name():
    """docs/lora.md and docs/attention.md call fp8plug.export_model."""
    assert fp8plug.export_model is export_model and "export_model" in fp8plug.__all__


# --- save_fp8_checkpoint: what it refuses ------------------------------------------------------------------
def test_modules_to_ignore_is_checked_as_the_recipe_checks_it(tmp_path):
    model = export_model(trained(tiny_llama(), "accelerator"))
    out = tmp_path / "fp8"
    with pytest.raises(ValueError, match="give a list of fully-qualified module names") as bare:
        save_fp8_checkpoint(model, out, modules_to_ignore="lm_head")
    with pytest.raises(ValueError) as recipe_bare:
        fp8plug.FP8RecipeKwargs(modules_to_ignore="lm_head")
    assert str(bare.value).split(": ", 1)[1] == str(recipe_bare.value).split(": ", 1)[1]  # one rule, one wording
    assert "save_fp8_checkpoint(modules_to_ignore=...)" in str(bare.value)
    with pytest.raises(ConversionError, match=r"\['model.layers.0.mlp.up_projj'\] that match no module") as typo:
        save_fp8_checkpoint(model, out, modules_to_ignore=["model.layers.0.mlp.up_projj"])
    with pytest.raises(ConversionError) as recipe_typo:
        fp8plug.convert_model(tiny_llama(), recipe=fp8plug.FP8RecipeKwargs(
            backend="native", auto_filter=False, modules_to_ignore=["model.layers.0.mlp.up_projj"]))
    assert str(typo.value) == str(recipe_typo.value)
    assert not out.exists()  # refused before anything was written

    report = save_fp8_checkpoint(model, out, modules_to_ignore=["model.layers.1.mlp.down_proj"])
    assert report.kept["model.layers.1.mlp.down_proj"] == "listed in modules_to_ignore"
    config = json.loads((out / "config.json").read_text())
    assert "model.layers.1.mlp.down_proj" in config["quantization_config"]["ignored_layers"]


def test_unmerged_peft_model_is_refused_with_the_fix(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    plain = export_model(trained(lora, "accelerator"))
    out = tmp_path / "fp8"
    with pytest.raises(ValueError, match=r"PEFT adapters.*merge_and_unload\(\)"):
        save_fp8_checkpoint(plain, out)
    assert not out.exists()
    report = save_fp8_checkpoint(plain.merge_and_unload(), out)
    from safetensors import safe_open

    with safe_open(os.fspath(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert report.quantized and not any(n.startswith("base_model.") or "lora_" in n for n in names)


def test_meta_model_is_refused_before_anything_is_written(tmp_path):
    with torch.device("meta"):
        model = tiny_llama()
    out = tmp_path / "fp8"
    with pytest.raises(ValueError, match="meta device.*load them first"):
        save_fp8_checkpoint(model, out)
    assert not out.exists()


def test_config_names_the_architecture_and_dtype_as_save_pretrained_does(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_llama().to(dtype)
        model.save_pretrained(tmp_path / "plain")
        save_fp8_checkpoint(model, tmp_path / "fp8")
        plain = json.loads((tmp_path / "plain" / "config.json").read_text())
        fp8 = json.loads((tmp_path / "fp8" / "config.json").read_text())
        assert fp8["architectures"] == plain["architectures"] == ["LlamaForCausalLM"]
        assert fp8["dtype"] == plain["dtype"] == str(dtype).split(".")[1]
        assert (tmp_path / "fp8" / "generation_config.json").exists()


# --- save_fp8_checkpoint: the directory as one change ------------------------------------------------------
def files_of(directory):
    """relative path -> sha256 of every file under `directory`."""
    found = {}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def older_checkpoint(directory):
    """A sharded bf16 save_pretrained checkpoint, with a user's files beside it."""
    tiny_llama(seed=1).to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (directory / "runs").mkdir()
    (directory / "runs" / "log.txt").write_text("step 1: loss 4.8\n")
    assert (directory / "model.safetensors.index.json").exists()
    return files_of(directory)


def test_export_replaces_an_older_sharded_checkpoint_completely(tmp_path):
    out = tmp_path / "out"
    before = older_checkpoint(out)
    report = save_fp8_checkpoint(tiny_llama(), out)
    after = files_of(out)
    assert set(after) == {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
                          os.path.join("runs", "log.txt")}, sorted(after)  # no stale shard, no stale index
    for user_file in ("tokenizer_config.json", os.path.join("runs", "log.txt")):
        assert after[user_file] == before[user_file]
    assert sorted(report.files) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial or previous directory left beside it
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


def test_a_failure_at_the_config_write_leaves_the_older_checkpoint_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "out"
    before = older_checkpoint(out)
    real_dump = json.dump

    def failing_dump(obj, fp, *args, **kwargs):
        if os.path.basename(getattr(fp, "name", "")) == "config.json":
            raise OSError(28, "No space left on device")
        return real_dump(obj, fp, *args, **kwargs)

    monkeypatch.setattr(json, "dump", failing_dump)
    with pytest.raises(OSError, match="No space left"):
        save_fp8_checkpoint(tiny_llama(), out)
    assert files_of(out) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


KILLER = textwrap.dedent("""
    import json, os, signal, sys
    import safetensors.torch
    from fp8plug.checkpoints import export_dir
    from fp8plug.checkpoints.export import save_fp8_checkpoint
    from tests.support.hf import tiny_llama

    where, out = sys.argv[1], sys.argv[2]

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "weights":  # half the shard written, then killed
        real_save = safetensors.torch.save_file
        def save_file(tensors, path, *args, **kwargs):
            real_save(tensors, path, *args, **kwargs)
            os.truncate(path, os.path.getsize(path) // 2)
            die()
        safetensors.torch.save_file = save_file
    elif where == "config":  # the weights written, killed at the config
        real_dump = json.dump
        def dump(obj, fp, *args, **kwargs):
            if os.path.basename(getattr(fp, "name", "")) == "config.json":
                fp.write('{"architectures": ')
                fp.flush()
                die()
            return real_dump(obj, fp, *args, **kwargs)
        json.dump = dump
    elif where == "swap":  # the old directory renamed away, the new one not yet in
        real_rename = os.rename
        calls = []
        def rename(src, dst):
            calls.append(src)
            real_rename(src, dst)
            if len(calls) == 1:
                die()
        export_dir.os.rename = rename
    save_fp8_checkpoint(tiny_llama(seed=2), out)
""")


@pytest.mark.parametrize("where", ["weights", "config", "swap"])
def test_a_kill_at_any_write_leaves_a_whole_checkpoint(tmp_path, where):
    """SIGKILL mid-export: the older checkpoint is there untouched; a kill between the swap's two
    renames leaves no directory until the next export (or fp8plug.checkpoints.export_dir.recover) finishes the swap,
    the new export being complete by then. The next export writes a whole new one."""
    from fp8plug.checkpoints import directory as checkpoint_dir
    from fp8plug.checkpoints import export_dir

    out = tmp_path / "out"
    before = older_checkpoint(out)
    run = subprocess.run([sys.executable, "-c", KILLER, where, str(out)], cwd=ROOT, env=child_env(tmp_path),
                         timeout=300, capture_output=True, text=True)
    assert run.returncode == -9, run.stderr[-2000:]
    if where == "swap":
        assert not out.exists()
        export_dir.recover(str(out))
        after = files_of(out)
        assert set(after) == {"model.safetensors", "config.json", "generation_config.json",
                              "tokenizer_config.json", os.path.join("runs", "log.txt"),
                              checkpoint_dir.MANIFEST_NAME}, sorted(after)
        assert after["tokenizer_config.json"] == before["tokenizer_config.json"]
    else:
        assert files_of(out) == before
    save_fp8_checkpoint(tiny_llama(seed=3), out)
    after = files_of(out)
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= set(after)
    assert not any(name.startswith("model-") or name.endswith(".index.json") for name in after)
    assert [name for name in os.listdir(tmp_path) if name.startswith("out")] == ["out"]
