"""A PB study probe: DTS with the momentum memory lengthened k**q times instead of k.

Runs ``pipetrain pb`` with DTS's per-stage settings replaced by ``(1/k**2, 1 - (1-m)/k**q)``, so
the study's ``dtsN`` rows are that variant (q = 1: DTS itself; q = 2: ``dttN``). The patch lives
in this process only: give ``--workers 1``. Recorded in benchmarks/RESULTS.md section 7.

    PYTHONPATH=src python benchmarks/pb_memory_probe.py 1.5 pb --model resmlp:depth=62 ... --workers 1
"""
import sys
import pipetrain.optim.spec as spec
from pipetrain.optim.compensation import delay_lr_factor

q = float(sys.argv.pop(1))


def patched(momentum, delay, reference_delay=4.0):
    if delay <= reference_delay:
        return 1.0, momentum
    k = delay / reference_delay
    return delay_lr_factor(delay, reference_delay), 1.0 - (1.0 - momentum) / k ** q


spec.time_scaled_settings = patched
from pipetrain.cli import main  # noqa: E402
sys.exit(main())
