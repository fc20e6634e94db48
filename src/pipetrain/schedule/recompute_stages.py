"""Which stages recompute their activations in the backward: the forms of ``--recompute``.

``none`` keeps every activation; ``stage`` makes every stage keep only its inputs and run its
forward again in its backward; ``stage:0,2`` does that on stages 0 and 2 only (the schedule's stage
numbers: with ``--chunks``, the model's pieces in order, not the ranks). A plan file says it per
stage (``"recompute": true`` in a stage of ``pipetrain plan --out``), and a run without
``--recompute`` takes its plan's choice. Recomputation changes no number a run computes (see
:mod:`pipetrain.execution.stage`), only what a stage holds and how long its backward takes.
"""

from __future__ import annotations

from typing import Collection

from pipetrain.errors import ConfigError, option

__all__ = ["RECOMPUTE", "parse_recompute", "recompute_stages", "format_recompute"]

#: the words of ``--recompute`` (``stage:LIST`` names the stages)
RECOMPUTE = ("none", "stage")
_FORMS = "none, stage (every stage) or stage:LIST (those stages, e.g. stage:0,2)"


def parse_recompute(text: str) -> bool | frozenset[int]:
    """``False`` (``none``), ``True`` (``stage``: every stage) or the stages ``stage:LIST`` names;
    a :class:`ConfigError` that shows the forms for anything else."""
    if text == "none":
        return False
    if text == "stage":
        return True
    head, colon, listed = str(text).partition(":")
    if head == "stage" and colon:
        try:
            stages = [int(item) for item in listed.split(",")]
        except ValueError:
            stages = []
        if stages and all(s >= 0 for s in stages):
            return frozenset(stages)
    raise ConfigError(f"unknown {option('recompute')} {text!r}; write {_FORMS}")


def recompute_stages(value: bool | str | Collection[int] | None, num_stages: int) -> frozenset[int]:
    """The stages of a ``num_stages``-stage schedule that recompute, from a ``--recompute`` text, a
    bool (every stage or none) or stage numbers; a stage the schedule does not have is a
    :class:`ConfigError`."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = parse_recompute(value)
    if isinstance(value, bool):
        return frozenset(range(num_stages)) if value else frozenset()
    stages = frozenset(int(s) for s in value)
    beyond = sorted(s for s in stages if not 0 <= s < num_stages)
    if beyond:
        raise ConfigError(
            f"{option('recompute', format_recompute(stages, None))} names stage {', '.join(map(str, beyond))}, "
            f"but the schedule "
            f"has {num_stages} stages (0 to {num_stages - 1}); name stages of this run"
        )
    return stages


def format_recompute(stages: Collection[int], num_stages: int | None) -> str:
    """The ``--recompute`` text of ``stages``: ``none``, ``stage`` when they are all
    ``num_stages`` of the schedule, else ``stage:0,2``."""
    chosen = sorted(set(stages))
    if not chosen:
        return "none"
    if num_stages is not None and chosen == list(range(num_stages)):
        return "stage"
    return "stage:" + ",".join(map(str, chosen))
