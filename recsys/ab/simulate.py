"""Synthetic A/B experiments with a known effect, vectorised over experiments and days.

Used by the tests and benchmarks/ab_simulation.py to prove the statistics: each user has a
latent propensity (lognormal) that drives both the pre-period and the experiment-period
outcome, so CUPED has something to remove; the treatment multiplies the experiment-period
click rate by (1 + lift). Users arrive uniformly over the days and accumulate outcomes daily.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from recsys.ab import stats
from recsys.ab.assignment import assign_many


@dataclass(frozen=True)
class Simulated:
    """Per-day cumulative per-user values of E experiments: (E, days, users, 4) per arm.

    Columns: clicks, impressions, pre_clicks, pre_impressions; `*_in` (E, days, users) says
    whether the user had arrived by that day (only those are in that day's analysis).
    """

    control: np.ndarray
    treatment: np.ndarray
    control_in: np.ndarray
    treatment_in: np.ndarray
    true_ctr_diff: float
    true_clicks_diff: float


def simulate(
    rng: np.random.Generator,
    *,
    experiments: int,
    users: int,
    days: int = 1,
    lift: float = 0.0,
    base_ctr: float = 0.05,
    share_t: float = 0.5,
    pre_corr_sd: float = 0.8,
) -> Simulated:
    """Simulate `experiments` A/B tests of `users` users; lift = relative CTR effect."""
    n_t = round(users * share_t)
    arms = []
    for n, arm_lift in ((users - n_t, 0.0), (n_t, lift)):
        shape = (experiments, n)
        propensity = rng.lognormal(-0.5 * pre_corr_sd**2, pre_corr_sd, size=shape)
        activity = rng.gamma(2.0, 5.0, size=shape)  # impressions per day of activity
        arrival = rng.integers(0, days, size=shape)
        pre_imp = rng.poisson(activity * days)
        pre_clk = rng.binomial(pre_imp, np.clip(base_ctr * propensity, 0, 1))
        p = np.clip(base_ctr * propensity * (1 + arm_lift), 0, 1)
        day_imp = rng.poisson(activity[:, None, :], size=(experiments, days, n))
        day_imp = np.where(np.arange(days)[None, :, None] >= arrival[:, None, :], day_imp, 0)
        day_clk = rng.binomial(day_imp, p[:, None, :])
        cum = np.stack(
            [
                np.cumsum(day_clk, axis=1),
                np.cumsum(day_imp, axis=1),
                np.broadcast_to(pre_clk[:, None, :], day_imp.shape),
                np.broadcast_to(pre_imp[:, None, :], day_imp.shape),
            ],
            axis=-1,
        ).astype(np.float64)
        # Users who have not arrived by a day are not yet in the experiment on that day.
        arrived = np.arange(days)[None, :, None] >= arrival[:, None, :]
        arms.append((cum, arrived))
    ctr_diff, clicks_diff = _truth(base_ctr, lift, pre_corr_sd, days)
    return Simulated(arms[0][0], arms[1][0], arms[0][1], arms[1][1], ctr_diff, clicks_diff)


def _truth(base_ctr: float, lift: float, sd: float, days: int) -> tuple[float, float]:
    """True effects: CTR ratio-of-means difference and clicks-per-user difference (last day)."""
    # E[clicks] = E[imp] E[p]: propensity has mean 1 and is independent of activity; the
    # clip at 1 is negligible at these rates. Mean active days of a uniform arrival: (days+1)/2.
    mean_imp = 10.0 * (days + 1) / 2
    return base_ctr * lift, mean_imp * base_ctr * lift


def moments_by_day(values: np.ndarray, arrived: np.ndarray, cols: list[int]) -> stats.Moments:
    """Moments over arrived users of the chosen columns: (E, days, users, 4) -> (E, days)."""
    return stats.Moments.of(values[..., cols], arrived)


def event_log(
    rng: np.random.Generator,
    *,
    users: int,
    days: int,
    start: str = "2026-01-01",
    lift: float = 0.0,
    experiment: str = "sim",
    drop_treatment: float = 0.0,
    pre_days: int = 7,
) -> pd.DataFrame:
    """An exposure log (one row per user-day) with a pre-period, assigned by the real hash.

    Columns user_id, variant, timestamp, clicks, impressions, watch_seconds; rows before
    `start` are the pre-period. `drop_treatment` loses that share of B's users (an SRM).
    """
    ids = [f"u{i}" for i in range(users)]
    variant = np.array(assign_many(ids, experiment, {"A": 0.5, "B": 0.5}))
    keep = ~((variant == "B") & (rng.random(users) < drop_treatment))
    propensity = rng.lognormal(-0.32, 0.8, size=users)
    activity = rng.gamma(2.0, 5.0, size=users)
    first = rng.integers(0, days, size=users)
    day0 = pd.Timestamp(start, tz="UTC")
    rows = []
    for day in range(-pre_days, days):
        active = keep & ((day < 0) | (day >= first))
        effect = np.where((day >= 0) & (variant == "B"), 1 + lift, 1.0)
        imp = rng.poisson(activity)
        clk = rng.binomial(imp, np.clip(0.05 * propensity * effect, 0, 1))
        watch = rng.gamma(1.0, 30.0 * propensity * effect)
        stamp = day0 + pd.Timedelta(days=day, hours=12)
        rows.append(pd.DataFrame({
            "user_id": np.array(ids)[active], "variant": variant[active], "timestamp": stamp,
            "clicks": clk[active], "impressions": imp[active], "watch_seconds": watch[active],
        }))  # fmt: skip
    return pd.concat(rows, ignore_index=True)
