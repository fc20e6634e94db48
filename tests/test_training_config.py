"""The training options are declared once (pipetrain.training.config): the parser of
`pipetrain train`, the fingerprint, the Python keywords and the checks are all built from there."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from pipetrain.commands.train import add_arguments, config_from_args
from pipetrain.errors import ConfigError
from pipetrain.initialiser import Init
from pipetrain.training.config import TrainConfig
from pipetrain.training.options import GROUPS, declared, flag_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_every_field_is_declared_with_help_and_every_flag_has_a_group():
    fields = dataclasses.fields(TrainConfig)
    assert [f.name for f, _ in declared(TrainConfig)] == [f.name for f in fields]
    for field, declaration in declared(TrainConfig):
        assert declaration.help.strip(), field.name
        if declaration.flags:
            assert declaration.group in GROUPS, field.name
            assert all(flag.help.strip() for flag in declaration.flags), field.name


def test_the_parser_holds_exactly_the_declared_flags_in_their_groups():
    parser = _parser()
    shown = {option: group.title for group in parser._action_groups for action in group._group_actions
             for option in action.option_strings}
    expected = {flag_name(field, flag): declaration.group for field, declaration in declared(TrainConfig)
                for flag in declaration.flags}
    assert {k: v for k, v in shown.items() if k not in ("-h", "--help")} == expected


def test_no_flags_give_the_declared_defaults():
    config = config_from_args(_parser().parse_args([]))
    assert config == dataclasses.replace(TrainConfig(), progress=config.progress)


def test_flags_set_their_fields():
    config = config_from_args(_parser().parse_args(
        ["--batch-size", "8", "--balance", "2,1", "--no-shuffle", "--init-from", "weights", "--resume",
         "--concrete-args", "use_cache=false"]))
    assert (config.batch_size, config.balance, config.shuffle, config.init, config.resume,
            config.concrete_args) == (8, [2, 1], False, Init("weights", path="weights"), True, {"use_cache": False})


@pytest.mark.parametrize("flags, init", [
    ([], None),
    (["--init", "eager"], None),
    (["--init", "meta"], Init("reset")),
    (["--init-from", "w"], Init("weights", path="w")),
    (["--init", "meta", "--init-from", "w"], Init("weights", path="w")),
    (["--init", "eager", "--init-from", "w"], Init("weights", path="w", on_meta=False)),
])
def test_the_init_flags_read_together_give_one_init(flags, init):
    assert config_from_args(_parser().parse_args(flags)).init == init


def test_a_python_value_of_init_becomes_its_init_when_the_configuration_is_made():
    assert TrainConfig(init="reset").init == Init("reset")
    assert dataclasses.replace(TrainConfig(init="w"), seed=1).init == Init("weights", path="w")
    with pytest.raises(ConfigError, match="init must be"):
        TrainConfig(init=3)


def test_the_fingerprint_holds_the_declared_fields_when_they_apply():
    plain = TrainConfig().fingerprint()
    assert {"model", "batch_size", "seed", "shuffle"} <= set(plain)
    assert not {"keep", "max_restarts", "precision", "loss_scale", "holdout", "stage_costs"} & set(plain)
    fp16 = TrainConfig(precision="fp16", holdout=0.1).fingerprint()
    assert fp16["precision"] == "fp16" and fp16["loss_scale_init"] == 65536.0 and fp16["holdout"] == 0.1


@pytest.mark.parametrize("argv", [["--translate-from-batch", "8", "--batch-size", "1"]])
def test_translate_from_batch_rewrites_the_optimizer(argv):
    config = config_from_args(_parser().parse_args(argv))
    assert config.optimizer.startswith("sgd:") and config.optimizer != TrainConfig().optimizer


def _keywords(stage: str) -> dict[str, dataclasses.Field]:
    return {declaration.keyword or field.name: field for field, declaration in declared(TrainConfig)
            if declaration.api == stage}


@pytest.mark.parametrize("stage", ["pipeline", "fit"])
def test_the_python_keywords_are_the_declared_ones(stage):
    import inspect

    from pipetrain import Pipeline

    function = Pipeline.__init__ if stage == "pipeline" else Pipeline.fit
    parameters = inspect.signature(function).parameters
    own = {"pipeline": {"self", "model", "loss_fn", "optimizer_options"}, "fit": {"self", "data", "callbacks"}}[stage]
    assert set(parameters) - own == set(_keywords(stage))
    assert parameters["timeout" if stage == "pipeline" else "keep"].default == (60.0 if stage == "pipeline" else 2)


def test_a_pipeline_keyword_reaches_the_config_and_an_unknown_one_is_refused():
    from torch import nn

    from pipetrain import Pipeline

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = Pipeline(model, balance=(2, 1), executor="emulate", timeout=5.0, receives="ahead", replicas=())
    assert (pipe._config.timeout, pipe._config.receives, pipe._config.replicas) == (5.0, "ahead", None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timout'; did you mean 'timeout'"):
        Pipeline(model, balance=[2, 1], executor="emulate", timout=5.0)
    with pytest.raises(TypeError, match="fit\\(\\) got an unexpected keyword argument 'batchsize'"):
        pipe.fit([], batchsize=4)


def _cli_error(*argv: str) -> str:
    import os
    import subprocess
    import sys

    code = "import sys; from pipetrain.cli import main; sys.exit(main(['train', *sys.argv[1:]]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    return result.stderr


@pytest.mark.parametrize("field, value, flag, message", [
    ("batch_size", 0, "--batch-size", "{} must be at least 1, got 0"),
    ("timeout", -1.0, "--timeout", "{} must be greater than 0, got -1"),
    ("replicas", [2, 0], "--replicas", "{} 2,0: every entry must be at least 1"),
    ("holdout", 1.5, "--holdout", "{} must be a fraction between 0 and 1 (e.g. 0.2), got 1.5"),
    ("receives", "later", "--receives", "unknown {} 'later'; choose one of auto, on-demand, ahead"),
])
def test_a_bad_value_names_the_field_in_python_and_the_flag_on_the_command_line(field, value, flag, message):
    from pipetrain.errors import ConfigError
    from pipetrain.training.validate import check_config

    with pytest.raises(ConfigError) as raised:
        check_config(dataclasses.replace(TrainConfig(), **{field: value}))
    assert str(raised.value) == message.format(field) and raised.value.options == (field,)
    if field in ("batch_size", "timeout"):  # the other values cannot be written as flags (argparse refuses them)
        text = {"batch_size": "0", "timeout": "-1"}[field]
        assert _cli_error(f"{flag}={text}") == f"pipetrain train: error: {message.format(flag)}\n"


def test_the_python_api_names_its_keywords():
    from torch import nn

    from pipetrain import Pipeline
    from pipetrain.errors import ConfigError

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="^unknown precision 'fp8'; choose one of fp32, bf16, fp16$"):
        Pipeline(model, balance=[2, 1], executor="emulate", precision="fp8")
    pipe = Pipeline(model, balance=[2, 1], executor="emulate")
    with pytest.raises(ConfigError, match="^batch_size must be at least 1, got 0$"):
        pipe.fit([(torch.zeros(4), 0)] * 4, batch_size=0)


def test_every_check_names_the_option_it_checks():
    from pipetrain.errors import ConfigError

    for field, declaration in declared(TrainConfig):
        if declaration.check is None:
            continue
        for bad in (-5, "no-such-choice", [-1]):
            try:
                declaration.check(field.name, bad)
            except ConfigError as error:
                assert error.options == (field.name,), (field.name, str(error))
            except TypeError:  # a value of another type: argparse's type= or the API's annotation refuses it
                pass
