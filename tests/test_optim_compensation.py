import math

import pytest
import torch

from optim_helpers import compare_with_torch
from pipetrain.errors import ConfigError
from pipetrain.optim import (SGD, CosineLR, build_stage_optimizer, build_stage_optimizers, delay_lr_factor,
                             parse_compensation, parse_dlr_delay, parse_dts_delay, spike_coefficients,
                             time_scaled_settings)
from pipetrain.optim.compensation import (DEFAULT_DLR_DELAY, DEFAULT_DTS_DELAY, parse_dtsf_delay,
                                          parse_dtt_delay, rate_following_settings, temperature_settings)
from pipetrain.optim.sgd import RateFollowingSGD


def _impulse_response(optimizer, steps, impulse_step=0):
    """Cumulative displacement -w after each update for a unit gradient at ``impulse_step``."""
    w = {"w": torch.zeros(1, dtype=torch.float64)}
    out = []
    for step in range(steps):
        g = torch.full((1,), 1.0 if step == impulse_step else 0.0, dtype=torch.float64)
        w = optimizer.step(w, {"w": g}, step)
        out.append(-w["w"].item())
    return out


def test_spike_coefficients():
    assert spike_coefficients(0.9, 0) == (1.0, 0.0)
    assert spike_coefficients(0.9, 1) == (0.9, 1.0)
    a, b = spike_coefficients(0.9, 4)
    assert a == pytest.approx(0.6561, abs=1e-15) and b == pytest.approx(3.439, abs=1e-13)
    a, b = spike_coefficients(0.5, 2.5)
    assert a == 0.5**2.5 and b == pytest.approx((1 - 0.5**2.5) / 0.5)
    assert spike_coefficients(1.0, 3) == (1.0, 3.0)
    with pytest.raises(ConfigError, match="delay"):
        spike_coefficients(0.9, -1)


@pytest.mark.parametrize("settings", [
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, dampening=0.2),
])
def test_sc_delay_zero_is_torch_momentum_bitwise(settings):
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, **settings),
                       SGD(**settings, sc_delay=0))


@pytest.mark.parametrize("settings", [dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.99,
                                       weight_decay=1e-2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sc_delay_one_is_torch_nesterov_bitwise(settings, dtype):
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, nesterov=True, **settings),
                       SGD(**settings, sc_delay=1), dtype=dtype)


def test_unit_impulse_response_is_the_undelayed_one_shifted_by_d():
    response = _impulse_response(SGD(lr=1.0, momentum=0.9, sc_delay=4), 400)
    assert [round(r, 4) for r in response[:4]] == [4.0951, 4.6856, 5.2170, 5.6953]
    assert response[-1] == pytest.approx(10.0, abs=1e-12)
    plain = _impulse_response(SGD(lr=1.0, momentum=0.9), 60)
    assert response[:56] == pytest.approx(plain[4:], rel=1e-13)


def test_fractional_delay_interpolates():
    response = _impulse_response(SGD(lr=1.0, momentum=0.9, sc_delay=2.5), 3)
    assert response[0] == pytest.approx((1 - 0.9**3.5) / 0.1, rel=1e-14)
    assert response[1] == pytest.approx((1 - 0.9**4.5) / 0.1, rel=1e-14)


def test_sc_with_dampening_spikes_the_damped_response():
    # the impulse comes at update 1: torch's first update sets the buffer to g without dampening
    damped = _impulse_response(SGD(lr=1.0, momentum=0.9, dampening=0.5, sc_delay=3), 300, 1)
    plain = _impulse_response(SGD(lr=1.0, momentum=0.9, dampening=0.5), 300, 1)
    assert damped[0] == 0.0
    assert damped[1:50] == pytest.approx(plain[4:53], rel=1e-13)
    assert damped[-1] == pytest.approx(0.5 / 0.1, rel=1e-12)


def test_sc_without_momentum_is_plain_sgd_and_refuses_nesterov():
    assert _impulse_response(SGD(lr=1.0, sc_delay=5), 3) == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="replaces Nesterov"):
        SGD(lr=0.1, momentum=0.9, nesterov=True, sc_delay=2)


