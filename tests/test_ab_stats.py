"""A/B statistics: our numbers equal the reference libraries', and simulations prove the claims.

Reference: tea-tasting (delta method, CUPED, power; dev dependency) and scipy (chi-square).
Simulations (recsys.ab.simulate, vectorised numpy) with a known effect: coverage of the 95%
interval, A/A false positives, daily peeking (sequential vs fixed-horizon), CUPED, SRM.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from recsys.ab import simulate as sim
from recsys.ab import stats

tt = pytest.importorskip("tea_tasting", reason="tea-tasting is the dev reference: make install")

CLICKS, IMPRESSIONS, PRE_CLICKS, PRE_IMPRESSIONS = 0, 1, 2, 3


def _one_experiment(seed: int = 0, users: int = 3000, lift: float = 0.05) -> pd.DataFrame:
    s = sim.simulate(np.random.default_rng(seed), experiments=1, users=users, lift=lift)
    frames = []
    for variant, values in (("A", s.control), ("B", s.treatment)):
        frame = pd.DataFrame(
            values[0, -1], columns=["clicks", "impressions", "pre_clicks", "pre_impressions"]
        )
        frames.append(frame.assign(variant=variant))
    return pd.concat(frames, ignore_index=True)


def _ours(frame: pd.DataFrame, spec: stats.MetricColumns) -> stats.Effect:
    cols = ["clicks", "impressions", "pre_clicks", "pre_impressions"]
    a = stats.Moments.of(frame.loc[frame.variant == "A", cols].to_numpy())
    b = stats.Moments.of(frame.loc[frame.variant == "B", cols].to_numpy())
    return stats.effect(stats.arms(a, b, spec))


REFERENCE_CASES = {
    "mean": (stats.MetricColumns(CLICKS), lambda: tt.Mean("clicks")),
    "mean_cuped": (
        stats.MetricColumns(CLICKS, pre_num=PRE_CLICKS),
        lambda: tt.Mean("clicks", "pre_clicks"),
    ),
    "ratio": (
        stats.MetricColumns(CLICKS, IMPRESSIONS),
        lambda: tt.RatioOfMeans("clicks", "impressions"),
    ),
    "ratio_cuped": (
        stats.MetricColumns(CLICKS, IMPRESSIONS, PRE_CLICKS, PRE_IMPRESSIONS),
        lambda: tt.RatioOfMeans("clicks", "impressions", "pre_clicks", "pre_impressions"),
    ),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_estimates_match_tea_tasting(case: str) -> None:
    spec, make_metric = REFERENCE_CASES[case]
    frame = _one_experiment()
    with tt.config_context(use_t=False, equal_var=False):
        ref = tt.Experiment(m=make_metric()).analyze(frame, control="A")["m"]
    ours = _ours(frame, spec)
    pairs = {
        "control": (ours.control, ref.control),
        "treatment": (ours.treatment, ref.treatment),
        "diff": (ours.diff, ref.effect_size),
        "ci_low": (ours.ci_low, ref.effect_size_ci_lower),
        "ci_high": (ours.ci_high, ref.effect_size_ci_upper),
        "p_value": (ours.p_value, ref.pvalue),
        "rel": (ours.rel, ref.rel_effect_size),
        "rel_low": (ours.rel_low, ref.rel_effect_size_ci_lower),
        "rel_high": (ours.rel_high, ref.rel_effect_size_ci_upper),
    }
    for name, (mine, theirs) in pairs.items():
        assert float(mine) == pytest.approx(theirs, rel=1e-9, abs=1e-12), name


def test_cuped_actually_changes_the_estimate() -> None:
    # Guards the reference test: with and without the covariate the numbers must differ.
    frame = _one_experiment()
    plain = _ours(frame, stats.MetricColumns(CLICKS, IMPRESSIONS))
    cuped = _ours(frame, stats.MetricColumns(CLICKS, IMPRESSIONS, PRE_CLICKS, PRE_IMPRESSIONS))
    assert float(cuped.se) < 0.95 * float(plain.se)


def test_mde_and_sample_size_match_tea_tasting() -> None:
    frame = _one_experiment(users=4000, lift=0.0)
    var = float(frame["clicks"].var())
    n = len(frame)
    with tt.config_context(use_t=False, equal_var=False):
        ref = tt.Mean("clicks").solve_power(frame, "effect_size")[0]
        needed = tt.Mean("clicks", effect_size=0.1).solve_power(frame, "n_obs")[0]
    # tea-tasting solves numerically (brentq) and counts the far rejection tail: equal to 1e-5.
    assert float(stats.mde(var, n / 2, n / 2)) == pytest.approx(ref.effect_size, rel=1e-5)
    assert stats.users_needed(var, 0.1) == pytest.approx(needed.n_obs, abs=1)


def test_srm_matches_scipy_and_tea_tasting() -> None:
    counts = np.array([5200, 4800])
    ours = stats.srm_p_value(counts, np.array([0.5, 0.5]))
    assert ours == pytest.approx(sps.chisquare(counts).pvalue, rel=1e-12)
    frame = pd.DataFrame({"variant": ["A"] * 5200 + ["B"] * 4800})
    ref = tt.Experiment(srm=tt.SampleRatio(method="norm", correction=False)).analyze(
        frame, control="A"
    )["srm"]
    assert ours == pytest.approx(ref.pvalue, rel=1e-9)  # two arms: chi-square(1) = z^2


def test_srm_trips_on_52_48_and_not_on_50_50() -> None:
    rng = np.random.default_rng(7)
    users = 20_000
    tripped = [
        stats.srm_p_value(np.bincount(rng.random(users) < share, minlength=2), np.ones(2))
        < stats.SRM_ALPHA
        for share in (0.52, 0.50)
    ]
    assert tripped == [True, False]
    # Over many 50/50 experiments the check fires at its own rate (0.1%), not more.
    draws = rng.binomial(users, 0.5, size=500)
    p = [stats.srm_p_value(np.array([d, users - d]), np.ones(2)) for d in draws]
    assert np.mean(np.array(p) < stats.SRM_ALPHA) <= 0.01


def _effects(s: sim.Simulated, spec: stats.MetricColumns, cols: list[int]) -> stats.Effect:
    control = sim.moments_by_day(s.control, s.control_in, cols)
    treatment = sim.moments_by_day(s.treatment, s.treatment_in, cols)
    return stats.effect(stats.arms(control, treatment, spec))


@pytest.fixture(scope="module")
def one_day_lift() -> sim.Simulated:
    return sim.simulate(np.random.default_rng(11), experiments=400, users=3000, lift=0.05)


@pytest.mark.parametrize("cuped", [False, True])
@pytest.mark.parametrize("metric", ["ctr", "clicks"])
def test_95_intervals_cover_the_truth(
    one_day_lift: sim.Simulated, metric: str, cuped: bool
) -> None:
    if metric == "ctr":
        spec = stats.MetricColumns(0, 1, 2 if cuped else None, 3 if cuped else None)
        cols, truth = [CLICKS, IMPRESSIONS, PRE_CLICKS, PRE_IMPRESSIONS], one_day_lift.true_ctr_diff
    else:
        spec = stats.MetricColumns(0, None, 1 if cuped else None)
        cols, truth = [CLICKS, PRE_CLICKS], one_day_lift.true_clicks_diff
    e = _effects(one_day_lift, spec, cols)
    covered = np.mean((e.ci_low <= truth) & (truth <= e.ci_high))
    assert 0.93 <= covered <= 0.97
    # The always-valid interval is wider: it covers at least as often.
    assert np.mean((e.seq_low <= truth) & (truth <= e.seq_high)) >= covered


def test_cuped_narrows_intervals(one_day_lift: sim.Simulated) -> None:
    cols = [CLICKS, IMPRESSIONS, PRE_CLICKS, PRE_IMPRESSIONS]
    plain = _effects(one_day_lift, stats.MetricColumns(0, 1), cols)
    cuped = _effects(one_day_lift, stats.MetricColumns(0, 1, 2, 3), cols)
    ratio = np.median((cuped.ci_high - cuped.ci_low) / (plain.ci_high - plain.ci_low))
    assert ratio < 0.95


def test_a_a_rejects_about_five_percent() -> None:
    s = sim.simulate(np.random.default_rng(3), experiments=1000, users=2000)
    e = _effects(s, stats.MetricColumns(0, 1), [CLICKS, IMPRESSIONS])
    assert 0.03 <= np.mean(e.p_value < 0.05) <= 0.07


def test_daily_peeking_sequential_keeps_fpr_fixed_horizon_does_not() -> None:
    s = sim.simulate(np.random.default_rng(5), experiments=400, users=1000, days=14)
    e = _effects(s, stats.MetricColumns(0, 1), [CLICKS, IMPRESSIONS])
    fixed_any_day = np.mean(np.any(e.p_value < 0.05, axis=1))
    sequential_any_day = np.mean(np.any((e.seq_low > 0) | (e.seq_high < 0), axis=1))
    always_valid = np.mean(stats.always_valid_p(e.seq_p_value)[:, -1] < 0.05)
    assert fixed_any_day > 0.10  # peeking 14 times at a fixed-horizon test: about 20%
    assert sequential_any_day <= 0.05
    assert always_valid == sequential_any_day  # the p-value and the interval agree


def test_sequential_still_finds_a_large_effect() -> None:
    s = sim.simulate(np.random.default_rng(9), experiments=100, users=2000, days=14, lift=0.4)
    e = _effects(s, stats.MetricColumns(0, 1), [CLICKS, IMPRESSIONS])
    assert np.mean(np.any(e.seq_low > 0, axis=1)) > 0.8
    assert not np.any(e.seq_high < 0)  # never the wrong sign


def test_sequential_interval_is_the_inverted_msprt() -> None:
    diff, variance, tau2, alpha = np.array(0.4), np.array(0.01), np.array(0.02), 0.05
    half, p = stats.sequential(diff, variance, tau2, alpha)
    # At the boundary the mixture likelihood ratio equals 1/alpha.
    _, p_edge = stats.sequential(half, variance, tau2, alpha)
    assert float(p_edge) == pytest.approx(alpha, rel=1e-9)
    assert float(half) < 0.4
    assert float(p) < alpha  # 0.4 is outside the half-width (0.326), so rejected


def test_planned_sample_size_gives_the_planned_power() -> None:
    rng = np.random.default_rng(21)
    pilot = sim.simulate(rng, experiments=1, users=20_000)
    moments = stats.Moments.of(pilot.control[0, -1][:, [CLICKS, IMPRESSIONS]])
    ctr, var = stats.value_and_variance(moments, 0, 1)
    needed = stats.users_needed(float(var), 0.1 * float(ctr))
    s = sim.simulate(rng, experiments=300, users=needed, lift=0.1)
    e = _effects(s, stats.MetricColumns(0, 1), [CLICKS, IMPRESSIONS])
    assert 0.72 <= np.mean(e.p_value < 0.05) <= 0.88  # planned: 80%
