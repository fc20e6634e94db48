"""The timeline simulator: start and end of every action of every rank, given costs.

Each rank runs its program in order. An action starts when the rank is free, after the runner's
``overhead``; a RECV ends when the message has arrived (sent at the end of the SEND plus
``transfer`` time) plus the receiver's ``receiving`` time; a SEND keeps its rank busy for its
``sending`` time, then the rank goes on (like ``isend``) while the message is in flight. With a
``quantum`` (a transport that shares the sender's core) the message leaves only when its sender
next enters a RECV or SYNC or ends its program, or ``quantum`` after the SEND, whichever is first. A SYNC
ends when all replicas of its stage have reached it plus the all-reduce time. The run is a longest-path computation over that dependency graph,
processed with a worklist, so it also serves as the dry run that finds deadlocks: if ranks remain
blocked with nothing left to wake them, :class:`~pipetrain.errors.DeadlockError` names them and
the actions they wait on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from pipetrain.errors import DeadlockError
from pipetrain.collector import gc_paused
from pipetrain.schedule.costs import Costs, StageCosts
from pipetrain.schedule.ir import Action, Kind, Schedule, format_action

__all__ = ["Timeline", "simulate", "dry_run", "positions", "position_of"]

_COMPUTE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB)


@dataclass
class Timeline:
    """Simulated (or measured) start and end times of every action, rank by rank."""

    schedule: Schedule
    starts: list[list[float]]
    ends: list[list[float]]
    costs: StageCosts | None = None
    busy_times: list[float] | None = None  # filled by the simulator; measured timelines sum spans
    #: measured over a window of a long run (pipetrain.execution.timing): the end of every update
    #: of the last stage's first replica, over the whole run
    update_ends: list[float] | None = None

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.ends if e), default=0.0)

    def busy(self, rank: int) -> float:
        """Time the rank spends computing (F, B, I, W) and updating (STEP)."""
        if self.busy_times is not None:
            return self.busy_times[rank]
        total = 0.0
        for action, start, end in zip(self.schedule.programs[rank], self.starts[rank], self.ends[rank]):
            if action.kind in _COMPUTE_KINDS or action.kind is Kind.STEP:
                total += end - start
        return total

    def spans(self, rank: int) -> list[tuple[Action, float, float]]:
        return list(zip(self.schedule.programs[rank], self.starts[rank], self.ends[rank]))


def positions(schedule: Schedule) -> list[list[int]]:
    """The ranks of each pipeline position: a stage's replicas, or for interleaved one rank each."""
    if schedule.chunks > 1:
        return [[rank] for rank in range(schedule.num_ranks)]
    return [list(ranks) for ranks in schedule.stage_ranks]


def position_of(schedule: Schedule) -> list[int] | None:
    """``[position of stage s]`` for a schedule with chunks (its stage's rank), else None."""
    if schedule.chunks > 1:
        return [ranks[0] for ranks in schedule.stage_ranks]
    return None


def simulate(schedule: Schedule, costs: Costs | StageCosts | None = None) -> Timeline:
    """Simulate ``schedule`` under ``costs`` (default F=1, B=2)."""
    with gc_paused():
        return _simulate(schedule, costs)