def test_prediction_formula_uses_the_lr_at_forward_time():
    schedule = CosineLR(total=100)
    optimizer = SGD(lr=0.2, momentum=0.9, lwp_horizon=6, lr_schedule=schedule)
    w = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)}
    for step, g in enumerate(([1.0, -1.0], [0.5, 0.25])):
        w = optimizer.step(w, {"w": torch.tensor(g, dtype=torch.float64)}, step)
    v = optimizer.velocity("w")
    assert v.tolist() == pytest.approx([0.9 * 1.0 + 0.5, 0.9 * -1.0 + 0.25])
    predicted = optimizer.predict(w, samples_seen=50)
    lr = 0.2 * 0.5 * (1 + math.cos(math.pi * 0.5))
    torch.testing.assert_close(predicted["w"], w["w"] - lr * 6 * v, rtol=0, atol=1e-14)
    assert predicted["w"].requires_grad and predicted["w"].is_leaf
    assert torch.equal(w["w"], optimizer.predict(w, 50, horizon=0)["w"])
    other = optimizer.predict(w, samples_seen=0, horizon=2)
    torch.testing.assert_close(other["w"], w["w"] - 0.2 * 2 * v, rtol=0, atol=1e-14)


def test_zero_horizon_returns_the_same_tensors():
    optimizer = SGD(lr=0.1, momentum=0.9)
    w = {"a": torch.ones(2), "b": torch.zeros(3)}
    optimizer.step(w, {"a": torch.ones(2), "b": None}, 0)
    predicted = optimizer.predict(w, 10)
    assert all(predicted[n] is w[n] for n in w)


def test_prediction_before_the_first_update_is_the_identity():
    w = {"a": torch.ones(2)}
    assert SGD(lr=0.1, momentum=0.9, lwp_horizon=3).predict(w, 0)["a"] is w["a"]


def test_prediction_without_momentum():
    optimizer = SGD(lr=0.1, lwp_horizon=2)
    w = optimizer.step({"a": torch.zeros(1, dtype=torch.float64)},
                       {"a": torch.ones(1, dtype=torch.float64)}, 0)
    assert optimizer.predict(w, 1)["a"].item() == pytest.approx(-0.1 - 0.2)
    with pytest.raises(ConfigError, match="keeps no velocity"):
        SGD(lr=0.1).predict(w, 1, horizon=2)


def test_parse_compensation():
    assert parse_compensation("none") == frozenset()
    assert parse_compensation(None) == frozenset()
    assert parse_compensation("sc+lwp") == {"sc", "lwp"}
    assert parse_compensation("LWP") == {"lwp"}
    assert parse_compensation({"sc"}) == {"sc"}
    assert parse_compensation("sc+lwp+dlr16") == {"sc", "lwp", "dlr"}
    assert parse_compensation("DLR") == {"dlr"}
    with pytest.raises(ConfigError, match="valid: none, sc, lwp, dlr or dlrN"):
        parse_compensation("sc+nag")
    with pytest.raises(ConfigError, match="names dlr twice"):
        parse_compensation("dlr+dlr8")
    assert parse_compensation("sc+lwp+dts8") == {"sc", "lwp", "dts"}
    with pytest.raises(ConfigError, match="names both dlr and dts"):
        parse_compensation("sc+dlr8+dts8")


# -- delay-scaled learning rate (DLR) --------------------------------------------------------------


def test_dlr_factor_and_reference_delay():
    assert delay_lr_factor(0, 16) == 1.0 and delay_lr_factor(16, 16) == 1.0
    assert delay_lr_factor(32, 16) == 0.25 and delay_lr_factor(126, 16) == (16 / 126) ** 2
    assert delay_lr_factor(40) == delay_lr_factor(40, DEFAULT_DLR_DELAY)
    assert parse_dlr_delay("sc+lwp") is None
    assert parse_dlr_delay("sc+dlr") == DEFAULT_DLR_DELAY
    assert parse_dlr_delay("lwp+dlr4.5") == 4.5
    with pytest.raises(ConfigError, match="D\\*=0 must be > 0"):
        delay_lr_factor(3, 0)
    with pytest.raises(ConfigError, match="must be > 0"):
        parse_dlr_delay("dlr0")


