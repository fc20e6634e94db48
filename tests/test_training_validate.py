"""`pipetrain train` reports a bad argument before it imports PyTorch (`pipetrain.training.validate`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipetrain.errors import PipetrainError
from pipetrain.training.config import TrainConfig
from pipetrain.training.validate import BALANCE_BY, DATA_NAMES, EXECUTORS, MODEL_NAMES, NONFINITE, check_config


def test_the_names_known_without_pytorch_are_those_of_the_registries():
    from pipetrain.data import DATASETS
    from pipetrain.execution.nonfinite import NONFINITE as executor_modes
    from pipetrain.models import MODELS
    from pipetrain.training.cutting import BALANCE_BY as setup_balance_by
    from pipetrain.training.setup import EXECUTORS as setup_executors

    assert BALANCE_BY == setup_balance_by
    assert set(MODEL_NAMES) == set(MODELS)
    assert set(DATA_NAMES) == set(DATASETS)
    assert NONFINITE == executor_modes and EXECUTORS == setup_executors


def test_every_optim_name_loads_lazily():
    import pipetrain.optim as optim

    for name in optim.__all__:
        assert getattr(optim, name) is not None, name


def _train(*argv):
    code = ("import sys; from pipetrain.cli import main; status = main(['train', *sys.argv[1:]]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(status)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60)


def test_a_misspelt_option_does_not_import_pytorch():
    # argparse ends the process (SystemExit 2) before the print: look at the modules another way
    code = ("import sys, atexit; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules)); "
            "from pipetrain.cli import main; main(['train', '--no-such-option'])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("pipetrain train: error: unrecognized arguments: --no-such-option "
                             "(`pipetrain train --help` lists the options)\n")
    assert "torch imported: False" in result.stdout


def test_a_misspelt_option_gets_the_closest_one(capsys):
    from pipetrain.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["train", "--optimiser", "sgd:lr=0.1"])
    assert caught.value.code == 2
    assert "unrecognized arguments: --optimiser sgd:lr=0.1; did you mean --optimizer for --optimiser?" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "pipedrem"], "unknown schedule 'pipedrem' (did you mean pipedream"),
    (["--model", "mlpp"], "unknown model 'mlpp'"),
    (["--data", "digitz"], "unknown data set 'digitz'"),
    (["--test-data", "digitz"], "unknown data set 'digitz'"),
    (["--optimizer", "sdg:lr=0.1"], "unknown optimizer 'sdg'"),
    (["--optimizer", "sgd:lr=0.1,momentun=0.9"], "unknown option 'momentun' for optimizer 'sgd'"),
    (["--optimizer", "adam:lr=1e-3", "--compensation", "sc"], "spike compensation is defined for momentum SGD only"),
    (["--compensation", "sx"], "unknown delay compensation 'sx'"),
    (["--compensation", "sc+dlr0"], "the reference delay D* must be > 0"),
    (["--compensation", "sc+dts0"], "the reference delay D* must be > 0"),
    (["--compensation", "dlr+dts"], "names both dlr and dts"),
    (["--optimizer", "adam:lr=1e-3", "--compensation", "lwp+dts"], "scales the momentum of momentum SGD"),
    (["--optimizer", "sgd:lr=0.1", "--compensation", "dts"], "needs 0 < momentum < 1"),
    (["--compensation", "sc+dtsf0"], "the reference delay D* must be > 0"),
    (["--compensation", "dts+dtsf"], "names both dts and dtsf"),
    (["--optimizer", "adam:lr=1e-3", "--compensation", "lwp+dtsf"], "rate-following delay time scaling"),
    (["--optimizer", "sgd:lr=0.1", "--compensation", "dtsf4"], "needs 0 < momentum < 1"),
    (["--compensation", "sc+dtt0"], "the reference delay D* must be > 0"),
    (["--optimizer", "adam:lr=1e-3", "--compensation", "lwp+dtt"], "delay time scaling (dtt) scales the momentum"),
    (["--optimizer", "sgd:lr=0.1", "--compensation", "dtt"], "needs 0 < momentum < 1"),
    (["--lr-schedule", "cosin:total=10"], "unknown lr schedule 'cosin'"),
    (["--policy", "stashed"], "unknown --policy 'stashed'"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--steps", "2", "--epochs", "1"], "give either --steps or --epochs, not both"),
    (["--epochs", "0"], "--epochs must be greater than 0"),
    (["--plan", "no-such-plan.json"], "cannot read plan 'no-such-plan.json'"),
    (["--recompute", "stage:x"], "unknown --recompute 'stage:x'; write none, stage (every stage) or stage:LIST"),
    (["--executor", "emulate", "--checkpoint-dir", "ck"], "checkpoints are written by the distributed runtime"),
    (["--resume"], "--resume needs --checkpoint-dir"),
])
def test_a_bad_value_is_reported_before_pytorch_is_imported(argv, message):
    result = _train(*argv)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "torch imported: False" in result.stdout


def test_the_api_gets_the_same_checks():
    with pytest.raises(PipetrainError, match="unknown on_nonfinite 'ignore'") as raised:  # Python's name for it
        check_config(TrainConfig(on_nonfinite="ignore"))
    assert raised.value.options == ("on_nonfinite",)
    check_config(TrainConfig(on_nonfinite="off"))  # for benchmarks: accepted by the configuration


def test_only_rank_0_checks_the_files_it_alone_writes(tmp_path):
    (tmp_path / "file").write_text("")
    config = TrainConfig(save=str(tmp_path / "file" / "model.pt"))
    with pytest.raises(PipetrainError, match="^save '"):
        check_config(config, rank=0)
    check_config(config, rank=1)  # other ranks of a torchrun job write no --save
