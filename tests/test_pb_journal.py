"""Tests of pipetrain.pb.journal: an interrupted or extended PB study resumes from the runs it
wrote, equal to the study trained in one go; torn and foreign journals; the untrained-reference
warning of pipetrain.pb.study."""

from __future__ import annotations

import json

import pytest

from pipetrain.errors import ConfigError
from pipetrain.pb import study as study_module
from pipetrain.pb.journal import StudyJournal
from pipetrain.pb.methods import parse_methods
from pipetrain.pb.report import markdown_tables
from pipetrain.pb.study import StudyConfig, run_study


def _config(**overrides) -> StudyConfig:
    options = dict(
        model="resmlp:depth=2,width=16,groups=4", data="synthetic:features=8,classes=3,samples=120,seed=1",
        stages=(4,), methods=tuple(parse_methods("sgd-batch,sgd,pb+sc")), seeds=(0, 1), epochs=1.0,
        reference_batch=8, lr=0.2, momentum=0.9, max_runs=1,
    )
    options.update(overrides)
    return StudyConfig(**options)


def _outcomes(result) -> list[tuple]:
    return [(r.method, r.stages, r.seed, r.test_accuracy, r.final_train_loss, r.curve) for r in result.runs]


@pytest.fixture(scope="module")
def in_one_go():
    return run_study(_config())


def test_an_interrupted_study_resumes_to_the_study_trained_in_one_go(tmp_path, monkeypatch, in_one_go):
    config = _config()
    journal = StudyJournal(tmp_path, config)
    train, calls = study_module._Trainer.train, []

    def dies_on_the_third_engine(self, specs):
        calls.append(len(specs))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return train(self, specs)

    monkeypatch.setattr(study_module._Trainer, "train", dies_on_the_third_engine)
    with pytest.raises(KeyboardInterrupt):
        run_study(config, journal=journal)
    monkeypatch.setattr(study_module._Trainer, "train", train)
    assert len(journal.done()) == 2  # one run per engine (max_runs=1), two engines finished
    told = []
    resumed = run_study(config, journal=StudyJournal(tmp_path, config), on_resume=lambda *n: told.append(n))
    assert told == [(2, 6)]
    assert _outcomes(resumed) == _outcomes(in_one_go)
    assert len(StudyJournal(tmp_path, config).done()) == 6


def test_a_study_extended_by_a_seed_trains_only_that_seed(tmp_path, in_one_go):
    run_study(_config(seeds=(0,)), journal=StudyJournal(tmp_path, _config(seeds=(0,))))
    told = []
    extended = run_study(_config(), journal=StudyJournal(tmp_path, _config()), on_resume=lambda *n: told.append(n))
    assert told == [(3, 6)]
    assert _outcomes(extended) == _outcomes(in_one_go)


def test_a_torn_last_line_is_trained_again_and_other_settings_are_refused(tmp_path):
    config = _config(methods=tuple(parse_methods("sgd")), seeds=(0,), stages=())
    journal = StudyJournal(tmp_path, config)
    run_study(config, journal=journal)
    text = journal.path.read_text()
    journal.path.write_text(text + text.splitlines()[-1][:40])  # the process died while writing
    assert len(journal.done()) == 1
    assert journal.path.read_text() == text  # the torn line is gone: the next run appends cleanly
    with pytest.raises(ConfigError, match=r"other settings \(epochs: 1\.0 there, 2\.0 here\)"):
        StudyJournal(tmp_path, _config(epochs=2.0)).done()
    (tmp_path / "runs.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match="not a journal of pipetrain pb: give another folder, or delete it") as info:
        journal.done()
    assert info.value.options == ("folder",)


def test_a_reference_that_does_not_train_is_said_in_the_tables(in_one_go):
    assert in_one_go.hyperparameters["untrained_reference"] == []  # 3 classes: it learns
    frozen = run_study(_config(lr=1e-7, methods=tuple(parse_methods("sgd-batch,sgd")), stages=(), seeds=(0,)))
    (entry,) = frozen.hyperparameters["untrained_reference"]
    assert entry["method"] == "sgd-batch" and entry["lr_scale"] == 1.0 and entry["chance"] == pytest.approx(1 / 3)
    assert "WARNING: the reference (sgd-batch) did not train at lr scale 1" in markdown_tables(frozen)
    json.dumps(frozen.hyperparameters)  # stored in results.json
