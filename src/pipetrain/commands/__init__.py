"""Sub-commands of the `pipetrain` command-line tool (see :mod:`pipetrain.cli`).

They import PyTorch and the library inside ``run``, on purpose: `pipetrain --help` and the checks of
options and output paths answer before PyTorch loads (a second or more). docs/design.md section 4.
"""

__all__: list[str] = []
