"""`pipetrain schedule`: the summary table, JSON contract, files written, and clear errors."""

import json
import subprocess
import sys

import pytest

from pipetrain.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table(capsys):
    code, out, _ = run(capsys, "schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--costs", "F=1,B=2")
    assert code == 0
    assert "makespan             33" in out
    assert "27.3 % of total time" in out


def test_json_contract(capsys):
    code, out, _ = run(capsys, "schedule", "pipedream", "--stages", "4", "--microbatches", "8", "--json",
                       "--costs", "F=1,B=2")
    assert code == 0
    data = json.loads(out)
    for key in ("makespan", "bubble_fraction", "time_per_microbatch", "stages", "versions"):
        assert key in data
    assert [s["peak_versions"] for s in data["stages"]] == [4, 3, 2, 1]
    assert [s["peak_activations"] for s in data["stages"]] == [4, 3, 2, 1]
    assert set(data["stages"][0]) >= {"busy", "idle", "peak_activations", "peak_versions"}
    assert data["versions"][0] == [[0, 0], [0, 0], [0, 0], [0, 0], [1, 1], [2, 2], [3, 3], [4, 4]]


def test_replicas_imply_stages(capsys):
    code, out, _ = run(capsys, "schedule", "pipedream", "--replicas", "3,1", "--microbatches", "12", "--json")
    data = json.loads(out)
    assert data["replicas"] == [3, 1] and data["num_ranks"] == 4


