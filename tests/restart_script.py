"""A training script that survives a crash, as tests/test_runtime_faults.py and
tests/test_runtime_torchrun.py run it: ``python tests/restart_script.py OUT --kill SCHEDULE:STEP``
(it starts its own workers and starts them again after a failure, ``max_restarts=1``), or under
``torchrun --max-restarts 1`` (two agents). It trains 1f1b, pipedream and pb one after the other,
each checkpointing into OUT/SCHEDULE (``checkpoint_dir`` alone: started again, each run resumes
from its newest checkpoint, a finished one from its end), and the rank of the last stage kills
itself (SIGKILL) after update STEP of run SCHEDULE, on the first start of the workers only. The
main rank saves each model to OUT/SCHEDULE.pt; ``--executor emulate`` trains the same runs in this
process without a crash, the reference.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

from api_script import Points  # the same plain data set as the API's test script
from pipetrain import Pipeline
from pipetrain.runtime.launch import detect

RUNS = {"1f1b": dict(microbatches=2, batch_size=8, steps=12), "pipedream": dict(batch_size=8, steps=12),
        "pb": dict(batch_size=1, steps=40)}


def crash_after(step: int):
    """An update callback that kills this process after update ``step`` (0-based) of the first start."""
    env = detect()
    first_start = env is None or env.restart == 0

    def callback(done: int, loss: float) -> None:
        if first_start and done == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return callback


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", default="", help="SCHEDULE:STEP")
    parser.add_argument("--executor", default="distributed")
    args = parser.parse_args(argv)
    killed, _, step = args.kill.partition(":")
    env = detect()
    restarts = 0 if env is not None and env.launcher == "torchrun" else 1  # torchrun restarts its own workers
    for schedule, options in RUNS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        pipe = Pipeline(model, stages=2, schedule=schedule, executor=args.executor,
                        microbatches=options.get("microbatches"), optimizer="sgd:lr=0.05,momentum=0.9", timeout=30)
        distributed = args.executor == "distributed"
        pipe.fit(Points(), batch_size=options["batch_size"], steps=options["steps"], progress=False, quiet=True,
                 checkpoint_dir=os.path.join(args.out, schedule) if distributed else None,
                 max_restarts=restarts if distributed else 0,
                 callbacks=[crash_after(int(step))] if schedule == killed and distributed else [],
                 save=os.path.join(args.out, f"{schedule}{'' if distributed else '-emulated'}.pt"))


if __name__ == "__main__":
    main()