@pytest.mark.parametrize("delay", [0, 3, 8])
@pytest.mark.parametrize("compensation", ["dlr", "sc+dlr16", "dts8", "sc+dts16"])
def test_delay_scaling_at_or_below_the_reference_delay_is_torch_momentum_bitwise(delay, compensation):
    # delay 0 (and any delay up to D*): DLR and DTS leave the rate (and DTS the momentum) untouched,
    # so they are plain momentum SGD (with SC at delay 0, too); D = 3 with SC is SC's own business:
    # compared with SC alone
    settings = dict(lr=0.05, momentum=0.9, weight_decay=1e-2)
    ours = build_stage_optimizer("sgd:lr=0.05,momentum=0.9,weight_decay=0.01", stage_delay=delay,
                                 compensation=compensation)
    assert (ours.lr, ours.momentum) == (0.05, 0.9)
    if "sc" in compensation and delay:
        want = build_stage_optimizer("sgd:lr=0.05,momentum=0.9,weight_decay=0.01", stage_delay=delay,
                                     compensation="sc")
        assert ours.hyperparameters() == want.hyperparameters()
    else:
        compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, **settings), ours)


def test_dlr_beyond_the_reference_delay_is_momentum_sgd_at_the_scaled_rate_bitwise():
    ours = build_stage_optimizer("sgd:lr=0.05,momentum=0.9", stage_delay=48, compensation="dlr24")
    assert ours.lr == 0.05 * 0.25
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, lr=0.05 * 0.25, momentum=0.9), ours)


def test_dlr_impulse_response_is_the_compensated_one_scaled_by_the_factor():
    # lr = 1, m = 0.9, D = 8, D* = 4: factor 1/4. With SC the response is the undelayed one shifted
    # by D, times 1/4: it tends to 10/4 instead of 10
    response = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=8,
                                                       compensation="sc+dlr4"), 400)
    sc = _impulse_response(SGD(lr=1.0, momentum=0.9, sc_delay=8), 400)
    plain = _impulse_response(SGD(lr=1.0, momentum=0.9), 60)
    assert response[0] == pytest.approx((1 - 0.9**9) / 0.1 / 4, rel=1e-14)
    assert response == pytest.approx([r / 4 for r in sc], rel=1e-14)
    assert response[:52] == pytest.approx([r / 4 for r in plain[8:]], rel=1e-13)
    assert response[-1] == pytest.approx(2.5, abs=1e-12)
    # DLR alone: the plain momentum response, scaled
    alone = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=8,
                                                    compensation="dlr4"), 60)
    assert alone == pytest.approx([r / 4 for r in plain], rel=1e-14)


def test_dlr_prediction_uses_the_stage_rate():
    # LWP extrapolates along the step the stage really takes: lr * factor * T * v
    optimizer = build_stage_optimizer("sgd:lr=0.2,momentum=0.9", stage_delay=12, compensation="lwp+dlr6")
    w = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    w = optimizer.step(w, {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}, 0)
    v = optimizer.velocity("w")
    predicted = optimizer.predict(w, samples_seen=1)
    torch.testing.assert_close(predicted["w"], w["w"] - 0.2 * 0.25 * 12 * v, rtol=0, atol=1e-15)


# -- delay time scaling (DTS) ----------------------------------------------------------------------


def test_dts_settings_and_reference_delay():
    assert time_scaled_settings(0.9, 0, 8) == (1.0, 0.9) and time_scaled_settings(0.9, 8, 8) == (1.0, 0.9)
    assert time_scaled_settings(0.9, 16, 8) == (0.25, 1.0 - (1.0 - 0.9) / 2)
    factor, momentum = time_scaled_settings(0.996713, 126, 8)
    assert factor == delay_lr_factor(126, 8) and momentum == 1.0 - (1.0 - 0.996713) / (126 / 8)
    assert time_scaled_settings(0.5, 40) == time_scaled_settings(0.5, 40, DEFAULT_DTS_DELAY)
    assert parse_dts_delay("sc+lwp+dlr4") is None
    assert parse_dts_delay("sc+dts") == DEFAULT_DTS_DELAY and parse_dts_delay("lwp+dts4.5") == 4.5
    with pytest.raises(ConfigError, match="D\\*=0 must be > 0"):
        time_scaled_settings(0.9, 3, 0)
    with pytest.raises(ConfigError, match="needs 0 < momentum < 1, got 0.0; use dlr"):
        time_scaled_settings(0.0, 3, 8)
    with pytest.raises(ConfigError, match="must be > 0"):
        parse_dts_delay("dts0")