def test_files_and_compare(capsys, tmp_path):
    plot, trace, csv = tmp_path / "t.png", tmp_path / "t.json", tmp_path / "s.csv"
    programs = tmp_path / "p.json"
    code, out, _ = run(capsys, "schedule", "zb-h1", "--stages", "3", "--microbatches", "6", "--costs", "F=1,B=1,W=1",
                       "--plot", str(plot), "--trace", str(trace), "--csv", str(csv), "--programs", str(programs))
    assert code == 0 and plot.stat().st_size > 10_000
    listed = json.loads(programs.read_text())
    assert listed["programs"][0][0] == "0F0@v0" and listed["placement"] == [[0], [1], [2]]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "0F0@v0" and e["ph"] == "X" for e in events)
    # the CSV loads back and simulates to the same numbers
    code, out2, _ = run(capsys, "schedule", "--load", str(csv), "--costs", "F=1,B=1,W=1", "--json")
    assert json.loads(out2)["makespan"] == 6 * 3 + 2
    compare = tmp_path / "c.png"
    code, out, _ = run(capsys, "schedule", "--compare", "gpipe,1f1b,zb-h1,pipedream", "--stages", "4",
                       "--microbatches", "8", "--plot", str(compare), "--json")
    data = json.loads(out)
    assert [s["schedule"] for s in data["schedules"]] == ["gpipe", "1f1b", "zb-h1", "pipedream"]
    assert compare.stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["schedule", "pipedrem"], "did you mean pipedream"),
        (["schedule", "1f1b", "--costs", "F=one"], "must be a number"),
        (["schedule", "2bw", "--stages", "4", "--microbatches", "2"], "m >= S"),
        (["schedule"], "name a schedule"),
    ],
)
def test_bad_input_exits_2_with_one_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["gpipe", "--stages", "100000"],
    ["interleaved", "--stages", "64", "--microbatches", "100000", "--chunks", "2"],
    ["zb-h1", "--stages", "3000", "--microbatches", "3000"],
])
def test_a_schedule_too_large_is_refused_with_the_largest_that_fits(capsys, argv):
    import re

    from pipetrain.schedule.presets import LIMIT_SECONDS, estimated_seconds

    code, out, err = run(capsys, "schedule", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    name = argv[0]
    chunks = int(argv[argv.index("--chunks") + 1]) if "--chunks" in argv else 1
    stages = int(argv[argv.index("--stages") + 1])
    microbatches = int(argv[argv.index("--microbatches") + 1]) if "--microbatches" in argv else 8
    most = int(re.search(r"at most ([\d,]+) stages", err).group(1).replace(",", ""))
    assert estimated_seconds(name, most, microbatches, chunks=chunks) <= LIMIT_SECONDS
    assert estimated_seconds(name, most + 1, microbatches, chunks=chunks) > LIMIT_SECONDS
    fewer = re.search(r"or ([\d,]+) microbatches", err)
    if fewer:
        count = int(fewer.group(1).replace(",", ""))
        assert estimated_seconds(name, stages, count, chunks=chunks) <= LIMIT_SECONDS
        assert estimated_seconds(name, stages, count + 1, chunks=chunks) > LIMIT_SECONDS


def test_deadlocking_csv_exits_2(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(
        "0, 0F0, 0SEND_F0>1, 0RECV_B0<1, 0B0, 0F1, 0SEND_F1>1, 0RECV_B1<1, 0B1, 0STEP\n"
        "1, 1RECV_F0<0, 1F0, 1RECV_F1<0, 1F1, 1B0, 1SEND_B0>0, 1B1, 1SEND_B1>0, 1STEP\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "schedule", "--load", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "deadlocks" in result.stderr and "wait cycle" in result.stderr
    assert "Traceback" not in result.stderr


def test_memory_with_some_stages_recomputing(capsys):
    code, out, _ = run(capsys, "schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--recompute", "stage:0,2",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert data["recompute"] == "stage:0,2"
    assert [s["peak_activations"] for s in data["stages"]] == [1, 3, 1, 1]
    assert [s.get("peak_inputs") for s in data["stages"]] == [4, None, 2, None]
    code, out, _ = run(capsys, "schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--recompute", "stage")
    assert "(+4 inputs kept)" in out and "with recomputation (stage)" in out
    code, out, err = run(capsys, "schedule", "1f1b", "--stages", "4", "--recompute", "stage:4")
    assert code == 2 and "--recompute stage:4 names stage 4, but the schedule has 4 stages" in err


def test_chunks_on_a_schedule_without_model_chunks_is_refused_as_train_refuses_it(capsys):
    words = "error: --chunks applies to the looped schedules (bfs, interleaved, interleaved-zb) only, not to 1f1b\n"
    code, out, err = run(capsys, "schedule", "1f1b", "--chunks", "3")
    assert code == 2 and out == "" and err == "pipetrain schedule: " + words, err
    code, _, err = run(capsys, "train", "--schedule", "1f1b", "--chunks", "3", "--steps", "1", "--executor", "emulate")
    assert code == 2 and err.endswith("pipetrain train: " + words), err
    code, out, _ = run(capsys, "schedule", "--compare", "1f1b,interleaved", "--chunks", "3")  # interleaved's
    assert code == 0 and "interleaved" in out


def test_torch_csv_written_read_and_refused_in_one_line(capsys, tmp_path):
    written = tmp_path / "dualpipev.csv"
    code, out, _ = run(capsys, "schedule", "DualPipeV", "--stages", "2", "--microbatches", "4", "--csv", str(written),
                       "--format", "torch")
    assert code == 0 and "dualpipev (policy flush): 2 stages on 2 ranks" in out
    assert written.read_text().splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,")
    code, out, _ = run(capsys, "schedule", "--load", str(written), "--json")
    assert code == 0 and json.loads(out)["schedule"] == "torch"
    code, _, err = run(capsys, "schedule", "1f1b", "--format", "torch")
    assert code == 2 and "add --csv" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n")
    result = subprocess.run([sys.executable, "-m", "pipetrain.cli", "schedule", "--load", str(bad), "--plot",
                             str(tmp_path / "p.png")], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "row 1 (rank 0), cell 2 ('0F1')" in result.stderr
    assert not (tmp_path / "p.png").exists()  # nothing ran


def test_torch_names_and_the_closest_suggestion(capsys):
    code, out, _ = run(capsys, "schedule", "InterleavedZeroBubble", "--stages", "2", "--chunks", "2", "--microbatches",
                       "4")
    assert code == 0 and out.startswith("interleaved-zb (policy flush)")
    code, _, err = run(capsys, "schedule", "dualpipe")
    assert code == 2 and "did you mean dualpipev" in err