def _simulate(schedule: Schedule, costs: Costs | StageCosts | None) -> Timeline:
    if not isinstance(costs, StageCosts):
        costs = (costs or Costs()).resolve(schedule.num_stages, len(positions(schedule)), schedule.chunks,
                                           position_of(schedule))
    programs = schedule.programs
    stage_ranks = schedule.stage_ranks
    num_stages = schedule.num_stages
    forward, backward, weight = costs.forward, costs.backward, costs.weight
    full, step, sync_cost, transfer = costs.full_backward, costs.step, costs.sync, costs.transfer
    sending, receiving, overhead, quantum = costs.sending, costs.receiving, costs.overhead, costs.quantum
    F, B, I, W, FB = Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB
    SEND_F, RECV_F, SEND_B, RECV_B, SYNC, STEP = (
        Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP,
    )

    n = len(programs)
    starts = [[0.0] * len(p) for p in programs]
    ends = [[0.0] * len(p) for p in programs]
    pcs = [0] * n
    clocks = [0.0] * n
    busy = [0.0] * n
    arrivals: dict[int, float] = {}
    waiting: dict[int, int] = {}
    syncs: dict[tuple[int, int], list] = {}
    sync_seen = [dict() for _ in range(n)]
    ready = deque(range(n))
    queued = [True] * n
    #: per rank, messages sent but not yet left (with a quantum): [due, key, time in flight]
    unsent: list[list[list]] = [[] for _ in range(n)]

    def deliver(key: int, at: float) -> None:
        """The message ``key`` arrives at ``at``: its receiver, if it waits for it, goes on."""
        arrivals[key] = at
        waiter = waiting.pop(key, None)
        if waiter is not None and not queued[waiter]:
            queued[waiter] = True
            ready.append(waiter)

    def depart(rank: int, now: float, everything: bool) -> None:
        """The rank's unsent messages leave: those due by ``now``, or all (the rank waits)."""
        kept = []
        for message in unsent[rank]:
            due, key, flight = message
            if everything or due <= now:
                deliver(key, min(due, now) + flight)
            else:
                kept.append(message)
        unsent[rank] = kept

    while ready:
        rank = ready.popleft()
        queued[rank] = False
        program = programs[rank]
        length = len(program)
        pc = pcs[rank]
        t = clocks[rank]
        st = starts[rank]
        en = ends[rank]
        work = busy[rank]
        while pc < length:
            action = program[pc]
            kind = action[0]
            stage = action[1]
            t += overhead  # the runner's own time before the action (a RECV that waits pays it again)
            if kind is F:
                st[pc] = t
                t += forward[stage]
                work += forward[stage]
            elif kind is B:
                st[pc] = t
                t += full[stage]
                work += full[stage]
            elif kind is I:
                st[pc] = t
                t += backward[stage]
                work += backward[stage]
            elif kind is W:
                st[pc] = t
                t += weight[stage]
                work += weight[stage]
            elif kind is FB:  # the halves one after the other, as a CPU runs them (docs/design.md 2)
                half = action[4]
                cost = forward[stage] + (full[half[1]] if half[0] is B else backward[half[1]])
                st[pc] = t
                t += cost
                work += cost
            elif kind is SEND_F or kind is SEND_B:
                st[pc] = t
                boundary = stage if kind is SEND_F else stage - 1
                t += sending[boundary]
                if kind is SEND_F:
                    key = (action[2] * num_stages + stage + 1) << 1
                else:
                    key = ((action[2] * num_stages + stage - 1) << 1) | 1
                if quantum:
                    unsent[rank].append([t + quantum, key, transfer[boundary]])
                else:
                    deliver(key, t + transfer[boundary])
            elif kind is RECV_F or kind is RECV_B:
                key = (action[2] * num_stages + stage) << 1
                if kind is RECV_B:
                    key |= 1
                if quantum and unsent[rank]:  # the rank enters the transport: its own messages go
                    depart(rank, t, True)
                arrival = arrivals.get(key)
                if arrival is None:
                    waiting[key] = rank
                    t -= overhead  # charged when the rank comes back to it
                    break
                st[pc] = t
                if arrival > t:
                    t = arrival
                t += receiving[stage - 1 if kind is RECV_F else stage]
            elif kind is SYNC:
                if quantum and unsent[rank]:
                    depart(rank, t, True)
                index = sync_seen[rank].get(stage, 0)
                state = syncs.get((stage, index))
                if state is None:
                    state = syncs[(stage, index)] = [{}, None, []]
                arrived, done, waiters = state
                if done is None:
                    arrived.setdefault(rank, t)
                    if len(arrived) < len(stage_ranks[stage]):
                        if rank not in waiters:
                            waiters.append(rank)
                        t -= overhead  # charged when the rank comes back to it
                        break
                    done = state[1] = max(arrived.values()) + sync_cost[stage]
                    for other in waiters:
                        if not queued[other]:
                            queued[other] = True
                            ready.append(other)
                sync_seen[rank][stage] = index + 1
                st[pc] = t
                t = max(t, done)
            elif kind is STEP:
                st[pc] = t
                t += step[stage]
                work += step[stage]
            en[pc] = t
            pc += 1
            if quantum and unsent[rank]:
                depart(rank, t, pc == length)
        pcs[rank] = pc
        clocks[rank] = t
        busy[rank] = work

    stuck = [r for r in range(n) if pcs[r] < len(programs[r])]
    if stuck:
        raise DeadlockError(_deadlock_message(schedule, stuck, pcs, syncs, sync_seen))
    return Timeline(schedule, starts, ends, costs, busy)


