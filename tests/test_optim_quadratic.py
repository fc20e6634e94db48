"""Checks of benchmarks/quadratic.py: the stability bounds against independent long runs."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "quadratic.py"
_SPEC = importlib.util.spec_from_file_location("pipetrain_bench_quadratic", _PATH)
quadratic = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(quadratic)


def test_known_bounds():
    # no delay: heavy-ball momentum is stable for h < 2(1+m); delay 1 without momentum: h < 1
    assert quadratic.max_stable_h(0.9, 0, "none") == pytest.approx(3.8, rel=1e-6)
    assert quadratic.max_stable_h(0.0, 1, "none") == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("method", quadratic.METHODS)
def test_recurrence_is_what_pipetrain_sgd_does(method):
    ours = quadratic.simulate_optimizer(0.03, 0.9, 4, method, 300)
    recurrence = quadratic.simulate(0.03, 0.9, 4, method, 300)
    assert [abs(w) for w in ours] == pytest.approx(recurrence, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("momentum, delay, method", [(0.9, 4, "none"), (0.9, 4, "sc+lwp"),
                                                     (0.9, 16, "sc")])
def test_bound_against_long_runs(momentum, delay, method):
    h_max = quadratic.max_stable_h(momentum, delay, method)
    assert not quadratic.grows(quadratic.simulate(0.97 * h_max, momentum, delay, method, 20000))
    assert quadratic.grows(quadratic.simulate(1.03 * h_max, momentum, delay, method, 20000))


def test_heavy_momentum_shape():
    momentum, delay = 0.999177, 16
    h = {m: quadratic.max_stable_h(momentum, delay, m) for m in quadratic.METHODS}
    assert h["none"] == pytest.approx((1 - momentum) / delay, rel=0.05)
    assert h["sc"] > 5 * h["none"] and h["lwp"] > 5 * h["none"]
    assert h["sc+lwp"] > max(h["sc"], h["lwp"])


def test_best_strengths_saturate_near_one_over_d_squared():
    # the reason for the delay-scaled learning rate: the best SC/LWP strengths on the grid reach
    # h* of order 1/D**2, far above plain delayed momentum's (1-m)/D but no higher
    momentum, delay = 0.996713, 8
    h, sc, lwp = quadratic.best_strengths(momentum, delay, rel_tol=1e-3)
    full = quadratic.max_stable_h(momentum, delay, "sc+lwp", 1e-3)
    assert h >= full * (1 - 1e-3) and sc in quadratic.SC_SCALES and lwp in quadratic.LWP_SCALES
    assert 0.4 < h * delay**2 < 1.0
    assert quadratic.max_stable_h(momentum, delay, "none", 1e-3) < (1 - momentum) / delay * 1.05
    # scaled strengths enter the recurrence as SC delay A*D and LWP horizon B*D
    assert quadratic.coefficients("sc+lwp", 0.9, 8, 0.5, 2.0) == (*quadratic.spike_coefficients(0.9, 4.0), 16.0)


@pytest.mark.parametrize("delay", [16, 32])
def test_delay_time_scaling_keeps_the_reference_margin_and_is_k_times_slower(delay):
    # DTS at D = k*D*: lr/k**2 and 1 - m over k. On the quadratic with SC+LWP the stage stays at
    # least as far from its bound as the stage at D* (a little further: the time scaling is exact
    # only in the continuum limit), and a flat direction (overdamped for undelayed SGD) converges
    # k times slower than without delay, where DLR's same rate with the memory untouched takes k**2
    from pipetrain.optim import time_scaled_settings

    momentum, reference = 0.99, 4
    k = delay / reference
    factor, slow_momentum = time_scaled_settings(momentum, delay, reference)
    bound = quadratic.max_stable_h(momentum, reference, "sc+lwp", 1e-6)
    margin = quadratic.max_stable_h(slow_momentum, delay, "sc+lwp", 1e-6) / (factor * bound)
    assert 1.0 <= margin < 1.25
    flat = 0.1 * (1 - momentum) ** 2
    base = quadratic._convergence_time(flat, momentum, 0, "none")
    dts = quadratic._convergence_time(flat * factor, slow_momentum, delay, "sc+lwp") / base
    dlr = quadratic._convergence_time(flat * factor, momentum, delay, "sc+lwp") / base
    assert dts == pytest.approx(k, rel=0.02)
    assert dlr > 0.9 * k**2


def test_rate_following_keeps_the_reference_margin_where_a_linear_law_loses_it():
    # dtsf: k = (D/D*)*sqrt(f) while the schedule is at f. With SC+LWP the bound goes as 1/D**2, so
    # the stage keeps (about) D*'s margin at the decayed rate f*lr; k proportional to f (the bound
    # of uncompensated delayed momentum, h*D fixed) leaves it at about f of it: unstable
    from pipetrain.optim.compensation import rate_following_settings

    momentum, reference, delay, f = 0.99, 4, 16, 0.25
    bound = quadratic.max_stable_h(momentum, reference, "sc+lwp", 1e-4)
    factor, slow = rate_following_settings(momentum, delay, f, reference)
    assert (factor, slow) == (0.25, 1 - (1 - momentum) / 2)
    margin = quadratic.max_stable_h(slow, delay, "sc+lwp", 1e-4) / (f * factor * bound)
    assert 1.0 <= margin < 1.3
    assert quadratic._margin(momentum, delay, 2.0, f, bound) == pytest.approx(margin, rel=1e-3)
    linear = quadratic._margin(momentum, delay, 1.0, f, bound)  # k = 4*f = 1: SGD's rate and memory
    assert linear < 0.5


def test_dtt_keeps_dts_margin_on_the_quadratic():
    # DTT: DTS's rate with the memory k**2 times longer (SGD's lr/(1-m)). With SC+LWP the bound
    # hardly depends on the momentum, so the margin stays that of DTS (and of the D* stage)
    from pipetrain.optim.compensation import temperature_settings, time_scaled_settings

    momentum, reference, delay = 0.99, 4, 16
    bound = quadratic.max_stable_h(momentum, reference, "sc+lwp", 1e-4)
    margins = []
    for settings in (time_scaled_settings, temperature_settings):
        factor, slow = settings(momentum, delay, reference)
        margins.append(quadratic.max_stable_h(slow, delay, "sc+lwp", 1e-4) / (factor * bound))
    assert 1.0 <= margins[1] < 1.3 and margins[1] == pytest.approx(margins[0], rel=0.05)
