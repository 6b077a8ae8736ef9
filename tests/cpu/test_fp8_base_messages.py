"""What a user of `load_fp8_base` is told when something is wrong: an unreadable config.json or
index names the file; PEFT's own merge (`merge_and_unload()`, `merge_adapter()`) on an FP8-stored
base is refused in one line naming `merge_and_export`, before any layer is merged, and works again
once `export_model` has put the base back in high precision."""

import json

import pytest
import torch

peft = pytest.importorskip("peft")

import fp8plug  # noqa: E402
from fp8plug.checkpoints.export import save_fp8_checkpoint  # noqa: E402
from tests.support.hf import tiny_llama  # noqa: E402
from tests.support.threads import one_thread  # noqa: F401, E402 - autouse: one torch thread


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_llama()
    model.config.tie_word_embeddings = False  # the embedding's adapter then merges into the embedding alone
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    directory = tmp_path_factory.mktemp("fp8") / "ckpt"
    save_fp8_checkpoint(model, directory, max_shard_size="100KB")  # sharded, with an index
    return directory


def copy_of(checkpoint, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(checkpoint, target)
    return target


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_an_unreadable_json_file_is_named(checkpoint, tmp_path, name):
    directory = copy_of(checkpoint, tmp_path)
    text = (directory / name).read_text()
    (directory / name).write_text(text[: len(text) // 2])  # cut short, as an interrupted copy leaves it
    with pytest.raises(ValueError) as caught:
        fp8plug.load_fp8_base(directory, device="cpu")
    message = str(caught.value)
    assert str(directory / name) in message and "not valid JSON" in message and "\n" not in message
    (directory / name).write_text(json.dumps({"no": "weight_map"}) if name.endswith("index.json") else "[]")
    with pytest.raises(ValueError, match=str(directory / name).replace(".", r"\.")):
        fp8plug.load_fp8_base(directory, device="cpu")


def lora(checkpoint):
    model = peft.get_peft_model(fp8plug.load_fp8_base(checkpoint, device="cpu", dtype=torch.float32),
                                peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    return model.eval()


@pytest.mark.parametrize("merge", ["merge_and_unload", "merge_adapter", "layer"])
def test_peft_merge_on_an_fp8_base_is_refused_naming_merge_and_export(checkpoint, merge):
    model = lora(checkpoint)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    call = {"merge_and_unload": model.merge_and_unload, "merge_adapter": model.merge_adapter,
            "layer": model.base_model.model.model.layers[0].self_attn.q_proj.merge}[merge]
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert "fp8plug.merge_and_export" in message and "\n" not in message
    assert ("FrozenFP8Linear (64 -> 64)" if merge == "layer" else "'model.layers.0.self_attn.q_proj") in message
    # refused before anything merged: the embedding's adapter (high precision, first in order) too
    assert not any(getattr(m, "merged", False) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_peft_merge_works_once_the_base_is_high_precision(checkpoint):
    model = lora(checkpoint)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    merged = fp8plug.export_model(model).merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, before, atol=1e-4)
