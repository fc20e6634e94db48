"""The README's commands run as the README says, so that its printed output never drifts.

The pages: README.md and docs/examples.md (the README's longer runs). The rules, block by block
(fenced blocks of each page):

* **Every command parses.** Each ``pipetrain ...`` command (after ``$``, in an ``sh`` block, or
  after ``torchrun ... -m pipetrain.cli``) goes through the command's own argument parser: no
  README command names an option or a value the CLI would refuse. (``...`` inside a command
  stands for options left out.)
* **Every output shown is the output printed.** The lines after a ``$ pipetrain ...`` line, up to
  the next ``$`` line or blank line, are that command's output; a block without ``$`` lines right
  after a block that holds one ``pipetrain`` command (the torchrun run) is that command's output.
  Any other block that looks like pipetrain's output fails the test: give it its command. The
  command runs in this process, ``train`` on the emulator (``--executor emulate``: the runtime's
  parameters are bitwise the emulator's, tests/test_runtime_parity.py; "emulated ranks" reads as
  "workers"), and the README's lines must stand in its output in order; ``...`` in the README
  stands for lines left out.
* **What depends on speed is not compared:** samples/s, shares of the measured time, and the
  stage lines of a cut balanced by measured time (the timing chooses that cut; on a synchronous
  schedule the result does not depend on it, so the run's other lines are compared).
* **Runs too long for a test** (:data:`SHORTENED`: 20 s or more here at the README's length) run
  to their first evaluation, ``--steps K``: the first K updates of a run are the same whatever
  its length, so the lines a K-update run prints alike are compared: the heading, the data and
  stage lines, and the evaluation after K updates (the README's update count read as K). Their
  later lines are checked by nothing: keep such blocks few.
* **Commands on workers at a reduced size** (:data:`REDUCED`: the model larger than one process):
  the README's command runs as written, on its local workers (not the emulator), with a smaller
  model, fewer updates and held-out samples, and must finish and write what it says it writes.
  Its full size was run once on the project's 2-core machine (benchmarks/RESULTS.md, section 17).
* **Every Python snippet runs when pasted** (of :data:`SNIPPET_PAGES`): it defines or imports every
  name it uses (no ``train_set`` left to the reader).
* A ``$`` line with a comment that says what else happened (``# rank 1 killed mid-run``) shows a
  failure the command alone does not cause: it is parsed, not run. A ``--plan FILE`` that the
  README made from a measured profile (a profile is timing) is written from the stages the
  README's output shows.

The numbers are this machine's (x86-64, PyTorch 2.13 CPU, one thread per rank): a CPU whose
kernels round differently prints other last digits, and the README is then rerun there.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipetrain.cli import _build_parser, main

ROOT = Path(__file__).resolve().parents[1]
#: the pages whose commands and outputs are checked
PAGES = [ROOT / "README.md", ROOT / "docs" / "examples.md"]

#: commands (by a piece of their text) that run to their first evaluation, with its update count
SHORTENED = {"--model resnet-gn-skip": 90, "--model gpt:n_layer=4": 100}

#: the pages whose Python snippets must define what they use
SNIPPET_PAGES = [ROOT / "README.md", ROOT / "docs" / "api.md"]

#: commands (by a piece of their text) run on workers at a reduced size: the options replaced
REDUCED = {"--init meta": {"--model": "gpt:n_layer=4,n_embd=32,n_head=2", "--steps": "2", "--eval-samples": "64"}}

_OUTPUT = re.compile(r"^([\w-]+: \d+ (stages|steps) on \d+ |data: |stage \d+: |after +\d+ of \d+ updates|"
                     r"pipetrain \w+: error: )")


@dataclass
class Command:
    line: int  # where it stands in its page (1-based)
    argv: list[str]  # after `pipetrain`
    text: str
    output: list[str] | None = None  # the lines the README shows it printing
    comment: bool = False
    page: str = "README.md"


@dataclass
class Block:
    line: int
    lang: str
    lines: list[str] = field(default_factory=list)


def _blocks(text: str) -> list[Block]:
    """The fenced blocks, each line without the fence's indentation (a block inside a list item)."""
    blocks, current, indent = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current, indent = Block(number + 1, line.strip()[3:].strip()), len(line) - len(line.lstrip())
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.lines.append(line[indent:] if line[:indent].isspace() else line)
    return blocks


def _argv(text: str) -> list[str] | None:
    """The arguments after ``pipetrain`` of a shell line, or None if it runs something else."""
    if text.split()[:1] not in (["pipetrain"], ["torchrun"]):
        return None
    words = [w for w in shlex.split(text, comments=True) if w != "..."]
    if words[:1] == ["pipetrain"]:
        return words[1:]
    if words[:1] == ["torchrun"] and "pipetrain.cli" in words:
        return words[words.index("pipetrain.cli") + 1:]
    return None


