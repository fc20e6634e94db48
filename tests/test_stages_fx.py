"""Tests of cutting arbitrary models with torch.fx: transparency, boundaries, plans, costs, errors."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.models import build_model, cross_entropy
from pipetrain.stages import measure_node_costs, normalize_plan, run_stages, split_model, trace_model


def pipelined(stages, x, y, loss_fn=cross_entropy):
    """Run ``stages`` as a pipeline executor does: each stage on detached copies of its inputs,
    gradients of the stage inputs handed back to the previous stage by hand."""
    inputs, outputs = [], []
    value = x
    for stage in stages:
        args = value if isinstance(value, tuple) else (value,)
        leaves = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
        value = stage(*leaves)
        inputs.append(leaves)
        outputs.append(value)
    loss = loss_fn(value, y)
    loss.backward()
    for s in range(len(stages) - 2, -1, -1):
        outs = outputs[s] if isinstance(outputs[s], tuple) else (outputs[s],)
        assert len(outs) == len(inputs[s + 1])
        pairs = [(o, leaf.grad) for o, leaf in zip(outs, inputs[s + 1]) if o.requires_grad and leaf.grad is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return value, loss


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def check_transparent(model: nn.Module, staged, x, y) -> None:
    model.zero_grad()
    expected_out = model(x)
    cross_entropy(expected_out, y).backward()
    expected = grads(model)
    model.zero_grad()
    out = run_stages(staged.stages, x)
    assert torch.equal(out, expected_out)
    out, _ = pipelined(staged.stages, x, y)
    assert torch.equal(out, expected_out)
    got = grads(model)
    assert got.keys() == expected.keys()
    for key in expected:  # same operations in the same order: bitwise equal
        assert torch.equal(got[key], expected[key]), key


def resnet() -> nn.Module:
    spec = "resnet-gn-skip:blocks=2/2,channels=8,groups=2"
    return build_model(spec, input_shape=(64,), num_classes=10, seed=0).double()


def gpt(**options) -> nn.Module:
    spec = "gpt:" + ",".join(f"{k}={v}" for k, v in {"n_layer": 4, "n_head": 2, "n_embd": 16, **options}.items())
    return build_model(spec, input_shape=(12,), num_classes=11, seed=0).double()


RESNET_CUTS = [
    {"stages": 2},
    {"stages": 3},
    {"stages": 5},
    {"split_at": ["layer1.1"]},
    {"split_at": ["layer1.1", "layer2.0.conv2"]},          # inside a block: its shortcut crosses
    {"split_at": ["layer1.0.norm1", "layer2.0.shortcut", "head"]},
    {"plan": [["stem", "layer1.0"], ["layer1.1", "layer2.0"], ["layer2.1", "head"]]},
]


@pytest.mark.parametrize("cut", RESNET_CUTS, ids=lambda c: str(c))
def test_resnet_with_skips_across_boundaries_is_transparent(cut):
    model = resnet()
    staged = split_model(model, **cut)
    torch.manual_seed(1)
    check_transparent(model, staged, torch.rand(6, 64, dtype=torch.float64), torch.arange(6))
    # the stem's output s (node "relu") is pooled next to the head: it crosses every boundary
    # before the pooling
    pooled_at = len(staged.boundaries) - 1 if staged.split_at[-1] == "head" else len(staged.boundaries)
    assert all("relu" in names for names in staged.boundaries[:pooled_at])


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_gpt_split_into_stages_is_transparent(stages):
    model = gpt()
    staged = split_model(model, stages=stages)
    assert len(staged) == stages
    torch.manual_seed(2)
    x = torch.randint(0, 11, (3, 12))
    check_transparent(model, staged, x, torch.randint(0, 11, (3, 12)))


def test_gpt_cut_inside_blocks_passes_several_tensors():
    model = gpt()
    staged = split_model(model, split_at=["blocks.1.attn", "blocks.2.mlp", "ln_f"])
    assert [len(b) for b in staged.boundaries] == [2, 2, 1]  # residual stream + normalised input
    x = torch.randint(0, 11, (2, 12))
    check_transparent(model, staged, x, torch.randint(0, 11, (2, 12)))


def test_variable_sequence_length_through_stages():
    model = gpt()
    staged = split_model(model, stages=3)
    for t in (1, 5, 12):
        x = torch.randint(0, 11, (2, t))
        assert run_stages(staged.stages, x).shape == (2, t, 11)
        check_transparent(model, staged, x, torch.randint(0, 11, (2, t)))


class Skips(nn.Module):
    """Values of several dtypes crossing boundaries: an int tensor, a skip, a non-tensor default."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=torch.float64), persistent=False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x, ids, mask=None, factor: float = 2.0):
        h = self.a(x) + self.emb(ids)
        g = torch.tanh(self.b(h)) * self.scale
        if mask is not None:
            g = g * mask
        n = ids.shape[-1]
        return self.c(g) + h[..., :3] * factor + ids.double()[..., None] / n


