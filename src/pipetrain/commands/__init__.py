"""Sub-commands of the `pipetrain` command-line tool (see :mod:`pipetrain.cli`)."""

__all__: list[str] = []
