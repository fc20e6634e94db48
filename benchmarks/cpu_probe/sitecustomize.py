"""benchmarks/stage_cpu.py's probe: each worker sums the CPU time of its stages' forward and backward.

On PYTHONPATH (stage_cpu.py puts it there, and pipetrain's launcher hands its path on to the
workers) with PIPETRAIN_CPU_PROBE naming a directory, every Python process wraps
``StageExecutor.forward`` and ``.backward`` and, as it ends (a worker through ``os._exit``), writes
``<pid>.json`` there: its RANK and, per method, the calls and their summed thread CPU time, wall
time, minor page faults and involuntary context switches. The same two methods run in pipetrain's
runtime and in the hand loops of vs_torch_pipelining.py, so their costs per call compare the
stages' arithmetic inside each, apart from the transport and the runner around them.
"""

import os

if os.environ.get("PIPETRAIN_CPU_PROBE"):
    import json
    import resource
    import time

    from pipetrain.execution.stage import StageExecutor

    _totals: dict[str, list[int]] = {}

    def _counted(name: str):
        method = getattr(StageExecutor, name)

        def counted(*args, **kwargs):
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                after = resource.getrusage(resource.RUSAGE_THREAD)
                total = _totals.setdefault(name, [0, 0, 0, 0, 0])
                total[0] += 1
                total[1] += time.thread_time_ns() - cpu
                total[2] += time.perf_counter_ns() - wall
                total[3] += after.ru_minflt - usage.ru_minflt
                total[4] += after.ru_nivcsw - usage.ru_nivcsw

        counted.__wrapped__ = method
        return counted

    for _name in ("forward", "backward"):
        setattr(StageExecutor, _name, _counted(_name))

    _exit = os._exit

    def _probed_exit(code: int) -> None:
        if _totals:
            keys = ("calls", "cpu_ns", "wall_ns", "minor_faults", "involuntary_switches")
            record = {"rank": os.environ.get("RANK"), "methods": {m: dict(zip(keys, t)) for m, t in _totals.items()}}
            path = os.path.join(os.environ["PIPETRAIN_CPU_PROBE"], f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as out:
                json.dump(record, out)
            os.replace(path + ".tmp", path)
        _exit(code)

    os._exit = _probed_exit
