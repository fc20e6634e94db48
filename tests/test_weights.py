"""Weights directories: HuggingFace's sharded safetensors layout, written by stage, read by name."""

from __future__ import annotations

import json

import pytest
import torch

from pipetrain import load_weights
from pipetrain.errors import ConfigError
from pipetrain.models.gpt import GPT
from pipetrain.paths import is_weights_dir
from pipetrain.weights import INDEX, WeightsDir, save_weights, shard_name


def gpt(seed=0, tie=False, device=None):
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return GPT(20, 8, n_layer=2, n_head=2, n_embd=16, tie=tie)


def test_which_save_paths_are_directories(tmp_path):
    assert is_weights_dir(tmp_path) and is_weights_dir(str(tmp_path / "new") + "/")
    assert is_weights_dir(tmp_path / "weights") and is_weights_dir(tmp_path / "run.v2")
    assert not is_weights_dir(tmp_path / "model.pt") and not is_weights_dir(tmp_path / "model.BIN")


def test_a_directory_round_trips_into_eager_and_meta_models_tied_weights_stored_once(tmp_path):
    model = gpt(tie=True)
    state = model.state_dict()
    shards = [{k: v for k, v in state.items() if k.startswith(("wte", "wpe", "blocks.0"))},
              {k: v for k, v in state.items() if not k.startswith(("wte", "wpe", "blocks.0", "head"))}]
    save_weights(tmp_path, shards)
    index = json.loads((tmp_path / INDEX).read_text())
    assert "head.weight" not in index["weight_map"] and index["weight_map"]["wte.weight"] == shard_name(0, 2)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for k, v in state.items() if k != "head.weight")
    other = load_weights(gpt(seed=1, tie=True), tmp_path)
    meta = load_weights(gpt(tie=True, device="meta"), tmp_path)
    for loaded in (other, meta):
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
        assert loaded.head.weight is loaded.wte.weight
    save_weights(tmp_path, [state])  # one shard now: the two of the first save are gone
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [shard_name(0, 1)]


def test_weights_that_do_not_fit_or_point_elsewhere_are_refused(tmp_path):
    save_weights(tmp_path / "w", [gpt().state_dict()])
    with pytest.raises(ConfigError, match="do not fit the model: .*missing"):
        load_weights(GPT(20, 8, n_layer=3, n_head=2, n_embd=16), tmp_path / "w")
    with pytest.raises(ConfigError, match="store 'wte.weight' with shape"):
        load_weights(GPT(21, 8, n_layer=2, n_head=2, n_embd=16), tmp_path / "w")
    with pytest.raises(ConfigError, match="neither model.safetensors.index.json nor model.safetensors"):
        WeightsDir(tmp_path)
    index = json.loads((tmp_path / "w" / INDEX).read_text())
    index["weight_map"]["wte.weight"] = "../outside.safetensors"
    (tmp_path / "w" / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="plain file names"):
        WeightsDir(tmp_path / "w")


def test_huggingface_reads_what_pipetrain_writes_and_the_other_way_round(tmp_path):
    transformers = pytest.importorskip("transformers")
    from pipetrain.models.hf import gpt2
    from pipetrain.weights import model_config_json

    torch.manual_seed(0)
    model = gpt2(input_shape=(10,), num_classes=23, n_layer=2, n_head=2, n_embd=16)
    state = model.state_dict()
    save_weights(tmp_path / "ours", [{k: v for k, v in state.items() if k != "lm_head.weight"}],
                 config=model_config_json(model))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    model.save_pretrained(tmp_path / "theirs")
    torch.manual_seed(1)
    fresh = gpt2(input_shape=(10,), num_classes=23, n_layer=2, n_head=2, n_embd=16)
    load_weights(fresh, tmp_path / "theirs")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