def test_dts_build_errors():
    with pytest.raises(ConfigError, match="scales the momentum of momentum SGD, not of 'adam'"):
        build_stage_optimizer("adam:lr=0.01", stage_delay=8, compensation="lwp+dts4")
    with pytest.raises(ConfigError, match="needs 0 < momentum < 1"):
        build_stage_optimizer("sgd:lr=0.1", stage_delay=8, compensation="dts4")
    with pytest.raises(ConfigError, match="dts_delay=4 is set but compensation 'dts' is off"):
        build_stage_optimizer("sgd:momentum=0.9", stage_delay=8, compensation="sc+dlr", dts_delay=4)


def test_dts_beyond_the_reference_delay_is_momentum_sgd_at_the_scaled_rate_and_momentum_bitwise():
    # D = 48, D* = 24: k = 2, so a quarter of the rate and 1 - m halved (memory 10 -> 20 updates)
    ours = build_stage_optimizer("sgd:lr=0.05,momentum=0.9,weight_decay=0.01", stage_delay=48, compensation="dts24")
    assert ours.lr == 0.05 * 0.25 and ours.momentum == 1.0 - (1.0 - 0.9) / 2
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, lr=0.05 * 0.25, momentum=1.0 - (1.0 - 0.9) / 2,
                                                 weight_decay=1e-2), ours)
    # per stage, and dts_delay overrides the name's D*
    optimizers = build_stage_optimizers("sgd:lr=0.1,momentum=0.9", [8, 6, 4, 0], compensation="sc+lwp+dts4")
    assert [o.lr for o in optimizers] == [0.1 * 0.25, 0.1 * (4 / 6) ** 2, 0.1, 0.1]
    assert [o.momentum for o in optimizers] == [1 - (1 - 0.9) / 2, 1 - (1 - 0.9) / (6 / 4), 0.9, 0.9]
    assert [o.sc_delay for o in optimizers] == [8, 6, 4, 0]
    assert build_stage_optimizers("sgd:lr=0.1,momentum=0.9", [8], compensation="dts4", dts_delay=2)[0].lr == 0.1 / 16


def test_dts_impulse_response_is_the_reference_response_slowed_k_times():
    # lr = 1, m = 0.9, D = 16, D* = 4: k = 4, lr_s = 1/16, m_s = 0.975. Plain momentum at (lr_s, m_s)
    # moves a unit impulse by lr_s*(1 - m_s**(n+1))/(1 - m_s) -> lr/(k*(1-m)) = 2.5: a k-th of the
    # undelayed 10 (DLR at the same D*: a k**2-th, 0.625). With SC: that response shifted by D.
    lr_s, m_s = 1.0 / 16, 1.0 - (1.0 - 0.9) / 4
    alone = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=16,
                                                    compensation="dts4"), 2000)
    exact = [lr_s * (1 - m_s ** (n + 1)) / (1 - m_s) for n in range(2000)]
    assert alone == pytest.approx(exact, rel=1e-12)
    assert alone[-1] == pytest.approx(2.5, abs=1e-12)
    spiked = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=16,
                                                     compensation="sc+dts4"), 400)
    assert spiked[0] == pytest.approx(exact[16], rel=1e-13)
    assert spiked[:380] == pytest.approx(exact[16:396], rel=1e-12)
    # the time scaling: the k-times slower response's n-th value after k*n updates, per unit of the
    # rate (1/k of it): the reference's momentum response sum_{j<=n} m**j, to first order in 1 - m
    reference = _impulse_response(SGD(lr=1.0, momentum=0.9), 60)
    for n in (10, 20, 40):
        assert k_slowed(alone, n, 4) == pytest.approx(reference[n], rel=0.03)


def k_slowed(response, n, k):
    """The value of a k-times slower response at the time of the reference's update n, rescaled to
    the reference's rate (the slow stage covers lr/k per update where the reference covers lr)."""
    return k * response[k * n + k - 1]


