"""The runs a PB study has finished, kept on disk as they finish, so that an interrupted study
resumes from them.

A study of many seeds, stage counts and learning rates trains for hours; stopped half-way (a
killed job, a full machine), it used to leave nothing. ``pipetrain pb --out DIR`` now appends
every finished run to ``DIR/runs.jsonl`` (one JSON line each, flushed and synced to disk before
the next engine starts), and the same command run again trains only the runs missing from it.

What makes a stored run reusable: the settings every run shares (model, data, epochs, reference
batch and hyper-parameters, decay, dtype, runs per engine), written as the file's first line. The
grid (methods, stage counts, seeds, lr and delay scales) may change: a study extended by one more
seed trains only that seed. A file written under other shared settings is refused, naming them; a
torn last line (the process died while writing it) is dropped.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError, name_options, option
from pipetrain.pb.study import RunResult, StudyConfig, run_key

__all__ = ["StudyJournal", "JOURNAL_NAME"]

JOURNAL_NAME = "runs.jsonl"

#: StudyConfig fields that choose which runs exist, not what each run computes
_GRID = ("stages", "methods", "seeds", "lr_scales", "delay_scales", "workers")
_FLOATS = ("test_accuracy", "test_loss", "train_accuracy", "final_train_loss")
name_options({"folder": "--out"}, {})  # StudyJournal(folder): `pipetrain pb --out DIR`


def _shared(config: StudyConfig) -> dict[str, Any]:
    """The settings that every run of ``config`` shares, as JSON values."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in _GRID}


class StudyJournal:
    """``DIR/runs.jsonl`` of one study: :meth:`done` reads what it holds, :meth:`record` appends."""

    def __init__(self, folder: str | os.PathLike[str], config: StudyConfig) -> None:
        self.path = Path(folder) / JOURNAL_NAME
        self.shared = json.loads(json.dumps(_shared(config)))  # as it reads back (tuples become lists)

    def done(self) -> dict[tuple, RunResult]:
        """The runs already finished, by run key; {} when the file does not exist yet."""
        if not self.path.exists():
            return {}
        lines = self.path.read_text().splitlines()
        if not lines:
            return {}
        try:
            header = json.loads(lines[0])["study"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{self.path} is not a journal of pipetrain pb: give another {option('folder')}, or delete it") from None
        if header != self.shared:
            differ = sorted(k for k in set(header) | set(self.shared) if header.get(k) != self.shared.get(k))
            raise ConfigError(
                f"{self.path} holds the runs of a study with other settings ("
                + ", ".join(f"{k}: {header.get(k)!r} there, {self.shared.get(k)!r} here" for k in differ)
                + f"): give another {option('folder')}, or the same settings to resume it"
            )
        runs: dict[tuple, RunResult] = {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                row = json.loads(line)["run"]
                values = {k: (math.nan if v is None and k in _FLOATS else v) for k, v in row.items()}
                values["curve"] = [math.nan if v is None else v for v in values.get("curve", [])]
                run = RunResult(**values)
            except (ValueError, KeyError, TypeError):
                if number == len(lines):  # written when the study was stopped: dropped, trained again
                    self._rewrite(lines[:-1])
                    break
                raise ConfigError(f"{self.path}, line {number}: not a run of pipetrain pb; delete the line or the file") from None
            runs[run_key(run.method, run.stages, run.lr_scale, run.delay_scale, run.seed)] = run
        return runs

    def _rewrite(self, lines: list[str]) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(line + "\n" for line in lines))
        os.replace(partial, self.path)

    def record(self, results: list[RunResult]) -> None:
        """Append finished runs, on disk before this returns."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a") as handle:
            if fresh:
                handle.write(json.dumps({"study": self.shared}) + "\n")
            for run in results:
                handle.write(json.dumps({"run": run.row(curve=True)}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