def test_int_tensors_skips_buffers_and_defaults():
    model = Skips().double()
    staged = split_model(model, split_at=["b", "c"])
    # ids (int64) and h (node "add") cross both boundaries; n = ids.shape[-1] is recomputed
    assert staged.boundaries == [["ids", "add"], ["ids", "add", "mul"]]
    assert list(__import__("inspect").signature(staged.stages[0].forward).parameters) == ["x", "ids"]
    x, ids = torch.rand(2, 5, 4, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    y = torch.randint(0, 3, (2, 5))
    model.zero_grad()
    cross_entropy(model(x, ids), y).backward()
    expected = grads(model)
    model.zero_grad()
    out, _ = pipelined(staged.stages, (x, ids), y)
    torch.testing.assert_close(out, model(x, ids), rtol=0, atol=0)
    for key, value in grads(model).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-12, atol=1e-15)
    # the non-persistent buffer stays out of the state dict; the unused module is kept for saving
    assert all("scale" not in k for mapping in staged.key_map for k in mapping)
    assert set(staged.unused) == {"unused.weight", "unused.bias"}
    merged = staged.merge_state_dict([s.state_dict() for s in staged.stages])
    assert list(merged) == list(model.state_dict())
    Skips().double().load_state_dict(merged, strict=True)


def test_concrete_args_override_defaults():
    model = Skips().double()
    staged = split_model(model, stages=2, concrete_args={"factor": 0.0})
    x, ids = torch.rand(1, 3, 4, dtype=torch.float64), torch.randint(0, 7, (1, 3))
    assert torch.equal(run_stages(staged.stages, x, ids), model(x, ids, None, 0.0))


def test_stage_modules_are_the_models_own_and_deepcopy():
    model = resnet()
    staged = split_model(model, stages=3)
    assert staged.stages[0].get_submodule("layer1.0.conv1") is model.layer1[0].conv1
    for mapping in staged.key_map:
        assert all(k == v for k, v in mapping.items())  # stage keys are the model's keys
    restored = pickle.loads(pickle.dumps(staged.stages[2]))
    assert restored.state_dict().keys() == staged.stages[2].state_dict().keys()
    clone = copy.deepcopy(staged.stages[1])
    x = torch.rand(2, 64, dtype=torch.float64)
    middle = staged.stages[0](x)
    assert all(torch.equal(a, b) for a, b in zip(clone(*middle), staged.stages[1](*middle)))
    assert torch.equal(restored(*staged.stages[1](*middle)), staged.stages[2](*staged.stages[1](*middle)))
    # training mode follows .train()/.eval() of the stage
    staged.stages[0].eval()
    assert not model.stem_norm.training


def test_saved_state_dict_round_trip():
    model = gpt()
    staged = split_model(model, stages=3)
    for stage in staged.stages:
        for p in stage.parameters():
            p.data.add_(1.0)
    merged = staged.merge_state_dict([s.state_dict() for s in staged.stages])
    fresh = gpt()
    fresh.load_state_dict(merged, strict=True)
    x = torch.randint(0, 11, (2, 12))
    assert torch.equal(fresh(x), model(x))
    parts = staged.split_state_dict(model.state_dict())
    assert [set(p) for p in parts] == [set(s.state_dict()) for s in staged.stages]


def test_tied_embedding_across_stages_is_recorded():
    model = gpt(tie="true")
    staged = split_model(model, stages=2)
    assert [(t.name, t.stages) for t in staged.tied] == [("wte.weight", (0, 1))]
    assert staged.stages[0].wte.weight is staged.stages[1].head.weight  # one parameter, two holders
    x = torch.randint(0, 11, (2, 12))
    check_transparent(model, staged, x, torch.randint(0, 11, (2, 12)))


