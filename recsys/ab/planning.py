"""Planning an A/B test from a log of normal traffic: per-user variance, users needed, MDE.

The variance of each metric per user (delta method for ctr) comes from a log without variants
(e.g. last month's exposures); the sample size is that of a two-sided z-test at `alpha` with
`power` (stats.users_needed), the MDE that of the users the log holds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recsys.ab import stats
from recsys.ab.analysis import metric_columns
from recsys.ab.definition import ALPHA, POWER
from recsys.ab.events import outcome_columns, read_log, reject_rows, user_ids
from recsys.core.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """One metric's planning numbers."""

    metric: str
    mean: float
    sd: float
    users_in_log: int
    users_needed: int
    mde_rel_with_log_users: float


def plan(
    events: Path, *, rel_effect: float, share_t: float = 0.5, alpha: float = 0.05,
    power: float = 0.8,
) -> list[Plan]:  # fmt: skip
    """Users needed to detect a relative `rel_effect` on each metric, and the MDE of the log."""
    check_plan_arguments(rel_effect, share_t, alpha, power)
    frame = read_log(events)
    outcomes = outcome_columns(frame, events)
    # Impossible rows (negative counts, clicks > impressions) as the analysis treats them.
    frame, _, note = reject_rows(frame, outcomes, events, allow_negative=[], max_fraction=0.01)
    if note:
        log.warning("%s", note)
    per_user = frame.assign(user_id=user_ids(frame["user_id"])).groupby("user_id")[outcomes]
    values = per_user.sum().to_numpy(dtype=np.float64)
    moments = stats.Moments.of(values)
    index = {c: i for i, c in enumerate(outcomes)}
    n = len(values)
    plans = []
    for name, (num, den) in metric_columns(outcomes).items():
        value, var = stats.value_and_variance(moments, index[num], index[den] if den else None)
        mean, variance = float(value), float(var)
        if not (math.isfinite(mean) and mean != 0 and math.isfinite(variance)):
            continue  # a metric that is 0 (or undefined) in the log has no relative lift
        needed = stats.users_needed(variance, rel_effect * mean, share_t=share_t, alpha=alpha,
                                    power=power)  # fmt: skip
        mde = float(stats.mde(variance, n * (1 - share_t), n * share_t, alpha=alpha, power=power))
        plans.append(Plan(name, mean, variance**0.5, n, needed, mde / mean if mean else np.nan))
    return plans


MAX_EFFECT = 10.0
"""Relative lifts `ab plan` plans for lie in (-1, MAX_EFFECT): a drop of less than 100%, a rise
of less than 1000%."""


def check_plan_arguments(rel_effect: float, share_t: float, alpha: float, power: float) -> None:
    """ConfigError (one line, exit 2) for a value the planning formulas cannot take."""
    bounds = (
        ("--effect", rel_effect, -1.0, MAX_EFFECT,
         "a relative lift, e.g. 0.02 for +2%, -0.05 for -5%; not 0"),
        ("--share", share_t, 0.0, 1.0, "the treatment's share of the test"),
        ("--alpha", alpha, *ALPHA, "the significance level, e.g. 0.05"),
        ("--power", power, *POWER, "e.g. 0.8"),
    )  # fmt: skip
    for option, value, low, high, what in bounds:
        if not (math.isfinite(value) and low < value < high) or (
            option == "--effect" and value == 0
        ):
            raise ConfigError(
                f"{option} {value!r} must be between {low:g} and {high:g} (exclusive): {what}"
            )


def format_plan(plans: list[Plan], rel_effect: float) -> str:
    """A table for the terminal."""
    lines = [
        f"{'metric':<14}{'mean/user':>11}{'sd/user':>11}{'users for ' + f'{rel_effect:+.1%}':>16}"
        f"{'MDE with the log':>18}",
    ]
    for p in plans:
        lines.append(
            f"{p.metric:<14}{p.mean:>11.4g}{p.sd:>11.4g}{p.users_needed:>16,}"
            f"{p.mde_rel_with_log_users:>+17.2%} ({p.users_in_log:,} users)"
        )
    lines.append(
        "fixed-horizon z-test, both arms together; the always-valid test read daily needs more "
        "(docs/AB_TESTING.md); CUPED needs fewer when a pre-period correlates"
    )
    return "\n".join(lines)
