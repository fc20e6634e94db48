"""Tables (markdown, CSV, JSON) and plots of a PB study."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shlex
import statistics
from pathlib import Path
from typing import Any, Iterable

from pipetrain.pb.methods import parse_method
from pipetrain.pb.study import RunResult, StudyConfig, StudyResult, untrained_text

__all__ = ["summarize", "markdown_tables", "write_outputs", "study_json", "load_results", "study_command",
           "plot_accuracy", "plot_curves"]

_SUMMARY_FIELDS = [
    "method", "stages", "lr_scale", "delay_scale", "runs", "diverged", "test_accuracy_mean",
    "test_accuracy_std", "test_accuracy_min", "test_accuracy_max", "final_train_loss_median",
    "accuracy_gap_vs_sgd", "loss_ratio_vs_sgd",
]


def _key(run: RunResult) -> tuple:
    return (run.method, run.stages, run.lr_scale, run.delay_scale)


def _label(method: str, delay_scale: float | None, sweep: bool) -> str:
    return f"{method} (delay x{delay_scale:g})" if sweep and delay_scale is not None else method


def summarize(runs: Iterable[RunResult]) -> list[dict[str, Any]]:
    """One row per (method, stages, lr scale, delay scale), over its seeds.

    Accuracy mean/spread and the median final training loss are over the runs that did not
    diverge (``diverged`` counts the others). ``accuracy_gap_vs_sgd`` is the mean accuracy minus
    that of batch-size-1 SGD at the same lr scale; ``loss_ratio_vs_sgd`` the ratio of median losses.
    """
    groups: dict[tuple, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(_key(run), []).append(run)
    rows = []
    for (method, stages, lr_scale, delay_scale), members in groups.items():
        ok = [r for r in members if not r.diverged]
        acc = [r.test_accuracy for r in ok]
        loss = [r.final_train_loss for r in ok]
        rows.append({
            "method": method, "stages": stages, "lr_scale": lr_scale, "delay_scale": delay_scale,
            "runs": len(members), "diverged": len(members) - len(ok),
            "test_accuracy_mean": statistics.fmean(acc) if acc else None,
            "test_accuracy_std": statistics.stdev(acc) if len(acc) > 1 else (0.0 if acc else None),
            "test_accuracy_min": min(acc) if acc else None,
            "test_accuracy_max": max(acc) if acc else None,
            "final_train_loss_median": statistics.median(loss) if loss else None,
        })
    sgd = {row["lr_scale"]: row for row in rows if row["method"] == "sgd"}
    for row in rows:
        base = sgd.get(row["lr_scale"])
        gap = ratio = None
        if base and row["test_accuracy_mean"] is not None and base["test_accuracy_mean"] is not None:
            gap = row["test_accuracy_mean"] - base["test_accuracy_mean"]
        if base and row["final_train_loss_median"] and base["final_train_loss_median"]:
            ratio = row["final_train_loss_median"] / base["final_train_loss_median"]
        row["accuracy_gap_vs_sgd"] = gap
        row["loss_ratio_vs_sgd"] = ratio
    return rows


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if row["test_accuracy_mean"] is None:
        return f"diverged {row['diverged']}/{row['runs']}"
    text = f"{100 * row['test_accuracy_mean']:.1f} ± {100 * row['test_accuracy_std']:.1f} · {row['final_train_loss_median']:.3g}"
    if row["diverged"]:
        text += f" · **{row['diverged']}/{row['runs']} div**"
    return text


def markdown_tables(result: StudyResult, rows: list[dict[str, Any]] | None = None) -> str:
    """One table per lr scale: methods down, stage counts across.

    Cell: test accuracy in % (mean ± standard deviation over seeds) · median final training loss,
    and the number of diverged runs if any.
    """
    rows = summarize(result.runs) if rows is None else rows
    config = result.config
    sweep = len(config.delay_scales) > 1
    stages = sorted({r["stages"] for r in rows if r["stages"] is not None})
    plain = any(r["stages"] is None for r in rows)
    out: list[str] = []
    for lr_scale in config.lr_scales:
        here = [r for r in rows if r["lr_scale"] == lr_scale]
        if not here:
            continue
        hyper = result.hyperparameters["translated"]
        for entry in result.hyperparameters.get("untrained_reference", []):
            if entry["lr_scale"] == lr_scale:
                out += [f"**{untrained_text(entry)}.**", ""]
        out.append(f"lr scale {lr_scale:g} (batch 1: lr {hyper['lr'] * lr_scale:.3g}, momentum {hyper['momentum']:.6g}; "
                   f"batch {config.reference_batch}: lr {config.lr * lr_scale:.3g}, momentum {config.momentum:g})")
        out.append("")
        header = ["method"] + (["no pipeline"] if plain else []) + [f"S={s}" for s in stages]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        labels: list[tuple[str, float | None]] = []
        for r in here:
            key = (r["method"], r["delay_scale"])
            if key not in labels:
                labels.append(key)
        for method, delay in labels:
            cells = [_label(method, delay, sweep)]
            if plain:
                cells.append(_cell(_find(here, method, None, delay)))
            cells += [_cell(_find(here, method, s, delay)) for s in stages]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _find(rows, method, stages, delay):
    for r in rows:
        if r["method"] == method and r["stages"] == stages and r["delay_scale"] == delay:
            return r
    return None


def study_command(config) -> str:
    """The ``pipetrain pb`` command line that trains ``config``."""
    join = lambda values: ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)  # noqa: E731
    parts = ["pipetrain", "pb", "--model", config.model, "--data", config.data]
    if config.test_data:
        parts += ["--test-data", config.test_data]
    parts += [
        "--stages", join(config.stages), "--methods", ",".join(m.name for m in config.methods),
        "--seeds", str(len(config.seeds)), "--epochs", f"{config.epochs:g}",
        "--reference-batch", str(config.reference_batch), "--lr", f"{config.lr:g}",
        "--momentum", f"{config.momentum:g}",
    ]
    if config.weight_decay:
        parts += ["--weight-decay", f"{config.weight_decay:g}"]
    parts += ["--lr-scale", join(config.lr_scales), "--delay-scale", join(config.delay_scales),
              "--decay-fraction", f"{config.decay_fraction:g}"]
    if config.dtype != "float32":
        parts += ["--dtype", config.dtype]
    if config.max_runs:
        parts += ["--max-runs", str(config.max_runs)]
    if config.workers > 1:
        parts += ["--workers", str(config.workers)]
    return " ".join(shlex.quote(p) for p in parts)


def _config_dict(config) -> dict[str, Any]:
    data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    data["methods"] = [m.name for m in config.methods]
    return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


def load_results(path: str | Path) -> StudyResult:
    """A study back from the ``results.json`` that :func:`write_outputs` wrote (to redraw it)."""
    payload = json.loads(Path(path).read_text())
    options = dict(payload["config"])
    options["methods"] = tuple(parse_method(m) for m in options["methods"])
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    config = StudyConfig(**options)
    curves = {(c["method"], c["stages"], c["lr_scale"], c["delay_scale"], c["seed"]): c["curve"]
              for c in payload.get("curves", [])}
    runs = []
    for row in payload["results"]:
        values = {k: (math.nan if v is None and k in _FLOAT_FIELDS else v) for k, v in row.items()}
        key = (row["method"], row["stages"], row["lr_scale"], row["delay_scale"], row["seed"])
        curve = [math.nan if v is None else v for v in curves.get(key, [])]
        runs.append(RunResult(**values, curve=curve))
    return StudyResult(config, runs, payload["hyperparameters"], payload["seconds"], payload["train_samples"],
                       payload["test_samples"])


_FLOAT_FIELDS = ("test_accuracy", "test_loss", "train_accuracy", "final_train_loss")


def study_json(result: StudyResult, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    config = result.config
    return {
        "config": _config_dict(config),
        "model": config.model,
        "data": config.data,
        "test_data": config.test_data,
        "train_samples": result.train_samples,
        "test_samples": result.test_samples,
        "hyperparameters": result.hyperparameters,
        "seeds": list(config.seeds),
        "seconds": result.seconds,
        "results": [r.row() for r in result.runs],
        "summary": summarize(result.runs) if rows is None else rows,
    }


def _write_csv(path: Path, rows: list[dict[str, Any]], fields: list[str]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in fields})


def write_outputs(result: StudyResult, out: str | Path, *, command: str | None = None) -> list[Path]:
    """results.md, summary.csv, runs.csv, results.json, accuracy_vs_stages.png, loss_curves.png."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = summarize(result.runs)
    written = []
    md = folder / "results.md"
    text = []
    command = study_command(result.config) + f" --out {out}" if command is None else command
    if command:
        text += ["Command:", "", f"    {command}", ""]
    text += [f"Mean ± std of test accuracy (%) over seeds · median final training loss (non-diverged runs); "
             f"{result.train_samples} training / {result.test_samples} test samples; {result.seconds:.0f} s.", ""]
    text.append(markdown_tables(result, rows))
    md.write_text("\n".join(text))
    written.append(md)
    _write_csv(folder / "summary.csv", rows, _SUMMARY_FIELDS)
    written.append(folder / "summary.csv")
    run_rows = [r.row() for r in result.runs]
    _write_csv(folder / "runs.csv", run_rows, [k for k in run_rows[0]] if run_rows else [])
    written.append(folder / "runs.csv")
    payload = study_json(result, rows)
    payload["curves"] = [{**{k: v for k, v in r.row().items() if k in ("method", "stages", "lr_scale", "delay_scale", "seed")},
                          "curve": r.row(curve=True)["curve"]} for r in result.runs]
    (folder / "results.json").write_text(json.dumps(payload, indent=1))
    written.append(folder / "results.json")
    if any(r["stages"] is not None for r in rows):
        written.append(plot_accuracy(result, folder / "accuracy_vs_stages.png", rows))
    written.append(plot_curves(result, folder / "loss_curves.png"))
    return written


