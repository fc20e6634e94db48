"""Pictures of timelines (`pipetrain.schedule.plot`): on a time axis shared with a longer timeline,
the microbatch numbers stay inside their bars and never overlap (the demo's simulated panel used to
read "22 22 22"); the measured-beside-simulated picture gives the ratio of their times per update and says what the
simulation models."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipetrain.schedule import Costs, build, simulate  # noqa: E402
from pipetrain.schedule.plot import draw_timeline  # noqa: E402
from pipetrain.training.timelines import (plot_measured_and_simulated, seconds_per_update,  # noqa: E402
                                         simulated_counterpart, update_ends)


def _waiting():
    """A run whose actions wait on slow messages, and its compute-only counterpart: 3x shorter, its
    bars as wide as the measured ones and two-digit numbers wider than them."""
    measured = simulate(build("pipedream", 2, 14), Costs(F=2, B=2, step=0.5, latency=10))
    return measured, simulated_counterpart(measured)


def test_numbers_stay_inside_their_bars_and_apart_on_a_shared_axis():
    measured, simulated = _waiting()
    horizon = measured.makespan
    assert horizon > 3 * simulated.makespan
    fig, axes = plt.subplots(2, 1, figsize=(12, 3), sharex=True)
    for ax, timeline in zip(axes, (measured, simulated)):
        draw_timeline(ax, timeline, horizon=horizon)
    axes[-1].set_xlim(0, horizon)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    written = 0
    for ax, timeline in zip(axes, (measured, simulated)):
        boxes = [(round(t.get_position()[1]), t.get_window_extent(renderer)) for t in ax.texts]
        written += len(boxes)
        for (row_a, a), (row_b, b) in itertools.combinations(boxes, 2):
            assert row_a != row_b or a.x1 <= b.x0 or b.x1 <= a.x0, "two numbers overlap"
        to_data = ax.transData.inverted()
        for text, (_, box) in zip(ax.texts, boxes):
            left, right = (to_data.transform((x, 0))[0] for x in (box.x0, box.x1))
            middle, rank = text.get_position()
            bar = next((s, e) for _, s, e in timeline.spans(round(rank)) if abs((s + e) / 2 - middle) < 1e-9)
            assert bar[0] <= left and right <= bar[1], "a number wider than its bar"
    plt.close(fig)
    assert written >= 40  # microbatches 0-9, in both panels, on both ranks


def test_the_measured_picture_says_why_it_is_longer(tmp_path, monkeypatch):
    import pipetrain.training.timelines as plot  # the module that draws: it holds plot_comparison

    captions = []
    drawn = plot.plot_comparison
    monkeypatch.setattr(plot, "plot_comparison", lambda *a, **k: (captions.append(k["caption"]), drawn(*a, **k)))
    measured, simulated = _waiting()
    plot_measured_and_simulated(measured, str(tmp_path / "t.png"), "pipedream (distributed)")
    ratio = seconds_per_update(update_ends(measured)) / seconds_per_update(update_ends(simulated))
    assert ratio >= 1
    assert captions[0].startswith(f"The measured run takes {ratio:.2f}x the simulated time per update (steady "
                                  "state). The simulation charges each action only its measured median compute time")
    assert "pipetrain calibrate" in captions[0]
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_a_calibrated_picture_says_what_is_and_is_not_modelled(tmp_path, monkeypatch):
    import pipetrain.training.timelines as plot  # the module that draws: it holds plot_comparison

    captions = []
    drawn = plot.plot_comparison
    monkeypatch.setattr(plot, "plot_comparison", lambda *a, **k: (captions.append((a, k["caption"])), drawn(*a, **k)))
    measured, _ = _waiting()
    costs = Costs(F=2, B=2, step=0.5, latency=10)  # the model that made it: the ratio is 1
    plot_measured_and_simulated(measured, str(tmp_path / "t.png"), "pipedream (distributed)", costs=costs)
    (args, caption), = captions
    assert caption.startswith("The measured run takes 1.00x the simulated time per update")
    assert "Not modelled: transfers overlapping compute" in caption
    assert "and the calibration" in args[1][1]
