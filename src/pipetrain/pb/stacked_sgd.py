"""The batched PB engine's optimizer: momentum SGD with Spike Compensation and LWP on stacked rows.

One :class:`StackedSGD` updates every member of every group in place, each with its own learning
rate (and lr schedule), momentum, weight decay, spike coefficients and LWP horizon, as the
members' :class:`pipetrain.optim.SGD` (or :class:`~pipetrain.optim.sgd.RateFollowingSGD`) would.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from pipetrain.optim import SGD, StageOptimizer, spike_coefficients
from pipetrain.optim.sgd import RateFollowingSGD
from pipetrain.pb.groups import Group, NotBatchable, parameter_views
from pipetrain.pb.kernels import Outer, materialize

__all__ = ["StackedSGD", "sgd_options"]


def sgd_options(opt: StageOptimizer) -> tuple[float, float, float, float, float, float, Any]:
    """(lr, momentum, weight_decay, a, b, lwp_horizon, schedule) of a plain SGD stage optimizer
    (of a :class:`RateFollowingSGD`: its base momentum and the coefficients of that momentum)."""
    if type(opt) not in (SGD, RateFollowingSGD):
        raise NotBatchable(f"the batched engine runs momentum SGD only, not {type(opt).__name__}")
    if opt.dampening != 0.0:
        raise NotBatchable("the batched engine does not implement SGD dampening")
    m = opt.base_momentum if isinstance(opt, RateFollowingSGD) else opt.momentum
    if opt.nesterov:
        a, b = m, 1.0
    elif opt.sc_delay:
        a, b = spike_coefficients(m, opt.sc_delay)
    else:
        a, b = 1.0, 0.0
    return opt.lr, m, opt.weight_decay, a, b, opt.lwp_horizon, opt.lr_schedule


class StackedSGD:
    """The optimizer state of every member of the engine's groups, and the update that uses it.

    Construction sets each group's momentum, decay, spike and LWP flags (and LWP's predicted
    weights); :meth:`rates` gives the per-member rates of a block of ticks, :meth:`update` applies
    one group's gradients.
    """

    def __init__(self, groups: list[Group], optimizers: Sequence[Sequence[StageOptimizer]], num_stages: int,
                 batch_size: int, dtype: torch.dtype) -> None:
        self.batch_size = batch_size
        self.dtype = dtype
        schedules: list[Any] = []
        offsets, lrs, a_list, b_list, horizons, schedule_ids = [], [], [], [], [], []
        follow_keys: list[tuple] = []  # per member: what its per-update (factor, m, a, b) depend on
        followers: dict[tuple, RateFollowingSGD] = {}  # one optimizer of each rate-following key
        start = 0
        every_momentum: set[float] = set()
        for group in groups:
            momenta, decays, a_g, b_g, t_g = [], [], [], [], []
            for member in group.members:
                opt = optimizers[member.run][member.stage]
                lr, m, wd, a, b, horizon, schedule = sgd_options(opt)
                if schedule not in schedules:
                    schedules.append(schedule)
                if isinstance(opt, RateFollowingSGD):
                    key = ("follow", schedules.index(schedule), m, opt.stage_delay, opt.reference_delay, opt.sc_delay)
                    follow_keys.append(key)
                    followers.setdefault(key, opt)
                else:
                    follow_keys.append(("constant", m, a, b))
                schedule_ids.append(schedules.index(schedule))
                offsets.append(2 * num_stages - 2 - member.stage)
                lrs.append(lr)
                momenta.append(m)
                decays.append(wd)
                a_g.append(a)
                b_g.append(b)
                t_g.append(horizon)
            column = lambda v: torch.tensor(v, dtype=self.dtype).unsqueeze(1)  # noqa: E731
            group.momentum = column(momenta)
            every_momentum.update(momenta)
            group.following = any(key[0] == "follow" for key in follow_keys[start : start + group.size])
            group.weight_decay = column(decays) if any(decays) else None
            group.spike = not (all(a == 1.0 for a in a_g) and not any(b_g))
            group.lwp = any(t > 0 for t in t_g)
            if group.lwp:
                storage = [w.clone() for w in group.storage_w]
                group.flat_predicted = [w.view(group.size, -1) for w in storage]
                group.forward_views = parameter_views(group, storage)
            if group.kernel is not None:
                group.forward_context = group.kernel.prepare(group.forward_views)
                group.backward_context = group.kernel.prepare(group.weights)
            group.member_slice = slice(start, start + group.size)
            start += group.size
            a_list.extend(a_g)
            b_list.extend(b_g)
            horizons.extend(t_g)
        self._schedules = schedules
        self._offsets = np.array(offsets, dtype=np.int64)
        # One momentum for every member: the fused scalar update. Otherwise every group multiplies
        # by a column, also where its own members agree, so that a run's bits depend only on
        # whether the engine's runs share one momentum, never on which runs they are.
        # (rate-following members change their momentum per update: never one momentum)
        if len(every_momentum) == 1 and not followers:
            for group in groups:
                group.momentum = next(iter(every_momentum))
        self._base_lr = np.array(lrs, dtype=np.float64)
        self._coefficients = np.array([a_list, b_list, horizons], dtype=np.float64)
        self._schedule_ids = np.array(schedule_ids, dtype=np.int64)
        # rate-following members (dtsf): factor, momentum and spike coefficients change per update
        self._follow_keys, self._followers = None, followers
        if followers:
            distinct = list(dict.fromkeys(follow_keys))
            self._follow_keys = distinct
            self._follow_ids = np.array([distinct.index(key) for key in follow_keys], dtype=np.int64)
            self._horizons = np.array(horizons, dtype=np.float64)

    def update(self, group: Group, grads: list, rates: Tensor, valid: Tensor | None,
                momenta: Tensor | None = None) -> None:
        """Momentum SGD (+ SC) on the group's rows, one weight tensor at a time (cache friendly).

        ``rates`` is ``[3, G, 1]``: ``-lr*a``, ``-lr*b`` and ``-lr*T`` per member, where
        ``(a, b)`` are the spike coefficients (``(1, 0)`` without SC). With
        ``g = grad + weight_decay*w``: ``v <- m*v + g``, ``w <- w - lr*(a*v + b*g)``.

        In the ticks where some members have no sample (pipeline warm-up and drain), ``valid``
        marks the others: the rates of the idle ones are 0 (their weights stay), their output
        gradient was zeroed (so in warm-up their momentum stays 0), and so is their decay. Their
        momentum may still shrink in the drain, when no update follows. ``momenta`` (``[G, 1]``)
        replaces the group's momentum for this update (rate-following members).
        """
        g = group.size
        momentum, decay, spike = group.momentum if momenta is None else momenta, group.weight_decay, group.spike
        if valid is not None and decay is not None:
            decay = decay * valid  # members without a sample this tick: no decay either
        scalar = not isinstance(momentum, Tensor)
        step_v, step_g = rates[0], rates[1]
        pairs = [grads[i] for i in group.large]
        if group.small:
            small = [grads[i] for i in group.small]
            pairs.append(torch.cat([t if t.dim() == 2 else materialize(t).reshape(g, -1) for t in small], 1))
        for grad, (w, v, w2, v2) in zip(pairs, group.update_views):
            if isinstance(grad, Outer) and not (spike and decay is not None):
                # v <- m*v + a @ b without materialising the gradient
                if scalar:
                    v.baddbmm_(grad.a, grad.b, beta=momentum)
                else:
                    v2.mul_(momentum)
                    v.baddbmm_(grad.a, grad.b)
                if decay is not None:
                    v2.addcmul_(w2, decay)
                w2.addcmul_(v2, step_v)
                if spike:
                    w.baddbmm_(grad.a * step_g.view(g, 1, 1), grad.b)
                continue
            grad2 = materialize(grad).reshape(g, -1)
            if decay is not None:
                grad2 = torch.addcmul(grad2, w2, decay)
            if scalar:
                torch.add(grad2, v2, alpha=momentum, out=v2)  # v <- m*v + g
            else:
                v2.mul_(momentum).add_(grad2)
            w2.addcmul_(v2, step_v)
            if spike:
                w2.addcmul_(grad2, step_g)


    def rates(self, ticks: np.ndarray, updates: int, table: np.ndarray,
               follow: np.ndarray | None = None) -> tuple[Tensor, Tensor, np.ndarray, Tensor | None]:
        """For a block of ticks: ``[n, 3, M, 1]`` update rates of every member (0 for members
        without a sample), the validity mask ``[n, M, 1]``, per tick whether all are valid, and
        (with rate-following members, ``follow`` from :meth:`follow_table`) the momentum of
        every member's update ``[n, M, 1]``, else None."""
        step = ticks[:, None] - self._offsets[None, :]
        valid = (step >= 0) & (step < updates)
        clipped = np.clip(step, 0, updates - 1)
        numpy_dtype = np.float32 if self.dtype == torch.float32 else np.float64
        momenta = None
        if follow is None:
            lr = self._base_lr * table[self._schedule_ids, clipped] * valid
            rates = -(lr[:, None, :] * self._coefficients[None])
        else:
            settings = follow[self._follow_ids[None, :], :, clipped]  # [n, M, 4]: factor, m, a, b
            lr = self._base_lr * table[self._schedule_ids, clipped] * settings[..., 0] * valid
            coefficients = np.stack([settings[..., 2], settings[..., 3],
                                     np.broadcast_to(self._horizons, lr.shape)], 1)  # [n, 3, M]
            rates = -(lr[:, None, :] * coefficients)
            momenta = torch.from_numpy(settings[..., 1].astype(numpy_dtype)).unsqueeze(-1)
        rates_t = torch.from_numpy(rates.astype(numpy_dtype)).unsqueeze(-1)
        valid_t = torch.from_numpy(valid.astype(numpy_dtype)).unsqueeze(-1)
        return rates_t, valid_t, valid.all(1), momenta

    def follow_table(self, updates: int, table: np.ndarray) -> np.ndarray | None:
        """``[K, 4, updates]``: (lr factor, momentum, a, b) of each distinct member setting per
        update, as :class:`~pipetrain.optim.sgd.RateFollowingSGD` takes them at that update's lr
        schedule factor (constant for the members that do not follow the rate); None without
        rate-following members."""
        if self._follow_keys is None:
            return None
        out = np.empty((len(self._follow_keys), 4, updates), dtype=np.float64)
        for i, key in enumerate(self._follow_keys):
            if key[0] == "constant":
                out[i] = np.array([1.0, key[1], key[2], key[3]])[:, None]
                continue
            follower, schedule_id = self._followers[key], key[1]
            for n in range(updates):
                out[i, :, n] = follower.settings_for(float(table[schedule_id, n]))
        return out

    def lr_table(self, updates: int) -> np.ndarray:
        table = np.empty((len(self._schedules), updates), dtype=np.float64)
        for i, schedule in enumerate(self._schedules):
            table[i] = [schedule.factor(n * self.batch_size) for n in range(updates)]
        return table
