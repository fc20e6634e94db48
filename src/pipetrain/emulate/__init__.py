"""The single-process emulator: any schedule of the IR on real modules, deterministically."""

from pipetrain.emulate.emulator import Emulator, all_reduce_sum

__all__ = ["Emulator", "all_reduce_sum"]