def test_tied_weights_inside_one_stage_are_aliases():
    model = gpt(tie="true", n_layer=1)
    staged = split_model(model, stages=1)
    assert staged.aliases == {"head.weight": "wte.weight"} and staged.tied == []
    merged = staged.merge_state_dict([staged.stages[0].state_dict()])
    assert merged["head.weight"] is merged["wte.weight"]
    assert [t.stages for t in split_model(model, split_at=["blocks.0.mlp"]).tied] == [(0, 1)]


class TupleCross(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        halves = self.a(x).chunk(2, dim=-1)
        y = self.b(halves[1])
        return y + halves[0]


def test_parts_of_a_tuple_cross_not_the_tuple():
    model = TupleCross().double()
    staged = split_model(model, split_at=["b"])
    assert staged.boundaries == [["getitem", "getitem_1"]]  # the two halves, not the tuple
    x = torch.rand(3, 4, dtype=torch.float64)
    assert torch.equal(run_stages(staged.stages, x), model(x))


class ListCross(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        parts = self.a(x).split(2, dim=-1)
        y = self.b(x)
        return torch.cat(parts, dim=-1) + y


def test_a_tuple_crossing_a_boundary_is_named_at_run_time():
    staged = split_model(ListCross(), split_at=["b"])
    with pytest.raises(ConfigError) as info:
        run_stages(staged.stages, torch.rand(2, 4))
    message = str(info.value)
    assert "'split'" in message and "tuple, not a tensor" in message and "Move the split point" in message


def test_plan_forms_agree():
    model = gpt()
    expected = split_model(model, split_at=["blocks.1", "blocks.3"]).split_at
    plans = [
        [["wte", "wpe", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "ln_f", "head"]],
        {"wte": 0, "blocks.0": 0, "blocks.2": 1, "blocks.1": 1, "head": 2, "blocks.3": 2},
        "wte,blocks.0|blocks.1,blocks.2|blocks.3,head",
        '{"stages": [["wte"], ["blocks.1"], ["blocks.3"]]}',
    ]
    for plan in plans:
        staged = split_model(model, plan=plan)
        assert staged.split_at == expected, plan
    assert normalize_plan("a,b|c") == [["a", "b"], ["c"]]


def test_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('[["wte", "blocks.0"], ["blocks.1", "head"]]')
    assert split_model(gpt(), plan=str(path)).split_at == ["blocks.1"]


@pytest.mark.parametrize(
    "plan, words",
    [([["wte", "blocks.2"], ["blocks.1", "head"]], ["'blocks.2' in stage 0", "runs in stage 1"]),
     ([["wte"], ["blocks.0", "head"], ["ln_f"]], ["'head' in stage 1"]),
     ({"wte": 0, "head": 2}, ["stage number 0, 1, ..., S-1", "[0, 2]"]),
     ([["wte"], []], ["stage 1 names no module"]),
     ([["wte"], ["blockz.1"]], ["plan module 'blockz.1'", "did you mean"])],
)
def test_plan_errors(plan, words):
    with pytest.raises(ConfigError) as info:
        split_model(gpt(), plan=plan)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_costs_move_the_cut():
    model = gpt()
    by_params = split_model(model, stages=2)
    assert by_params.split_at == ["blocks.2"]
    costs = {"blocks.0": 1, "blocks.1": 1, "blocks.2": 1, "blocks.3": 1, "head": 3.5}
    heavy_head = split_model(model, stages=2, costs=costs)
    assert heavy_head.split_at[0] in ("ln_f", "head")  # (4, 3.5) beats (3, 4.5)
    times = measure_node_costs(model, torch.randint(0, 11, (2, 12)), repeats=1)
    assert times and all(v >= 0 for v in times.values())
    assert len(split_model(model, stages=3, costs=times)) == 3
    with pytest.raises(ConfigError, match="overlap"):
        split_model(model, stages=2, costs={"blocks.0": 1, "blocks.0.attn": 1})
    with pytest.raises(ConfigError, match="costs only guide an automatic split"):
        split_model(model, split_at=["blocks.1"], costs={"head": 1})
    with pytest.raises(ConfigError, match="cost key 'blok'"):
        split_model(model, stages=2, costs={"blok": 1})


def test_sequential_nested_split_and_costs():
    model = build_model("resmlp:depth=3,width=8", input_shape=(64,), num_classes=10, seed=0).double()
    staged = split_model(model, split_at=["2", "3.fc2"])
    assert staged.split_at == ["2", "3.fc2"] and staged.balance is None
    check_transparent(model, staged, torch.rand(4, 64, dtype=torch.float64), torch.arange(4))
    top = split_model(model, split_at=["2"])
    assert top.balance == [2, 3]
    weighted = split_model(model, stages=2, costs={"0": 1, "1": 1, "2": 1, "3": 1, "4": 10})
    assert weighted.balance == [4, 1]


def test_automatic_units_open_the_biggest_module():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

        def forward(self, x):
            return self.body(x)

    staged = split_model(Wrapped(), stages=3)
    assert len(staged) == 3 and all(n.startswith("body.") for n in staged.split_at)


@pytest.mark.parametrize(
    "split_at, words",
    [(["block.1"], ["no module of that name", "did you mean 'blocks.1'", "top-level modules: wte"]),
     (["blocks.1.attn.qkv.weight"], ["'blocks.1.attn.qkv'"]),
     (["blocks.2", "blocks.1"], ["'blocks.1' runs before 'blocks.2'", "blocks.1,blocks.2"]),
     (["blocks.1", "blocks.1.ln1"], ["same operation", "empty"]),
     (["wte"], ["first module", "stage 0 would be empty"]),
     (["blocks.1.attn.qkv.weight"], ["did you mean"])],
)
def test_split_point_errors(split_at, words):
    with pytest.raises(ConfigError) as info:
        split_model(gpt(), split_at=split_at)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_split_errors_inside_leaves_and_unused_modules():
    with pytest.raises(ConfigError, match="'blocks.1.attn.qkv' lies inside 'blocks.1.attn'"):
        split_model(gpt(), split_at=["blocks.1.attn.qkv"], leaf_modules=["blocks.1.attn"])
    model = Skips()
    with pytest.raises(ConfigError, match="does no work"):
        split_model(model, split_at=["unused"])
    with pytest.raises(ConfigError, match="4 pipeline units"):
        split_model(model, stages=5)
    with pytest.raises(ConfigError, match="balance counts the top-level modules"):
        split_model(model, balance=[1, 1])
    with pytest.raises(ConfigError, match="only one of"):
        split_model(model, split_at=["b"], plan=[["a"], ["b"]])
    with pytest.raises(ConfigError, match="disagrees"):
        split_model(model, stages=3, split_at=["b"])


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:
            return self.l(x)
        return -self.l(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.inner = Branchy()
        self.b = nn.Linear(3, 3)

    def forward(self, x):
        return self.b(self.inner(self.a(x)))


def test_untraceable_module_is_named_and_can_be_a_leaf():
    with pytest.raises(ConfigError) as info:
        split_model(Outer(), stages=2)
    message = str(info.value)
    for word in ("module 'inner'", "Branchy.forward", "if x.sum() > 0", "leaf_modules=['inner']", "a, b",
                 "list of stage modules"):
        assert word in message, word
    for leaf in ("inner", "Branchy", Branchy):
        staged = split_model(Outer(), stages=2, leaf_modules=[leaf])
        assert len(staged) == 2
    with pytest.raises(ConfigError, match="lies inside 'inner'"):
        split_model(Outer(), split_at=["inner.l"], leaf_modules=["inner"])
    with pytest.raises(ConfigError, match="leaf module 'Branch'.*'Branchy'"):
        split_model(Outer(), stages=2, leaf_modules=["Branch"])


def test_untraceable_root_suggests_stage_modules():
    with pytest.raises(ConfigError) as info:
        split_model(Branchy(), stages=2)
    message = str(info.value)
    assert "Branchy.forward itself" in message and "list of stage modules" in message


def test_a_single_layer_cannot_be_split():
    with pytest.raises(ConfigError, match="1 pipeline units|stages=1 or fewer"):
        split_model(nn.Linear(3, 3), stages=2)
    assert len(split_model(nn.Linear(3, 3), stages=1)) == 1


def test_trace_model_keeps_the_models_modules():
    model = gpt(n_layer=1)
    traced = trace_model(model)
    assert traced.get_submodule("blocks.0.attn.qkv") is model.blocks[0].attn.qkv


class Encoded(nn.Module):
    """Token embedding, an nn.TransformerEncoder of four layers, a pooled head."""

    def __init__(self, masked: bool = False):
        super().__init__()
        self.masked = masked
        self.embed = nn.Embedding(11, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        h = self.embed(ids)
        if self.masked:
            h = self.encoder(h, mask=nn.Transformer.generate_square_subsequent_mask(12))
        else:
            h = self.encoder(h)
        return self.head(h.mean(dim=1))


@pytest.mark.parametrize("cut", [{"stages": 2}, {"stages": 4}, {"split_at": ["encoder.layers.1", "encoder.norm"]}],
                         ids=str)
def test_transformer_encoder_is_cut_between_its_layers_transparently(cut):
    model = Encoded().double()
    staged = split_model(model, **cut)
    assert all(name.startswith(("encoder.", "head")) for name in staged.split_at)
    x, y = torch.randint(0, 11, (3, 12)), torch.tensor([0, 1, 2])
    check_transparent(model, staged, x, y)
    model.eval()
    with torch.no_grad():
        assert torch.equal(run_stages(staged.stages, x), model(x))


def test_units_of_an_encoder_are_its_layers_with_or_without_a_mask():
    staged = split_model(Encoded(), stages=3)
    assert staged.split_at == ["encoder.layers.1", "encoder.layers.3"]
    masked = Encoded(masked=True).double()
    staged = split_model(masked, split_at=["encoder.layers.2"])
    x, y = torch.randint(0, 11, (3, 12)), torch.tensor([0, 1, 2])
    check_transparent(masked, staged, x, y)
    assert split_model(masked, stages=4).split_at == ["encoder.layers.1", "encoder.layers.2", "encoder.layers.3"]
    assert split_model(Encoded(), stages=2, leaf_modules=["encoder"]).split_at == ["encoder"]  # whole
    with pytest.raises(ConfigError) as info:
        split_model(Encoded(), split_at=["encoder.layers.2"], leaf_modules=["encoder"])
    message = str(info.value)
    assert "lies inside 'encoder'" in message and "made one by leaf_modules" in message
    with pytest.raises(ConfigError) as info:
        split_model(Encoded(), stages=4, leaf_modules=["encoder"])
    message = str(info.value)
    assert "3 pipeline units (embed, encoder, head)" in message and "stages=3 or fewer" in message
    assert "inside" not in message  # no advice that the other errors contradict


def test_leaf_advice_names_the_option():
    from pipetrain.errors import naming_options_as

    with pytest.raises(ConfigError) as info:
        split_model(Outer(), stages=2)
    assert "leaf_modules=['inner']" in str(info.value) and "cannot be cut inside" in str(info.value)
    assert "leaf_modules" in info.value.options
    with naming_options_as("flag"):
        assert "--leaf-modules inner" in str(info.value)
    with pytest.raises(ConfigError, match=r"made one by leaf_modules\)"):
        split_model(Outer(), split_at=["inner.l"], leaf_modules=["inner"])


def test_pipeline_takes_leaf_modules_and_concrete_args():
    from pipetrain import Pipeline

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.inner, self.b = nn.Linear(3, 3), Branchy(), nn.Linear(3, 2)

        def forward(self, x, scale=1.0):
            return self.b(self.inner(self.a(x)) * scale)

    with pytest.raises(ConfigError, match=r"leaf_modules=\['inner'\]"):
        Pipeline(Scaled(), executor="emulate", stages=2)
    model = Scaled()
    pipe = Pipeline(model, executor="emulate", split_at=["b"], leaf_modules=["inner"], concrete_args={"scale": 2.0},
                    microbatches=1)
    x = torch.randn(4, 3)
    assert torch.equal(pipe.staged(x), model(x, scale=2.0))
    assert len(pipe.train([(x, torch.tensor([0, 1, 0, 1]))])) == 1


# -- nn.Transformer and its stacks, with masks -----------------------------------------------------


class Translator(nn.Module):
    """A user's seq2seq module around nn.Transformer: embeddings, masks, an output head."""

    def __init__(self, padding=True, causal_hint=None, source_mask=False, norm_first=False):
        super().__init__()
        self.padding, self.causal_hint, self.source_mask = padding, causal_hint, source_mask
        self.src_embed, self.tgt_embed = nn.Embedding(11, 8), nn.Embedding(11, 8)
        self.transformer = nn.Transformer(8, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                                          dropout=0.0, batch_first=True, norm_first=norm_first)
        self.head = nn.Linear(8, 11)

    def forward(self, src, tgt):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device, dtype=torch.float64)
        source = nn.Transformer.generate_square_subsequent_mask(src.size(1), dtype=torch.float64)
        padding = src == 0
        h = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=causal,
                             src_mask=source if self.source_mask else None,
                             src_key_padding_mask=padding if self.padding else None,
                             memory_key_padding_mask=padding if self.padding else None, tgt_is_causal=self.causal_hint)
        return self.head(h)


def executed(stages, x, y):
    """The stages run by stage executors (as the emulator and the runtime run them): outputs handed
    on, constants marked, input gradients handed back."""
    from pipetrain.execution import StageExecutor

    last = len(stages) - 1
    executors = [StageExecutor(s, st, None, loss_fn=cross_entropy if s == last else None) for s, st in enumerate(stages)]
    value, constants = x, 0
    for executor in executors:
        value = executor.forward(0, 0, value, target=y if executor.is_last else None, constants=constants)
        constants = executor.last_constants
    grads = None
    for executor in reversed(executors):
        grads = executor.backward(0, 0, grads)
    out = {}
    for executor in executors:
        out.update(executor.grads)
    return value[0], out


OPTIONS = [{}, {"padding": False}, {"causal_hint": True}, {"source_mask": True}, {"norm_first": True}]


@pytest.mark.filterwarnings("ignore:.*mismatched")
@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
@pytest.mark.parametrize("options", OPTIONS, ids=["padded", "unpadded", "hinted", "source-mask", "norm-first"])
def test_a_transformer_is_cut_inside_its_encoder_and_decoder_transparently(options):
    torch.manual_seed(0)
    model = Translator(**options).double()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(1, 11, (3, 7), generator=g), torch.randint(1, 11, (3, 5), generator=g)
    src[0, -2:] = 0
    y = torch.randint(0, 11, (3, 5), generator=g)
    model.zero_grad()
    expected = model(src, tgt)
    loss = cross_entropy(expected, y)
    loss.backward()
    reference = grads(model)
    for stages in (2, 4, 6):
        staged = split_model(model, stages=stages)
        if stages == 4:
            assert [n.rsplit(".", 1)[0] for n in staged.split_at] == [
                "transformer.encoder.layers", "transformer.decoder.layers", "transformer.decoder.layers"]
        model.zero_grad()
        assert torch.equal(run_stages(staged.stages, src, tgt), expected)
        got_loss, got = executed(staged.stages, (src, tgt), y)
        assert torch.equal(got_loss, loss)
        for key in reference:
            assert torch.equal(got[key], reference[key]), (stages, key)


@pytest.mark.filterwarnings("ignore:.*mismatched")
def test_the_causal_mask_is_detected_at_run_time_in_each_stage():
    torch.manual_seed(0)
    model = Translator(padding=False).double()
    staged = split_model(model, split_at=["transformer.decoder.layers.1"])
    detections = [n for stage in staged.stages for n in stage.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "__name__", "") == "decoder_is_causal"]
    assert len(detections) == 2  # one per decoder layer, each in its own stage: no bool crosses
    assert "triu" in staged.boundaries[0]  # the mask itself crosses (a tensor)
    src, tgt = torch.randint(1, 11, (2, 6)), torch.randint(1, 11, (2, 4))
    model.eval()  # eval mode without a key padding mask: torch's fast paths do not differ either
    with torch.no_grad():
        assert torch.equal(run_stages(staged.stages, src, tgt), model(src, tgt))
    not_causal = Uncausal(padding=False).double()
    assert torch.equal(run_stages(split_model(not_causal, stages=3).stages, src, tgt), not_causal(src, tgt))


class Uncausal(Translator):
    """A target mask that is not the causal one: the layers must not be told it is."""

    def forward(self, src, tgt):
        mask = torch.zeros((tgt.size(1), tgt.size(1)), dtype=torch.float64, device=tgt.device)
        return self.head(self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask))