def test_dts_prediction_uses_the_stage_rate_and_momentum():
    # LWP extrapolates along the step the stage really takes: lr/k**2 * T * v, v the k-times
    # longer momentum buffer
    optimizer = build_stage_optimizer("sgd:lr=0.2,momentum=0.9", stage_delay=12, compensation="lwp+dts6")
    w = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    for step, g in enumerate(([1.0, -1.0], [0.5, 0.25])):
        w = optimizer.step(w, {"w": torch.tensor(g, dtype=torch.float64)}, step)
    v = optimizer.velocity("w")
    torch.testing.assert_close(v, (1 - (1 - 0.9) / 2) * torch.tensor([1.0, -1.0], dtype=torch.float64)
                               + torch.tensor([0.5, 0.25], dtype=torch.float64), rtol=0, atol=1e-15)
    predicted = optimizer.predict(w, samples_seen=2)
    torch.testing.assert_close(predicted["w"], w["w"] - 0.2 * 0.25 * 12 * v, rtol=0, atol=1e-15)


# -- rate-following delay time scaling (dtsf) ------------------------------------------------------


def test_rate_following_settings():
    m = 0.996713
    # at the full rate: DTS's settings exactly; D <= D*: untouched at every rate
    assert rate_following_settings(m, 126, 1.0, 4) == time_scaled_settings(m, 126, 4)
    assert rate_following_settings(m, 4, 0.3, 4) == (1.0, m) and rate_following_settings(m, 0, 0.0, 4) == (1.0, m)
    # k = (D/D*)*sqrt(f): D = 16, D* = 4, f = 1/4 -> k = 2, a quarter of the scheduled rate
    assert rate_following_settings(0.9, 16, 0.25, 4) == (0.25, 1.0 - (1.0 - 0.9) / 2)
    # so the stage's own rate f*lr/k**2 stays DTS's while the schedule decays, until k reaches 1
    for f in (0.9, 0.5, 0.1, 1 / 16 + 1e-9):
        factor, _ = rate_following_settings(0.9, 16, f, 4)
        assert f * factor == pytest.approx(1 / 16, rel=1e-12)
    assert rate_following_settings(0.9, 16, 1 / 16, 4) == (1.0, 0.9)
    assert rate_following_settings(0.9, 16, 0.01, 4) == (1.0, 0.9)
    assert parse_dtsf_delay("sc+lwp+dts4") is None and parse_dts_delay("sc+lwp+dtsf4") is None
    assert parse_dtsf_delay("sc+dtsf") == DEFAULT_DTS_DELAY and parse_dtsf_delay("lwp+dtsf2.5") == 2.5
    assert parse_compensation("sc+lwp+dtsf8") == {"sc", "lwp", "dtsf"}
    with pytest.raises(ConfigError, match="names both dts and dtsf"):
        parse_compensation("dts4+dtsf4")
    with pytest.raises(ConfigError, match="factor -0.5 must be >= 0"):
        rate_following_settings(0.9, 16, -0.5, 4)
    with pytest.raises(ConfigError, match="needs 0 < momentum < 1"):
        build_stage_optimizer("sgd:lr=0.1", stage_delay=8, compensation="dtsf4")
    with pytest.raises(ConfigError, match="dtsf_delay=4 is set but compensation 'dtsf' is off"):
        build_stage_optimizer("sgd:momentum=0.9", stage_delay=8, compensation="sc", dtsf_delay=4)
    with pytest.raises(ConfigError, match="momentum of momentum SGD, not of 'adam'"):
        build_stage_optimizer("adam:lr=0.01", stage_delay=8, compensation="lwp+dtsf4")


@pytest.mark.parametrize("delay", [0, 4])
def test_dtsf_at_or_below_the_reference_delay_is_torch_momentum_bitwise(delay):
    # such a stage is plain SGD whatever the schedule does
    ours = build_stage_optimizer("sgd:lr=0.05,momentum=0.9,weight_decay=0.01", stage_delay=delay, compensation="dtsf4")
    assert type(ours) is SGD
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, lr=0.05, momentum=0.9, weight_decay=1e-2), ours)