def dry_run(schedule: Schedule) -> None:
    """Run all ranks together with unit costs; raise DeadlockError if they get stuck."""
    simulate(schedule, Costs(F=1, B=1, W=1))


def _waits_on(schedule: Schedule, rank: int, action: Action, syncs, sync_seen) -> tuple[str, list[int]]:
    kind = action.kind
    if kind in (Kind.RECV_F, Kind.RECV_B):
        source_stage = action.stage - 1 if kind is Kind.RECV_F else action.stage + 1
        if action.peer is not None:
            peer = action.peer
        elif 0 <= source_stage < schedule.num_stages:
            peer = schedule.rank_of(source_stage, action.microbatch)
        else:
            return "data from a stage that does not exist", []
        send_kind = Kind.SEND_F if kind is Kind.RECV_F else Kind.SEND_B
        sends = any(
            a.kind is send_kind and a.stage == source_stage and a.microbatch == action.microbatch
            for a in schedule.programs[peer]
        ) if peer < schedule.num_ranks else False
        what = f"{send_kind.value} of microbatch {action.microbatch} from rank {peer}"
        if not sends:
            what += " (which rank never sends: its program has no such SEND)"
        return what, [peer]
    if kind is Kind.SYNC:
        index = sync_seen[rank].get(action.stage, 0)
        state = syncs.get((action.stage, index))
        arrived = state[0] if state else {}
        missing = [r for r in schedule.stage_ranks[action.stage] if r not in arrived]
        return f"replicas on ranks {missing} to reach SYNC #{index} of stage {action.stage}", missing
    return "nothing (internal error)", []


def _deadlock_message(schedule: Schedule, stuck: Sequence[int], pcs, syncs, sync_seen) -> str:
    lines = [f"the schedule deadlocks: ranks {list(stuck)} wait forever"]
    edges: dict[int, list[int]] = {}
    for rank in stuck[:8]:
        action = schedule.programs[rank][pcs[rank]]
        what, peers = _waits_on(schedule, rank, action, syncs, sync_seen)
        edges[rank] = peers
        lines.append(f"  rank {rank} is stuck at action #{pcs[rank]} {format_action(action)}, waiting for {what}")
    for rank in stuck[8:]:
        action = schedule.programs[rank][pcs[rank]]
        edges[rank] = _waits_on(schedule, rank, action, syncs, sync_seen)[1]
    cycle = _find_cycle(edges)
    if cycle:
        lines.append("  wait cycle: " + " -> ".join(f"rank {r}" for r in cycle + [cycle[0]]))
    lines.append("reorder the programs so that every RECV's matching SEND can run first")
    return "\n".join(lines)


def _find_cycle(edges: dict[int, list[int]]) -> list[int]:
    for start in edges:
        path, seen, node = [], set(), start
        while node in edges and node not in seen:
            seen.add(node)
            path.append(node)
            nexts = [p for p in edges[node] if p in edges]
            if not nexts:
                break
            node = nexts[0]
        if node in seen:
            return path[path.index(node):]
    return []