def _joined(lines: list[str], start: int) -> tuple[str, int]:
    """The shell line at ``start`` with its continuation lines (``\\`` at the end), and the next index."""
    text, i = lines[start].strip(), start + 1
    while text.endswith("\\") and i < len(lines):
        text, i = text[:-1] + " " + lines[i].strip(), i + 1
    return text, i


def _commands(blocks: list[Block], page: str = "README.md") -> tuple[list[Command], list[tuple[int, str]]]:
    """Every pipetrain command of the README, with the output shown for it; and the lines that
    look like pipetrain's output but belong to no command."""
    commands: list[Command] = []
    orphans: list[tuple[int, str]] = []
    previous: list[Command] = []
    for block in blocks:
        found: list[Command] = []
        if any(line.startswith("$ ") for line in block.lines):
            i, current = 0, None
            while i < len(block.lines):
                line = block.lines[i]
                if line.startswith("$ "):
                    text, i = _joined(block.lines, i)
                    argv = _argv(text[2:])
                    current = None
                    if argv is not None:
                        current = Command(block.line + i - 1, argv, text[2:], [], comment=" #" in text, page=page)
                        found.append(current)
                    continue
                if not line.strip():
                    current = None
                elif current is not None:
                    current.output.append(line)
                elif _OUTPUT.match(line):
                    orphans.append((f"{page}:{block.line + i}", line))
                i += 1
        else:
            i = 0
            while i < len(block.lines):
                text, i = _joined(block.lines, i)
                argv = _argv(text) if text and block.lang != "python" else None
                if argv is not None:
                    found.append(Command(block.line + i - 1, argv, text, page=page))
            shown = [line for line in block.lines if line.strip()]
            if not found and shown and _OUTPUT.match(shown[0]):
                if len(previous) == 1 and previous[0].output is None:
                    previous[0].output = shown
                else:
                    orphans += [(f"{page}:{block.line}", line) for line in shown if _OUTPUT.match(line)]
        commands += found
        previous = found
    return commands, orphans


COMMANDS: list[Command] = []
ORPHANS: list[tuple[str, str]] = []
for _page in PAGES:
    _found, _orphans = _commands(_blocks(_page.read_text(encoding="utf-8")), _page.relative_to(ROOT).as_posix())
    COMMANDS += _found
    ORPHANS += _orphans
RUNS = [c for c in COMMANDS if c.output and not c.comment]


def test_the_readme_shows_commands_and_outputs_to_check():
    assert len(COMMANDS) >= 15 and len(RUNS) >= 8
    assert not ORPHANS, f"README lines that show pipetrain output without its command: {ORPHANS}"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}:{c.line}")
def test_every_readme_command_parses(command):
    parser, chosen = _build_parser(command.argv[0])
    assert chosen is not None, f"{command.page} line {command.line}: no command {command.argv[0]!r}"
    try:
        _, extras = parser.parse_known_args(command.argv)
    except SystemExit:
        pytest.fail(f"{command.page} line {command.line}: the parser refuses {command.text!r}")
    assert not extras, f"{command.page} line {command.line}: unknown arguments {extras}"


def _shortened(command: Command) -> int | None:
    return next((steps for piece, steps in SHORTENED.items() if piece in command.text), None)


def _normalised(lines: list[str], steps: int | None) -> list[str]:
    timed = any("stages balanced by measured time" in line for line in lines)
    out = []
    for line in lines:
        line = line.replace("emulated ranks", "workers")
        line = re.sub(r"\b\d[\d.e+-]* samples/s( \([\d.e+-]+ s per update\))?", "N samples/s", line)
        line = re.sub(r",\s+[\d.]+ % of the measured time", ", T % of the measured time", line)
        if timed:
            line = re.sub(r"^(stage \d+): .*", r"\1: (cut by measured time)", line)
        if steps is not None:
            line = re.sub(r"\b\d+ updates of", "K updates of", line)
            line = re.sub(r"^after +(\d+) of \d+ updates", r"after \1 of K updates", line)
        out.append(line.rstrip())
    return out


def _expected(command: Command, steps: int | None) -> list[str]:
    """The README's lines to find in the run's output (of a shortened run: up to its evaluation)."""
    shown = command.output or []
    if steps is None:
        return shown
    cut = next((i for i, line in enumerate(shown) if re.match(rf"^after +{steps} of ", line)), None)
    assert cut is not None, (f"{command.page} line {command.line}: a run shortened to {steps} updates shows nothing to "
                             f"compare: show its evaluation after {steps} updates")
    return shown[:cut + 1]