def test_dtsf_at_the_full_rate_is_dts_bitwise():
    # a constant schedule never decays: dtsf is DTS, bit for bit (torch at DTS's rate and momentum)
    ours = build_stage_optimizer("sgd:lr=0.05,momentum=0.9,weight_decay=0.01", stage_delay=48, compensation="dtsf24")
    assert type(ours) is RateFollowingSGD
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, lr=0.05 * 0.25, momentum=1.0 - (1.0 - 0.9) / 2,
                                                 weight_decay=1e-2), ours)


def test_dtsf_impulse_response_follows_the_rate():
    # lr = 1, m = 0.9, D = 16, D* = 4 (k = 4 at the full rate). A step schedule quarters the rate
    # after update N: k = 4*sqrt(1/4) = 2, so the stage's rate stays 1/4 * 1/4 = 1/16 and its
    # momentum memory halves (m_s: 0.975 -> 0.95). A unit gradient at update 0 then moves the weight
    # by sum_{n<N} lr_s*0.975**n + sum_{n>=N} lr_s*0.975**(N-1)*0.95**(n-N+1): the closed form
    # lr_s*(1 - 0.975**N)/(1 - 0.975) + lr_s*0.975**(N-1)*0.95/(1 - 0.95) in the limit.
    N = 30
    optimizer = build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=16, compensation="dtsf4",
                                      lr_schedule=f"step:milestones={N},gamma=0.25")
    response = _impulse_response(optimizer, 1500)
    lr_s = 1.0 / 16
    exact = [lr_s * (1 - 0.975 ** (n + 1)) / (1 - 0.975) if n < N else
             lr_s * (1 - 0.975 ** N) / (1 - 0.975) + lr_s * 0.975 ** (N - 1) * 0.95 * (1 - 0.95 ** (n - N + 1)) / (1 - 0.95)
             for n in range(1500)]
    assert response == pytest.approx(exact, rel=1e-12)
    assert optimizer.momentum == 0.95 and optimizer.lr_at(N) == pytest.approx(1 / 16, rel=1e-15)
    # against DTS, which keeps k = 4: the same up to N, then a longer memory at a quarter of the rate
    dts = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=16, compensation="dts4",
                                                  lr_schedule=f"step:milestones={N},gamma=0.25"), 1500)
    assert dts[:N] == response[:N] and dts[-1] < response[-1]


def test_dtsf_spike_and_prediction_use_the_settings_in_force():
    # SC's coefficients come from the momentum in force, LWP extrapolates along the stage's rate
    optimizer = build_stage_optimizer("sgd:lr=0.2,momentum=0.9", stage_delay=12, compensation="sc+lwp+dtsf6",
                                      lr_schedule="step:milestones=1,gamma=0.25")
    assert optimizer.lr_at(0) == pytest.approx(0.2 / 4) and optimizer.lr_at(1) == pytest.approx(0.2 * 0.25)
    w = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    g0, g1 = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([0.5, 0.25], dtype=torch.float64)
    w1 = optimizer.step(w, {"w": g0}, 0)  # k = 2: m_s = 0.95
    a, b = spike_coefficients(0.95, 12)
    torch.testing.assert_close(w1["w"], w["w"] - 0.05 * (a * g0 + b * g0), rtol=0, atol=1e-15)
    w2 = optimizer.step(w1, {"w": g1}, 1)  # f = 1/4: k = 1, plain SGD with SC
    v = 0.9 * g0 + g1
    a, b = spike_coefficients(0.9, 12)
    torch.testing.assert_close(w2["w"], w1["w"] - 0.05 * (a * v + b * g1), rtol=0, atol=1e-15)
    predicted = optimizer.predict(w2, samples_seen=2)
    torch.testing.assert_close(predicted["w"], w2["w"] - 0.05 * 12 * v, rtol=0, atol=1e-15)


# -- delay time scaling at SGD's temperature (dtt) -------------------------------------------------


