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
    assert is_weights_dir(tmp_path / "weights") and is_weights_dir(str(tmp_path / "run.v2") + "/")
    assert not is_weights_dir(tmp_path / "model.pt") and not is_weights_dir(tmp_path / "model.BIN")
    assert not is_weights_dir(tmp_path / "model.safetensors")  # one file (a suffix names a file)


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


def _encoder():
    """The user's own model: a stack of torch's Transformer encoder layers and a head."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 16, 3))


def test_save_to_a_safetensors_path_writes_one_gathered_file_that_both_readers_take(tmp_path, monkeypatch):
    import safetensors.torch
    from torch.utils.data import TensorDataset

    from pipetrain import Pipeline

    monkeypatch.chdir(tmp_path)
    data = TensorDataset(torch.randn(48, 4, 16), torch.randint(0, 3, (48,)))
    model = _encoder()
    Pipeline(model, split_at=["1"], executor="emulate").fit(data, steps=2, batch_size=12, quiet=True,
                                                             save="out/model.safetensors")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]  # one file, no temporary
    trained = model.state_dict()
    stored = safetensors.torch.load_file("out/model.safetensors")
    assert sorted(stored) == sorted(trained) and all(torch.equal(stored[k], trained[k]) for k in trained)
    again = load_weights(_encoder(), "out/model.safetensors")
    assert all(torch.equal(v, trained[k]) for k, v in again.state_dict().items())


def test_save_with_a_suffix_that_names_no_form_is_refused_before_training(tmp_path, monkeypatch):
    from torch.utils.data import TensorDataset

    from pipetrain import Pipeline

    monkeypatch.chdir(tmp_path)
    model = _encoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = Pipeline(model, split_at=["1"], executor="emulate")
    with pytest.raises(ConfigError, match=r"^save 'out.txt': '.txt' names no form of saved weights; give a directory "
                                          r"\(a path without a suffix, or ending in /\), one torch.save file \(.pt, "
                                          r".pth, .bin, .ckpt\) or one safetensors file \(.safetensors\)$"):
        pipe.fit(TensorDataset(torch.randn(24, 4, 16), torch.randint(0, 3, (24,))), steps=1, batch_size=12,
                 save="out.txt")
    assert list(tmp_path.iterdir()) == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_runtime_gathers_a_safetensors_save_into_the_emulators_file(tmp_path, monkeypatch):
    import safetensors.torch

    from pipetrain.cli import main

    monkeypatch.chdir(tmp_path)
    run = ["train", "--model", "mlp:depth=2,width=16", "--data", "synthetic:features=8,classes=3,samples=48",
           "--stages", "2", "--balance", "2,1", "--steps", "2", "--batch-size", "12", "--quiet", "--no-progress"]
    for executor in ("emulate", "distributed"):
        assert main([*run, "--executor", executor, "--save", f"{executor}.safetensors"]) == 0
    emulated, distributed = (safetensors.torch.load_file(f"{e}.safetensors") for e in ("emulate", "distributed"))
    assert sorted(emulated) == sorted(distributed) and all(torch.equal(emulated[k], distributed[k]) for k in emulated)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["distributed.safetensors", "emulate.safetensors"]
