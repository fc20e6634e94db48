"""Output paths are checked before any work, by every command (`pipetrain.paths`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.errors import ConfigError
from pipetrain.paths import IMAGE, JSON, TEXT, check_output_dir, check_output_file, check_outputs

PROFILE = str(Path(__file__).parent / "data" / "pipedream-profiles" / "alexnet.txt")


def test_missing_directories_are_made_in_the_working_directory_elsewhere_only_the_last(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    check_output_file(tmp_path / "a" / "model.pt", "--save")  # its own directory: made by the writer
    check_output_dir(tmp_path / "c", "--out")
    with pytest.raises(ConfigError, match=f"'{tmp_path / 'x'}' does not exist; outside the working directory"):
        check_output_file(tmp_path / "x" / "y" / "model.pt", "--save")  # a typo would become a tree
    with pytest.raises(ConfigError, match=f"'{tmp_path / 'x'}' does not exist"):
        check_output_dir(tmp_path / "x" / "y", "--checkpoint-dir")
    monkeypatch.chdir(tmp_path)
    check_output_file("a/b/model.pt", "--save")  # below the working directory: every level
    check_output_dir(tmp_path / "c" / "d", "--out")
    assert sorted(os.listdir(tmp_path)) == ["elsewhere"]  # no directory made, no probe left behind


@pytest.mark.parametrize("option, path, form, message", [
    ("--plot", "o/p.txt", IMAGE, "--plot 'o/p.txt': --plot writes a picture, named by its suffix (.png, .pdf, "),
    ("--plot", "o/p", IMAGE, "there is none: use e.g. 'o/p.png'"),
    ("--trace", "o/t.png", JSON, "--trace 'o/t.png': --trace writes JSON, named by its suffix (.json); '.png' is not "
                                 "one: use e.g. 'o/t.json'"),
    ("--csv", "o/s.json", TEXT, "'.json' is not one: use e.g. 'o/s.csv'"),
])
def test_an_output_named_for_another_format_is_refused(option, path, form, message):
    with pytest.raises(ConfigError) as caught:
        check_outputs(files={option: path}, formats={option: form})
    assert message in str(caught.value)
    check_outputs(files={option: os.path.splitext(path)[0] + form.suffixes[-1].upper()}, formats={option: form})
    check_outputs(files={option: None}, formats={option: form})  # not requested: nothing to check


@pytest.mark.parametrize("make, kind, message", [
    (lambda t: t, "file", "is a directory"),
    (lambda t: (t / "f").write_text("x") and t / "f" / "model.pt", "file", "is a file, not a directory"),
    (lambda t: (t / "f").write_text("x") and t / "f" / "x" / "y" / "model.pt", "file", "is a file, not a directory"),
    (lambda t: (t / "f").write_text("x") and t / "f", "directory", "is a file, not a directory"),
])
def test_an_unwritable_path_is_named_with_its_option(tmp_path, make, kind, message):
    path = make(tmp_path)
    check = check_output_file if kind == "file" else check_output_dir
    with pytest.raises(ConfigError, match=message) as caught:
        check(path, "--opt")
    assert str(caught.value).startswith(f"--opt {str(path)!r}")


def test_a_read_only_file_system_is_found(tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    with pytest.raises(ConfigError, match="cannot create a file in '/proc/self'"):
        check_output_file("/proc/self/model.pt", "--save")


def test_a_directory_that_cannot_be_created_is_named_in_a_sentence(tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    result = _command(tmp_path, "train", "--save", "/proc/new/m.pt")
    assert result.returncode == 2 and result.stderr.startswith(
        "pipetrain train: error: --save '/proc/new/m.pt' cannot be written: cannot create '/proc/new' in '/proc' ("
    ), result.stderr
    assert result.stderr.rstrip().endswith("); choose a writable path")


def test_which_save_paths_name_which_form():
    from pipetrain.paths import check_save, is_safetensors_file, is_weights_dir

    for path in ("out", "out/", "runs/v1.2/", "m.pt", "m.BIN", "m.safetensors"):
        check_save(path, "--save")
    assert is_weights_dir("runs/v1.2/") and not is_weights_dir("m.safetensors") and is_safetensors_file("o/m.safetensors")
    for path in ("out.txt", "runs/v1.2", "m.json"):
        with pytest.raises(ConfigError, match="names no form of saved weights"):
            check_save(path, "--save")


def test_two_outputs_on_one_path_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--save and --report-json both name"):
        check_outputs(files={"--save": str(tmp_path / "x"), "--report-json": str(tmp_path / ".." / tmp_path.name / "x"),
                             "--plot": None})


def _command(tmp_path, *argv):
    """Run `pipetrain ARGV` in a fresh interpreter; also says whether PyTorch was imported."""
    code = ("import sys; from pipetrain.cli import main; status = main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(status)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


@pytest.mark.parametrize("argv, option", [
    (["train", "--steps", "2", "--save", "FILE/model.pt"], "--save"),
    (["train", "--steps", "2", "--report-json", "FILE/r.json"], "--report-json"),
    (["train", "--steps", "2", "--trace", "FILE/t.json"], "--trace"),
    (["train", "--steps", "2", "--plot", "FILE/p.png"], "--plot"),
    (["train", "--steps", "2", "--checkpoint-dir", "FILE", "--checkpoint-every", "1"], "--checkpoint-dir"),
    (["profile", "--out", "FILE/p.json"], "--out"),
    (["pb", "--out", "FILE"], "--out"),
])
def test_every_command_refuses_an_unwritable_output_before_importing_pytorch(tmp_path, argv, option):
    (tmp_path / "FILE").write_text("a file where a directory should be")
    result = _command(tmp_path, *argv)
    assert result.returncode == 2, result.stderr
    assert f"error: {option} 'FILE" in result.stderr and "Traceback" not in result.stderr
    assert "torch imported: False" in result.stdout  # nothing was trained, measured or studied


@pytest.mark.parametrize("argv, option, written", [
    (["schedule", "1f1b", "--csv", "ok.csv", "--plot", "FILE/x.png"], "--plot", "ok.csv"),
    (["schedule", "1f1b", "--programs", "ok.json", "--trace", "FILE/x.json"], "--trace", "ok.json"),
    (["schedule", "1f1b", "--plot", "ok.png", "--csv", "FILE/x.csv"], "--csv", "ok.png"),
    (["schedule", "1f1b", "--trace", "ok.json", "--programs", "FILE/x.json"], "--programs", "ok.json"),
    (["plan", PROFILE, "--workers", "2", "--plot", "ok.png", "--out", "FILE/plan.json"], "--out", "ok.png"),
    (["plan", PROFILE, "--workers", "2", "--out", "ok.json", "--plot", "FILE/p.png"], "--plot", "ok.json"),
])
def test_schedule_and_plan_refuse_before_solving_and_write_nothing(tmp_path, argv, option, written):
    (tmp_path / "FILE").write_text("a file where a directory should be")
    result = _command(tmp_path, *argv)
    assert result.returncode == 2, result.stderr
    assert f"error: {option} 'FILE" in result.stderr
    assert not (tmp_path / written).exists()  # the other, writable output was not written either


def test_outputs_in_new_directories_are_written(tmp_path):
    result = _command(tmp_path, "schedule", "1f1b", "--csv", "new/dir/s.csv", "--programs", "other/p.json")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "new" / "dir" / "s.csv").exists() and (tmp_path / "other" / "p.json").exists()
    result = _command(tmp_path, "plan", PROFILE, "--workers", "2", "--out", "plans/a/plan.json")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plans" / "a" / "plan.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "--save", "o/m.pt", "--plot", "o/p.txt"], "--plot 'o/p.txt': --plot writes a picture"),
    (["train", "--trace", "o/t.png"], "--trace 'o/t.png': --trace writes JSON"),
    (["schedule", "1f1b", "--csv", "o/s.csv", "--plot", "o/p.txt"], "--plot 'o/p.txt': --plot writes a picture"),
    (["plan", PROFILE, "--workers", "2", "--out", "o/plan.json", "--plot", "o/p"], "there is none: use e.g. 'o/p.png'"),
    (["train", "--save", "{elsewhere}/x/m.pt"], "/elsewhere' does not exist; outside the working directory"),
    (["train", "--save", "o/out.txt"], "--save 'o/out.txt': '.txt' names no form of saved weights; give a directory "
                                       "(a path without a suffix, or ending in /), one torch.save file (.pt, .pth, "
                                       ".bin, .ckpt) or one safetensors file (.safetensors)"),
])
def test_a_wrong_format_or_a_missing_tree_is_refused_before_any_work(tmp_path, argv, message):
    (tmp_path / "cwd").mkdir()
    result = _command(tmp_path / "cwd", *[a.format(elsewhere=tmp_path / "elsewhere") for a in argv])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "torch imported: False" in result.stdout
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cwd"]  # nothing written, no directory made