def test_dtt_settings_keep_sgds_effective_rate():
    m = 0.996713
    assert temperature_settings(m, 4, 4) == (1.0, m) and temperature_settings(m, 0, 4) == (1.0, m)
    assert temperature_settings(0.9, 16, 4) == (1.0 / 16, 1.0 - (1.0 - 0.9) / 16)
    factor, slow = temperature_settings(m, 126, 4)
    assert factor == delay_lr_factor(126, 4) == time_scaled_settings(m, 126, 4)[0]
    # the effective rate lr_s/(1 - m_s) is SGD's lr/(1 - m); DTS's is k times lower
    assert factor / (1 - slow) == pytest.approx(1 / (1 - m), rel=1e-9)
    dts_factor, dts_slow = time_scaled_settings(m, 126, 4)
    assert dts_factor / (1 - dts_slow) == pytest.approx(1 / (1 - m) / (126 / 4), rel=1e-9)
    assert parse_dtt_delay("sc+dtt") == DEFAULT_DTS_DELAY and parse_dtt_delay("dtt2.5") == 2.5
    assert parse_dtt_delay("sc+dts4") is None and parse_compensation("sc+lwp+dtt8") == {"sc", "lwp", "dtt"}
    with pytest.raises(ConfigError, match="names both dts and dtt"):
        parse_compensation("dts4+dtt4")
    with pytest.raises(ConfigError, match="needs 0 < momentum < 1"):
        build_stage_optimizer("sgd:lr=0.1", stage_delay=8, compensation="dtt4")
    with pytest.raises(ConfigError, match="delay time scaling \\(dtt\\) scales the momentum of momentum SGD, not of 'adam'"):
        build_stage_optimizer("adam:lr=0.01", stage_delay=8, compensation="lwp+dtt4")
    with pytest.raises(ConfigError, match="dtt_delay=4 is set but compensation 'dtt' is off"):
        build_stage_optimizer("sgd:momentum=0.9", stage_delay=8, compensation="sc+dts", dtt_delay=4)


def test_dtt_is_torch_momentum_at_the_scaled_rate_and_momentum_bitwise():
    # D = 48, D* = 24: k = 2, a quarter of the rate and 1 - m quartered (memory 10 -> 40 updates)
    ours = build_stage_optimizer("sgd:lr=0.05,momentum=0.9,weight_decay=0.01", stage_delay=48, compensation="dtt24")
    assert ours.lr == 0.05 * 0.25 and ours.momentum == 1.0 - (1.0 - 0.9) / 4
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, lr=0.05 * 0.25, momentum=1.0 - (1.0 - 0.9) / 4,
                                                 weight_decay=1e-2), ours)
    below = build_stage_optimizer("sgd:lr=0.05,momentum=0.9", stage_delay=24, compensation="dtt24")
    compare_with_torch(lambda p: torch.optim.SGD(p, foreach=False, lr=0.05, momentum=0.9), below)
    optimizers = build_stage_optimizers("sgd:lr=0.1,momentum=0.9", [8, 6, 4, 0], compensation="sc+lwp+dtt4")
    assert [o.lr for o in optimizers] == [0.1 * 0.25, 0.1 * (4 / 6) ** 2, 0.1, 0.1]
    assert [o.momentum for o in optimizers] == [1 - (1 - 0.9) / 4, 1 - (1 - 0.9) / (6 / 4) ** 2, 0.9, 0.9]


def test_dtt_impulse_response_reaches_sgds_displacement_k_squared_times_slower():
    # lr = 1, m = 0.9, D = 16, D* = 4: k = 4, lr_s = 1/16, 1 - m_s = 0.1/16. A unit impulse moves
    # the weight by lr_s*(1 - m_s**(n+1))/(1 - m_s) -> lr/(1 - m) = 10: undelayed SGD's total (DTS:
    # 10/k = 2.5), reached over a memory k**2 times longer. With SC: that response shifted by D.
    lr_s, m_s = 1.0 / 16, 1.0 - 0.1 / 16
    alone = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=16,
                                                    compensation="dtt4"), 6000)
    exact = [lr_s * (1 - m_s ** (n + 1)) / (1 - m_s) for n in range(6000)]
    assert alone == pytest.approx(exact, rel=1e-12)
    assert alone[-1] == pytest.approx(10.0, rel=1e-12)
    spiked = _impulse_response(build_stage_optimizer("sgd:lr=1.0,momentum=0.9", stage_delay=16,
                                                     compensation="sc+dtt4"), 400)
    assert spiked[:380] == pytest.approx(exact[16:396], rel=1e-12)
