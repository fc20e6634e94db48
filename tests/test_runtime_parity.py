"""The distributed runtime ends with the emulator's parameters, bitwise, for every schedule.

Workers are real processes talking over gloo. Comparisons are bitwise: both executors run the
same stage arithmetic in the same order per rank and messages carry exact bytes; a SYNC of two
replicas adds two tensors, which is commutative, so replicated layouts of two replicas are exact
too (three or more replicas may round differently inside gloo's all-reduce).
"""

from __future__ import annotations

import dataclasses

import pytest
from distributed_parity import assert_distributed_equals_emulated

from pipetrain.training import TrainConfig


BASE = dict(model="mlp:depth=5,width=16", data="synthetic:features=8,classes=3,samples=96", batch_size=12,
            steps=4, optimizer="sgd:lr=0.05,momentum=0.9", progress=False, timeout=60.0)

CASES = {
    2: [
        ("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("interleaved", {"chunks": 2, "microbatches": 4}),
        ("bfs", {"chunks": 2, "microbatches": 3}), ("interleaved-zb", {"chunks": 2, "microbatches": 4}),
        ("dualpipev", {"microbatches": 4}),
        ("zb-h2", {"microbatches": 4}), ("zb-v", {"microbatches": 3}),
        ("pipedream", {}), ("pipedream", {"policy": "vsync"}), ("2bw", {"microbatches": 3}),
        ("pb", {"batch_size": 1, "steps": 24}), ("pb", {"batch_size": 1, "steps": 16, "compensation": "sc+lwp"}),
    ],
    # (the delay-scaled lr: stage 0 of 3 (D = 4) at a quarter of the rate, stage 1 at D* = 2 untouched;
    # delay time scaling: stage 0 also with 1 - m halved; rate-following, back to SGD's as the rate decays)
    3: [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("pipedream", {}), ("2bw", {"microbatches": 3}),
        ("pb", {"batch_size": 1, "steps": 20}), ("pb", {"batch_size": 1, "steps": 16, "compensation": "sc+lwp+dlr2"}),
        ("pb", {"batch_size": 1, "steps": 16, "compensation": "sc+lwp+dts2"}),
        ("pb", {"batch_size": 1, "steps": 16, "compensation": "sc+lwp+dtsf2", "lr_schedule": "end:total=16,fraction=0.5"}),
        ("pb", {"batch_size": 1, "steps": 16, "compensation": "sc+lwp+dtt2"}),
        ("1f1b", {"replicas": [2, 1], "microbatches": 4}),
        ("pipedream", {"replicas": [2, 1], "steps": 6})],
}


def configs_for(workers, tmp_path):
    out = []
    for index, (schedule, extra) in enumerate(CASES[workers]):
        options = {**BASE, **extra}
        stages = len(extra["replicas"]) if "replicas" in extra else workers
        config = TrainConfig(schedule=schedule, stages=stages, executor="distributed", **options)
        out.append(dataclasses.replace(config, save=str(tmp_path / f"w{workers}-{index}-distributed.pt")))
    return out


@pytest.mark.parametrize("workers", [2, 3])
def test_distributed_equals_emulated(tmp_path, workers):
    assert_distributed_equals_emulated(configs_for(workers, tmp_path), workers, timeout=240)