def _write_plan(command: Command, tmp_path: Path) -> None:
    """The plan the README's output shows: its stages' first units, its schedule and microbatches."""
    path = command.argv[command.argv.index("--plan") + 1]
    from pipetrain.data import load_data
    from pipetrain.models import build_model

    _, _, info, _ = load_data(command.argv[command.argv.index("--data") + 1])
    model = build_model(command.argv[command.argv.index("--model") + 1], input_shape=info.input_shape,
                        num_classes=info.num_classes)
    heading = command.output[0]
    starts = [0] + [int(m.group(1)) for line in command.output if (m := re.search(r"  from (\d+)$", line))]
    balance = [b - a for a, b in zip(starts, starts[1:] + [len(model)])]
    units = int(re.search(r"\((\d+) microbatch", heading).group(1))
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(json.dumps({"balance": balance, "replicas": [1] * len(balance),
                                             "schedule": heading.split(":")[0], "microbatches": units}))


@pytest.mark.parametrize("command", RUNS, ids=lambda c: f"{c.page}:{c.line}")
def test_every_readme_output_is_what_the_command_prints(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, steps = list(command.argv), _shortened(command)
    if argv[0] == "train":
        argv += ["--no-progress"] + ([] if "--executor" in argv else ["--executor", "emulate"])
        if steps is not None:
            for flag in ("--steps", "--epochs"):
                if flag in argv:
                    del argv[argv.index(flag):argv.index(flag) + 2]
            argv += ["--steps", str(steps)]
        if "--plan" in argv:
            _write_plan(command, tmp_path)
    main(argv)
    out, err = capsys.readouterr()
    printed = _normalised(out.splitlines() + err.splitlines(), steps)
    expected = _normalised(_expected(command, steps), steps)
    position = 0
    for lines in _segments(expected):
        found = next((i for i in range(position, len(printed) - len(lines) + 1)
                      if printed[i:i + len(lines)] == lines), None)
        assert found is not None, (f"{command.page} line {command.line}: `{command.text}` printed\n" + "\n".join(printed)
                                   + "\n\nwhich does not hold, in order, the README's\n" + "\n".join(lines))
        position = found + len(lines)


def _segments(lines: list[str]) -> list[list[str]]:
    """The runs of lines between ``...`` lines (each must stand in the output as it is)."""
    segments: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == "...":
            segments.append([])
        else:
            segments[-1].append(line)
    return [segment for segment in segments if segment]


@pytest.mark.parametrize("command", [c for c in COMMANDS if any(piece in c.text for piece in REDUCED)],
                         ids=lambda c: f"{c.page}:{c.line}")
def test_a_reduced_command_finishes_on_its_workers_and_writes_its_outputs(command, tmp_path):
    """The README's model larger than one process, on 4 local workers at a reduced size: it ends
    with status 0 after its final evaluation and saves the shard of every stage."""
    import os
    import subprocess
    import sys

    from pipetrain import load_weights
    from pipetrain.data import load_data
    from pipetrain.models import build_model

    argv = list(command.argv)
    for flag, value in next(r for piece, r in REDUCED.items() if piece in command.text).items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    result = subprocess.run([sys.executable, "-m", "pipetrain.cli", *argv, "--no-progress"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr
    assert re.search(r"steps on 4 workers, [\d.]+ samples/s.*, test loss \d", result.stdout), result.stdout
    saved = tmp_path / argv[argv.index("--save") + 1]
    assert sorted(p.name for p in saved.iterdir()) == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)] + [
        "model.safetensors.index.json"]
    _, _, info, _ = load_data(argv[argv.index("--data") + 1])
    model = build_model(argv[argv.index("--model") + 1], input_shape=info.input_shape, num_classes=info.num_classes,
                        meta=True)
    loaded = load_weights(model, saved)  # every tensor of the unsplit model, by name and shape
    assert not any(t.is_meta for t in loaded.state_dict().values())


SNIPPETS = [(page.relative_to(ROOT).as_posix(), block) for page in SNIPPET_PAGES
            for block in _blocks(page.read_text(encoding="utf-8")) if block.lang == "python"]


def _undefined(source: str) -> list[str]:
    """The names a snippet reads that it neither assigns, imports, defines nor gets from builtins."""
    import ast
    import builtins

    defined, read = set(dir(builtins)), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.Name):
            (defined.add(node.id) if isinstance(node.ctx, ast.Store) else read.append(node.id))
    return sorted({name for name in read if name not in defined})


def test_the_python_snippets_define_what_they_use():
    assert len(SNIPPETS) >= 4
    assert _undefined("pipe.fit(train_set)\nimport torch") == ["pipe", "train_set"]  # the check sees them
    missing = {f"{page}:{block.line}": names for page, block in SNIPPETS if (names := _undefined("\n".join(block.lines)))}
    assert not missing, f"snippets that use names they do not define: {missing}"
