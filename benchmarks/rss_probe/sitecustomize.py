"""benchmarks/long_run.py's probe: each process of a run prints its own peak RSS as it ends.

On PYTHONPATH (long_run.py puts it there, and pipetrain's launcher hands its path on to the
workers) with PIPETRAIN_RSS_PROBE set, every Python process of the run prints one line to stderr
when it ends, ``RSSPROBE {"rank": ..., "peak_kb": ...}`` (``rank`` from RANK, null for the
launcher): a worker ends through ``os._exit``, the launcher through ``atexit``. The launching
process's ``getrusage(RUSAGE_CHILDREN)`` gives only the largest of the workers' peaks.
"""

import os

if os.environ.get("PIPETRAIN_RSS_PROBE"):
    import atexit
    import json
    import resource
    import sys

    def _report() -> None:
        rank = os.environ.get("RANK")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sys.stderr.write("RSSPROBE " + json.dumps({"rank": None if rank is None else int(rank), "peak_kb": peak}) + "\n")
        sys.stderr.flush()

    _exit = os._exit

    def _probed_exit(code: int) -> None:
        _report()
        _exit(code)

    os._exit = _probed_exit
    atexit.register(_report)
