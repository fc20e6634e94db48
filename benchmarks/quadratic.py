"""Largest stable step on a quadratic with delayed gradients: plain momentum, SC, LWP, SC+LWP.

The model problem of Kosson et al. (MLSys 2021): f(w) = lam*w**2/2, and update n applies the
gradient taken at the forward weights of version n-D (D updates old; version 0 for n < D). With
y = lr*v and h = lr*lam, one update of pipetrain's SGD (PyTorch-style momentum, SC coefficients
(a, b), LWP horizon T) is the linear recurrence

    u_k     = w_k - T*y_k                      forward weights of version k (LWP: predicted)
    y_{n+1} = m*y_n + h*u_{n-D}
    w_{n+1} = w_n - a*y_{n+1} - b*h*u_{n-D}

with state (w_n, y_n, u_{n-1}, ..., u_{n-D}). It is stable iff the spectral radius of its
companion matrix is below 1; the largest stable h (the first instability above h = 0) is found
by a geometric scan and bisection. A few cells are cross-checked by long runs of the scalar
recurrence (written separately, with a ring buffer) and by pipetrain's SGD itself.

Usage:  python benchmarks/quadratic.py [--out FILE.md]   (recorded in benchmarks/RESULTS.md, section 5)
        python benchmarks/quadratic.py --strengths [--momenta M --delays D,...]
            the best SC/LWP strengths per delay (SC delay A*D, LWP horizon B*D over a grid of A, B)
            and their bound times D**2: compensation alone saturates near 1/D**2, the reason for the
            delay-scaled learning rate (DLR, docs/optim.md)
        python benchmarks/quadratic.py --time-scaled [--momenta M --delays D,... --reference 8]
            DLR against delay time scaling (DTS, docs/optim.md) with full SC+LWP: each stage's
            stability margin relative to the stage at the reference delay D*, and how fast each
            moves along a flat direction (the effective rate lr/(1-m) and the convergence time)
        python benchmarks/quadratic.py --rate-following [--momenta M --delays D,... --reference 4]
            rate-following DTS (dtsf, docs/optim.md) while the lr schedule decays: each stage's margin
            at schedule factor f for k = (D/D*)*sqrt(f) against k = (D/D*)*f, and DTS variants with a
            longer memory, 1 - m_s = (1-m)/k**q: their margin and their progress along a flat direction
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections import deque

import numpy as np

from pipetrain.optim import build_stage_optimizer, spike_coefficients

__all__ = [
    "METHODS",
    "coefficients",
    "companion_matrix",
    "spectral_radius",
    "max_stable_h",
    "simulate",
    "simulate_optimizer",
    "grows",
    "time_scaled_table",
    "rate_following_table",
]

METHODS = ("none", "sc", "lwp", "sc+lwp")


def coefficients(
    method: str, momentum: float, delay: int, sc_scale: float = 1.0, lwp_scale: float = 1.0
) -> tuple[float, float, float]:
    """(a, b, T) of the update for a compensation method at delay D (SC's delay ``sc_scale*D``,
    LWP's horizon ``lwp_scale*D``)."""
    a, b = spike_coefficients(momentum, sc_scale * delay) if "sc" in method else (1.0, 0.0)
    horizon = lwp_scale * delay if "lwp" in method else 0.0
    return a, b, horizon


def companion_matrix(
    h: float, momentum: float, delay: int, method: str, sc_scale: float = 1.0, lwp_scale: float = 1.0
) -> np.ndarray:
    a, b, horizon = coefficients(method, momentum, delay, sc_scale, lwp_scale)
    size = 2 + delay
    matrix = np.zeros((size, size))
    # u_{n-D} as a row vector over the state
    source = np.zeros(size)
    if delay == 0:
        source[0], source[1] = 1.0, -horizon
    else:
        source[size - 1] = 1.0
    matrix[0, 0] = 1.0
    matrix[0, 1] = -a * momentum
    matrix[0] += -(a + b) * h * source
    matrix[1, 1] = momentum
    matrix[1] += h * source
    if delay > 0:
        matrix[2, 0], matrix[2, 1] = 1.0, -horizon
        for i in range(1, delay):
            matrix[2 + i, 1 + i] = 1.0
    return matrix


def spectral_radius(
    h: float, momentum: float, delay: int, method: str, sc_scale: float = 1.0, lwp_scale: float = 1.0
) -> float:
    matrix = companion_matrix(h, momentum, delay, method, sc_scale, lwp_scale)
    return float(np.max(np.abs(np.linalg.eigvals(matrix))))


def max_stable_h(
    momentum: float, delay: int, method: str, rel_tol: float = 1e-7, sc_scale: float = 1.0,
    lwp_scale: float = 1.0,
) -> float:
    """The first h > 0 at which the recurrence becomes unstable (spectral radius reaches 1)."""
    stable = lambda h: spectral_radius(h, momentum, delay, method, sc_scale, lwp_scale) < 1.0  # noqa: E731
    low = 1e-7
    if not stable(low):
        return 0.0
    high = low * 1.05
    while stable(high):
        low, high = high, high * 1.05
        if high > 1e3:
            return math.inf
    while high - low > rel_tol * low:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if stable(mid) else (low, mid)
    return low


def simulate(h: float, momentum: float, delay: int, method: str, steps: int) -> list[float]:
    """|w_n| of the scalar recurrence from w_0 = 1, v_0 = 0, written as the optimizer runs it."""
    a, b, horizon = coefficients(method, momentum, delay)
    w, y = 1.0, 0.0
    versions: deque[float] = deque([w] * (delay + 1), maxlen=delay + 1)  # u_{n-D} .. u_n
    out = []
    for _ in range(steps):
        q = h * versions[0]
        y = momentum * y + q
        w = w - a * y - b * q
        versions.append(w - horizon * y)
        out.append(abs(w))
    return out


def simulate_optimizer(
    h: float, momentum: float, delay: int, method: str, steps: int
) -> list[float]:
    """w_n of pipetrain's own SGD (lam = 1, lr = h): forward at version n-D, predicted with LWP."""
    import torch

    optimizer = build_stage_optimizer(
        f"sgd:lr={h!r},momentum={momentum!r}", stage_delay=delay, compensation=method
    )
    params = {"w": torch.ones(1, dtype=torch.float64)}
    forward = deque([optimizer.predict(params, 0)["w"]] * (delay + 1), maxlen=delay + 1)
    out = []
    for n in range(steps):
        params = optimizer.step(params, {"w": forward[0]}, samples_seen=n)  # gradient lam*u
        forward.append(optimizer.predict(params, samples_seen=n + 1)["w"])
        out.append(params["w"].item())
    return out


def grows(trajectory: list[float]) -> bool:
    """Whether the envelope of the last tenth exceeds that of the tenth before the middle."""
    tenth = max(1, len(trajectory) // 10)
    middle = len(trajectory) // 2
    return max(trajectory[-tenth:]) > max(trajectory[middle - tenth : middle])


def _cross_check(momentum: float, delay: int, method: str, h_max: float) -> str:
    verdicts = []
    for factor in (0.97, 1.03):
        rho = spectral_radius(factor * h_max, momentum, delay, method)
        steps = int(min(3e6, max(2000, 12 / abs(math.log(rho)))))
        unstable = grows(simulate(factor * h_max, momentum, delay, method, steps))
        verdicts.append(f"{factor:.2f}h*: {'grows' if unstable else 'decays'} ({steps} steps)")
    return "; ".join(verdicts)


def _summary(bounds: dict[tuple[float, int], dict[str, float]]) -> list[str]:
    """Sentences read off the table: gains of each method over plain delayed momentum."""
    out = ["Reading:", ""]
    for momentum in sorted({m for m, _ in bounds}):
        cells = {d: h for (m, d), h in bounds.items() if m == momentum}
        plain = [h["none"] * d / (1 - momentum) for d, h in cells.items()]
        gains = {
            method: [h[method] / h["none"] for h in cells.values()] for method in METHODS[1:]
        }
        worse = sorted(f"{method} at D={d}" for d, h in cells.items() for method in METHODS[1:]
                       if h[method] < h["none"])
        out.append(
            f"* m={momentum}: plain delayed momentum reaches {min(plain):.2f}-{max(plain):.2f} "
            "times (1-m)/D; gain over plain: "
            + ", ".join(f"{method} x{min(g):.2f}-{max(g):.2f}" for method, g in gains.items())
            + (f"; below plain (over-compensation): {', '.join(worse)}" if worse else "")
            + "."
        )
    return out


#: SC and LWP strengths (multiples of D) searched by --strengths
SC_SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)
LWP_SCALES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def best_strengths(momentum: float, delay: int, rel_tol: float = 1e-4) -> tuple[float, float, float]:
    """(h*, A, B): the largest stable h over SC delay A*D and LWP horizon B*D on the grid."""
    best = (0.0, 0.0, 0.0)
    for sc in SC_SCALES:
        for lwp in LWP_SCALES:
            method = "+".join(name for name, on in (("sc", sc > 0), ("lwp", lwp > 0)) if on) or "none"
            h = max_stable_h(momentum, delay, method, rel_tol, sc_scale=sc or 1.0, lwp_scale=lwp or 1.0)
            if h > best[0]:
                best = (h, sc, lwp)
    return best


def strengths_table(momenta: list[float], delays: list[int]) -> list[str]:
    """Markdown: per delay, plain, full SC+LWP and the best strengths, and h* times D**2."""
    lines = []
    for momentum in momenta:
        lines += [f"\nm = {momentum}\n",
                  "| D | none | none·D² | sc+lwp | sc+lwp·D² | best (SC A·D, LWP B·D) | best h* | best·D² |",
                  "|---|---|---|---|---|---|---|---|"]
        for delay in delays:
            plain = max_stable_h(momentum, delay, "none", 1e-4)
            full = max_stable_h(momentum, delay, "sc+lwp", 1e-4)
            h, sc, lwp = best_strengths(momentum, delay)
            square = delay * delay
            lines.append(f"| {delay} | {plain:.3g} | {plain * square:.3f} | {full:.3g} | {full * square:.3f} | "
                         f"A={sc:g}, B={lwp:g} | {h:.3g} | {h * square:.3f} |")
    return lines


def _convergence_time(h: float, momentum: float, delay: int, method: str) -> float:
    """Samples for the error along a direction with ``h = lr*lam`` to fall by e: -1/ln(rho)."""
    return -1.0 / math.log(spectral_radius(h, momentum, delay, method))


def time_scaled_table(momenta: list[float], delays: list[int], reference: float, flat: float = 0.1) -> list[str]:
    """Markdown: per delay D > D*, DLR's and DTS's settings with full SC+LWP, each stage's stability
    margin (its largest stable h over the h it trains at, in units of the D* stage's margin: 1.00
    means exactly the margin of the stage at D*, below 1 less), and the convergence time along a
    flat direction, ``h = flat*(1-m)**2`` at the unscaled rate: one that undelayed momentum SGD
    moves along at its effective rate ``lr/(1-m)`` (overdamped), in about ``(1-m)/h`` samples (the
    factor printed: against undelayed momentum SGD at the unscaled rate)."""
    from pipetrain.optim.compensation import delay_lr_factor, time_scaled_settings

    lines = []
    for momentum in momenta:
        h_ref = max_stable_h(momentum, int(reference), "sc+lwp", 1e-5)
        h_flat = flat * (1 - momentum) ** 2
        base = _convergence_time(h_flat, momentum, 0, "none")
        lines += [f"\nm = {momentum}, D* = {reference:g} (its largest stable h with SC+LWP: {h_ref:.4g}); flat "
                  f"direction h = {flat:g}*(1-m)^2 = {h_flat:.3g}, undelayed momentum SGD: {base:.0f} samples\n",
                  "| D | DLR: lr factor | DLR: margin | DLR: flat-direction time | DTS: lr factor, 1-m_s | "
                  "DTS: margin | DTS: flat-direction time |",
                  "|---|---|---|---|---|---|---|"]
        for delay in delays:
            dlr = delay_lr_factor(delay, reference)
            dts, m_s = time_scaled_settings(momentum, delay, reference)
            margin_dlr = max_stable_h(momentum, delay, "sc+lwp", 1e-5) / (dlr * h_ref)
            margin_dts = max_stable_h(m_s, delay, "sc+lwp", 1e-5) / (dts * h_ref)
            t_dlr = _convergence_time(h_flat * dlr, momentum, delay, "sc+lwp")
            t_dts = _convergence_time(h_flat * dts, m_s, delay, "sc+lwp")
            lines.append(f"| {delay} | {dlr:.4g} | {margin_dlr:.2f} | {t_dlr:.0f} ({t_dlr / base:.1f}x) | "
                         f"{dts:.4g}, {1 - m_s:.3g} | {margin_dts:.2f} | {t_dts:.0f} ({t_dts / base:.1f}x) |")
    return lines


def _margin(momentum: float, delay: int, k: float, factor: float, h_ref: float, q: float = 1.0) -> float:
    """Margin of a stage with delay D under DTS settings for ``k`` (rate ``1/k**2``, ``1 - m_s =
    (1-m)/k**q``) while the schedule is at ``factor``, in units of the D* stage's at the full rate."""
    slow = 1.0 - (1.0 - momentum) / k**q
    return max_stable_h(slow, delay, "sc+lwp", 1e-4) * k * k / (factor * h_ref)


def _run_progress(lr: float, momentum: float, updates: int) -> float:
    """Distance a weight moves in ``updates`` updates under a constant unit gradient (momentum
    starting at 0): ``sum_n lr*(1 - m**(n+1))/(1 - m)``."""
    n = np.arange(updates)
    return float(np.sum(lr * (1.0 - momentum ** (n + 1)) / (1.0 - momentum)))


def rate_following_table(momenta: list[float], delays: list[int], reference: float,
                         factors: tuple[float, ...] = (1.0, 0.5, 0.25, 0.1, 0.03),
                         exponents: tuple[float, ...] = (1.0, 1.5, 2.0), updates: int = 14370) -> list[str]:
    """Markdown: (1) per delay and schedule factor f, the margin (1.00: the D* stage's at the full
    rate) of rate-following DTS with ``k = max(1, (D/D*)*sqrt(f))`` (dtsf) and with ``k = max(1,
    (D/D*)*f)``; (2) per delay, DTS with the memory lengthened ``k**q`` times (q = 1: DTS; q = 2:
    the effective rate and gradient-noise temperature ``lr/(1-m)`` of SGD): its margin, the
    convergence time along a flat direction and the distance moved under a constant gradient in
    ``updates`` updates (the 10-epoch digits run), each against undelayed momentum SGD."""
    lines = []
    for momentum in momenta:
        h_ref = max_stable_h(momentum, int(reference), "sc+lwp", 1e-5)
        lines += [f"\nm = {momentum}, D* = {reference:g} (largest stable h with SC+LWP: {h_ref:.4g})\n",
                  "Margin while the schedule decays (f: the schedule's factor):\n",
                  "| D | " + " | ".join(f"f = {f:g}: sqrt(f) (k), f (k)" for f in factors) + " |",
                  "|---|" + "---|" * len(factors)]
        for delay in delays:
            k0, cells = delay / reference, []
            for f in factors:
                ks, kl = max(1.0, k0 * math.sqrt(f)), max(1.0, k0 * f)
                cells.append(f"{_margin(momentum, delay, ks, f, h_ref):.2f} ({ks:.3g}), "
                             f"{_margin(momentum, delay, kl, f, h_ref):.2f} ({kl:.3g})")
            lines.append(f"| {delay} | " + " | ".join(cells) + " |")
        h_flat = 0.1 * (1 - momentum) ** 2
        base = _convergence_time(h_flat, momentum, 0, "none")
        sgd = _run_progress(1.0, momentum, updates)
        lines += [f"\nLonger memory at DTS's rate, 1 - m_s = (1-m)/k**q (flat direction h = 0.1*(1-m)^2: "
                  f"{base:.0f} samples for undelayed SGD; progress: distance moved in {updates} updates "
                  "under a constant gradient, against SGD's):\n",
                  "| D | " + " | ".join(f"q = {q:g}: margin, flat time, progress" for q in exponents) + " |",
                  "|---|" + "---|" * len(exponents)]
        for delay in delays:
            k, cells = delay / reference, []
            for q in exponents:
                slow = 1.0 - (1.0 - momentum) / k**q
                t = _convergence_time(h_flat / k**2, slow, delay, "sc+lwp")
                cells.append(f"{_margin(momentum, delay, k, 1.0, h_ref, q):.2f}, {t / base:.1f}x, "
                             f"{_run_progress(1.0 / k**2, slow, updates) / sgd:.3f}")
            lines.append(f"| {delay} | " + " | ".join(cells) + " |")
    return lines


def _machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(l.split(":", 1)[1].strip() for l in handle if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, " \
           f"Python {platform.python_version()}, numpy {np.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--momenta", default="0.9,0.999177")
    parser.add_argument("--delays", default="1,4,16,64")
    parser.add_argument("--strengths", action="store_true",
                        help="only the table of the best SC/LWP strengths per delay and their bound times D**2")
    parser.add_argument("--time-scaled", action="store_true",
                        help="only the table of DLR against delay time scaling (DTS), per delay, with SC+LWP")
    parser.add_argument("--rate-following", action="store_true",
                        help="only the tables of rate-following DTS and of DTS with a longer memory, with SC+LWP")
    parser.add_argument("--reference", type=float, default=8.0, help="D* of --time-scaled (default 8)")
    parser.add_argument("--out", default="-", help="markdown file to write (default '-': print only; the "
                        "recorded table is section 5 of benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    momenta = [float(x) for x in args.momenta.split(",")]
    delays = [int(x) for x in args.delays.split(",")]

    start = time.perf_counter()
    if args.strengths or args.time_scaled or args.rate_following:
        if args.strengths:
            rows = strengths_table(momenta, delays)
        elif args.time_scaled:
            rows = time_scaled_table(momenta, delays, args.reference)
        else:
            rows = rate_following_table(momenta, delays, args.reference)
        body = "\n".join(rows)
        print(body)
        print(f"\n{time.perf_counter() - start:.1f} s")
        if args.out != "-":
            with open(args.out, "w") as handle:
                handle.write(body + "\n")
        return 0
    lines = []
    bounds: dict[tuple[float, int], dict[str, float]] = {}
    for momentum in momenta:
        lines.append(f"\nm = {momentum}  (no delay: h < 2(1+m) = {2 * (1 + momentum):.4g}; "
                     f"(1-m)/D shown for reference)\n")
        lines.append(
            "| D | (1-m)/D | none | sc | lwp | sc+lwp | sc/none | lwp/none | sc+lwp/none |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for delay in delays:
            h = {method: max_stable_h(momentum, delay, method) for method in METHODS}
            bounds[momentum, delay] = h
            lines.append(
                f"| {delay} | {(1 - momentum) / delay:.3g} | "
                + " | ".join(f"{h[method]:.4g}" for method in METHODS)
                + " | " + " | ".join(f"{h[method] / h['none']:.2f}" for method in METHODS[1:])
                + " |"
            )
    table_seconds = time.perf_counter() - start

    checks = ["", "Cross-checks (long runs of the scalar recurrence at 0.97 and 1.03 times the "
                  "spectral-radius bound):", ""]
    for momentum, delay, method in [(0.9, 4, "none"), (0.9, 16, "sc+lwp"), (0.999177, 16, "sc"),
                                    (0.999177, 64, "lwp")]:
        h_max = max_stable_h(momentum, delay, method)
        checks.append(f"* m={momentum}, D={delay}, {method}: h*={h_max:.4g}; "
                      + _cross_check(momentum, delay, method, h_max))
    total = time.perf_counter() - start

    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["PYTHONPATH=src python benchmarks/quadratic.py", *given])
    body = "\n".join(lines + checks + [""] + _summary(bounds))
    print(body)
    print(f"\ntable {table_seconds:.1f} s, total {total:.1f} s")
    if args.out != "-":
        with open(args.out, "w") as handle:
            handle.write(
                "# Delay compensation on a quadratic: largest stable h = lr*lam\n\n"
                "f = lam*w^2/2, gradient at the forward weights of D updates ago (PyTorch-style "
                "momentum, pipetrain's SC coefficients, LWP horizon T = D). Largest h before the "
                "first instability, from the companion-matrix spectral radius (bisection to "
                "relative 1e-7).\n\n"
                f"Command: `{command}`  \nMachine: {_machine()}  \n"
                f"Time: table {table_seconds:.1f} s, with cross-checks {total:.1f} s\n"
                + body + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