def plot_accuracy(result: StudyResult, path: str | Path, rows: list[dict[str, Any]] | None = None) -> Path:
    """Test accuracy (top) and median final training loss (bottom) against S, one column per lr
    scale; batch-1 SGD and batch-B SGD as horizontal lines; diverged runs counted on the x axis."""
    import matplotlib  # slow to import: only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend, which must come first

    rows = summarize(result.runs) if rows is None else rows
    config = result.config
    scales = list(config.lr_scales)
    fig, axes = plt.subplots(2, len(scales), figsize=(4.2 * len(scales), 6.4), squeeze=False, sharex=True)
    stages = sorted({r["stages"] for r in rows if r["stages"] is not None})
    sweep = len(config.delay_scales) > 1
    labels: list[tuple[str, float | None]] = []
    for r in rows:
        if r["stages"] is not None and (r["method"], r["delay_scale"]) not in labels:
            labels.append((r["method"], r["delay_scale"]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, lr_scale in enumerate(scales):
        top, bottom = axes[0][col], axes[1][col]
        for name, style in (("sgd", "--"), ("sgd-batch", ":")):
            base = _find([r for r in rows if r["lr_scale"] == lr_scale], name, None, None)
            if base and base["test_accuracy_mean"] is not None:
                label = "sgd (batch 1)" if name == "sgd" else f"sgd (batch {config.reference_batch})"
                top.axhline(100 * base["test_accuracy_mean"], color="black", linestyle=style, linewidth=1, label=label)
                bottom.axhline(base["final_train_loss_median"], color="black", linestyle=style, linewidth=1)
        for index, (method, delay) in enumerate(labels):
            color = colors[index % len(colors)]
            xs, ys, es, ls, div = [], [], [], [], []
            for s in stages:
                r = _find([r for r in rows if r["lr_scale"] == lr_scale], method, s, delay)
                if r is None:
                    continue
                if r["diverged"]:
                    div.append((s, r["diverged"]))
                if r["test_accuracy_mean"] is not None:
                    xs.append(s)
                    ys.append(100 * r["test_accuracy_mean"])
                    es.append(100 * r["test_accuracy_std"])
                    ls.append(r["final_train_loss_median"])
            label = _label(method, delay, sweep)
            top.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=color, label=label)
            bottom.plot(xs, ls, marker="o", color=color)
            for s, count in div:
                top.annotate(f"{count} div", (s, 0), xycoords=("data", "axes fraction"), color=color,
                             fontsize=7, ha="center", va="bottom", xytext=(0, 2 + 9 * index), textcoords="offset points")
        top.set_title(f"lr x{lr_scale:g}")
        bottom.set_yscale("log")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(stages, [str(s) for s in stages])
        bottom.set_xlabel("pipeline stages S")
        if col == 0:
            top.set_ylabel("test accuracy (%)")
            bottom.set_ylabel("final training loss (median)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{config.model}, {config.data}: {len(config.seeds)} seeds, {config.epochs:g} epochs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_curves(result: StudyResult, path: str | Path, lr_scale: float | None = None) -> Path:
    """Online training loss (median over seeds) against epochs for every method, one panel per
    stage count, at ``lr_scale`` (default: the scale closest to 1)."""
    import matplotlib  # slow to import: only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend, which must come first

    config = result.config
    if lr_scale is None:
        lr_scale = min(config.lr_scales, key=lambda s: abs(math.log(s)))
    runs = [r for r in result.runs if r.lr_scale == lr_scale]
    stages = sorted({r.stages for r in runs if r.stages is not None}) or [None]
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.4), squeeze=False, sharey=True)
    sweep = len(config.delay_scales) > 1
    for col, s in enumerate(stages):
        ax = axes[0][col]
        keys: list[tuple[str, int | None, float | None]] = []
        for r in runs:
            key = (r.method, r.stages, r.delay_scale)
            if (r.stages in (s, None)) and key not in keys:
                keys.append(key)
        for method, stage, delay in keys:
            curves = [r.curve for r in runs if (r.method, r.stages, r.delay_scale) == (method, stage, delay)]
            length = min(len(c) for c in curves)
            median = [statistics.median(c[e] for c in curves) for e in range(length)]
            style = "--" if stage is None else "-"
            epochs = [(e + 1) * config.epochs / length for e in range(length)]
            ax.plot(epochs, median, style, label=_label(method, delay, sweep))
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_title(f"S={s}" if s is not None else "no pipeline")
        if col == 0:
            ax.set_ylabel("training loss (online, median)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"online training loss, lr x{lr_scale:g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
