"""Analysis of an A/B test from its per-user table: metrics, SRM, day-by-day looks, decision.

Metrics: every outcome column is a mean-per-user metric; `clicks` with `impressions` also make
the ratio metric `ctr` (delta method), the default primary metric. CUPED applies when users
have pre-period data. The decision uses the always-valid interval (the mixture-SPRT confidence
sequence at today's look), so reading it every day does not inflate false positives.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from recsys.ab import stats
from recsys.ab.definition import ExperimentDefinition
from recsys.ab.events import PRE, UserTable
from recsys.core.errors import ConfigError

RATIO_METRICS = {"ctr": ("clicks", "impressions")}


@dataclass
class DailyPoint:
    """One look: the cumulative effect up to a day (relative lift and its two intervals)."""

    day: str
    users: int
    rel: float
    rel_low: float
    rel_high: float
    seq_rel_low: float
    seq_rel_high: float


@dataclass
class MetricResult:
    """One metric's comparison (treatment - control)."""

    name: str
    kind: str
    cuped: bool
    control: float
    treatment: float
    diff: float
    ci_low: float
    ci_high: float
    p_value: float
    rel: float
    rel_low: float
    rel_high: float
    seq_low: float
    seq_high: float
    seq_p_value: float
    mde: float
    daily: list[DailyPoint] = field(default_factory=list)

    @property
    def significant(self) -> bool:
        """The always-valid interval excludes zero."""
        return self.seq_low > 0 or self.seq_high < 0


@dataclass
class Decision:
    """The outcome: a winning variant, or none and why (too_early, not_significant, srm, ...)."""

    winner: str | None
    status: str
    reason: str

    def line(self, experiment: str) -> str:
        """The one line that ends an analysis."""
        if self.winner:
            return f"decision for {experiment}: {self.winner} wins ({self.reason})"
        why = self.status.replace("_", " ")
        return f"decision for {experiment}: no decision, {why} ({self.reason})"


@dataclass
class Analysis:
    """Everything an analysis found."""

    experiment: str
    control: str
    treatment: str
    primary: str
    users: dict[str, int]
    shares: dict[str, float]
    srm_p_value: float
    days: int
    first_day: str
    last_day: str
    metrics: dict[str, MetricResult]
    decision: Decision
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (analysis.json)."""
        return asdict(self)


def metric_columns(outcomes: list[str]) -> dict[str, tuple[str, str | None]]:
    """Each metric's numerator and denominator columns (None: mean per user)."""
    specs: dict[str, tuple[str, str | None]] = {c: (c, None) for c in outcomes}
    for name, (num, den) in RATIO_METRICS.items():
        if num in outcomes and den in outcomes and name not in specs:
            specs[name] = (num, den)
    return specs


def default_primary(outcomes: list[str]) -> str:
    """`ctr` when clicks and impressions are logged, else the first outcome column."""
    specs = metric_columns(outcomes)
    return "ctr" if "ctr" in specs else outcomes[0]


def analyze(table: UserTable, definition: ExperimentDefinition) -> Analysis:
    """Analyse the experiment as of the last day in the log."""
    control, treatment = definition.control, definition.treatment
    specs = metric_columns(table.outcomes)
    primary = definition.primary_metric or default_primary(table.outcomes)
    for name in [primary, *definition.guardrails]:
        if name not in specs:
            raise ConfigError(
                f"experiment {definition.name}: metric {name!r} is not in the log "
                f"(metrics: {sorted(specs)})"
            )
    cuped = table.has_pre_period
    columns = table.outcomes + ([PRE + c for c in table.outcomes] if cuped else [])
    days, sizes, moments_c, moments_t = _daily_moments(table, columns, control, treatment)
    index = {c: i for i, c in enumerate(columns)}
    metrics = {}
    for name, (num, den) in specs.items():
        spec = stats.MetricColumns(
            index[num], index[den] if den else None,
            index[PRE + num] if cuped else None, index[PRE + den] if cuped and den else None,
        )  # fmt: skip
        arms = stats.arms(moments_c, moments_t, spec)
        eff = stats.effect(arms, alpha=definition.alpha, tau_sd=definition.tau_sd)
        metrics[name] = _result(name, "ratio" if den else "mean", cuped, arms, eff, days, sizes,
                                definition)  # fmt: skip
    users = {v: int((table.users["variant"] == v).sum()) for v in (control, treatment)}
    shares = {v: definition.shares()[v] for v in (control, treatment)}
    srm_p = stats.srm_p_value(np.array(list(users.values())), np.array(list(shares.values())))
    first = definition.start or table.days[0]
    duration = (table.days[-1] - first).days + 1
    notes = list(table.notes) + ([] if cuped else ["no pre-period data: CUPED not applied"])
    decision = decide(metrics, primary, definition, srm_p, users, duration)
    return Analysis(
        definition.name, control, treatment, primary, users, shares, srm_p, duration,
        first.isoformat(), table.days[-1].isoformat(), metrics, decision, notes,
    )  # fmt: skip


def _daily_moments(
    table: UserTable, columns: list[str], control: str, treatment: str
) -> tuple[list[dt.date], list[int], stats.Moments, stats.Moments]:
    """Both arms' per-user moments of every column at each daily look, stacked over days."""
    days, sizes, per_arm = [], [], ([], [])  # type: ignore[var-annotated]
    for day, frame in table.looks():
        values = [frame.loc[frame["variant"] == v, columns].to_numpy(np.float64)
                  for v in (control, treatment)]  # fmt: skip
        if min(len(v) for v in values) < 2:
            continue  # a look needs two users per arm
        for arm, v in zip(per_arm, values, strict=True):
            arm.append(stats.Moments.of(v))
        days.append(day)
        sizes.append(sum(len(v) for v in values))
    if not days:
        raise ConfigError(f"fewer than 2 users in {control!r} or {treatment!r}: nothing to compare")
    stacked = [
        stats.Moments(*(np.stack([getattr(m, f) for m in arm]) for f in ("n", "mean", "cov")))
        for arm in per_arm
    ]
    return days, sizes, stacked[0], stacked[1]


def _result(
    name: str,
    kind: str,
    cuped: bool,
    arms: stats.Arms,
    eff: stats.Effect,
    days: list[dt.date],
    sizes: list[int],
    definition: ExperimentDefinition,
) -> MetricResult:
    """One metric's result: today's look, the always-valid p-value, the daily points."""
    points = [
        DailyPoint(
            day.isoformat(), size, float(eff.rel[i]), float(eff.rel_low[i]),
            float(eff.rel_high[i]), float(eff.seq_low[i] / eff.control[i]),
            float(eff.seq_high[i] / eff.control[i]),
        )
        for i, (day, size) in enumerate(zip(days, sizes, strict=True))
    ]  # fmt: skip
    # The interval is today's look at the confidence sequence (not the intersection over days:
    # a per-user sum grows with exposure, so its effect is not one fixed number across days).
    # Under "no effect on any day" a look excluding 0 has probability <= alpha whichever day
    # it happens, so deciding on today's look keeps the false-positive rate; the reported
    # p-value is the always-valid one, the running minimum over all looks.
    last = -1
    seq_p = float(np.nanmin(eff.seq_p_value)) if np.isfinite(eff.seq_p_value).any() else np.nan
    n_c, n_t = float(arms.n_c[last]), float(arms.n_t[last])
    pooled_var = float((arms.var_c[last] * n_c + arms.var_t[last] * n_t) / (n_c + n_t))
    mde = float(stats.mde(pooled_var, n_c, n_t, alpha=definition.alpha, power=definition.power))
    fields = ("control", "treatment", "diff", "ci_low", "ci_high", "p_value", "rel", "rel_low",
              "rel_high", "seq_low", "seq_high")  # fmt: skip
    values = {f: float(getattr(eff, f)[last]) for f in fields}
    return MetricResult(name, kind, cuped, **values, seq_p_value=seq_p, mde=mde, daily=points)


def decide(
    metrics: dict[str, MetricResult],
    primary: str,
    definition: ExperimentDefinition,
    srm_p: float,
    users: dict[str, int],
    days: int,
) -> Decision:
    """The winner on the primary metric, or none: SRM, NaN, too early, guardrail, no effect."""
    if srm_p < stats.SRM_ALPHA:
        shares = {v: round(s, 4) for v, s in definition.shares().items()}
        return Decision(
            None, "srm",
            f"sample ratio mismatch: users {users} vs split {shares}, chi-square "
            f"p={srm_p:.2g} < {stats.SRM_ALPHA}; fix assignment or logging before reading results",
        )  # fmt: skip
    result = metrics[primary]
    if not is_finite(result):
        return Decision(
            None, "not_computable",
            f"{primary} is not a finite number (e.g. no impressions in one arm): check the log",
        )  # fmt: skip
    rel = f"{primary} {result.rel:+.2%}, difference {result.diff:+.4g} (always-valid "
    rel += f"{1 - definition.alpha:.0%} interval "
    rel += f"[{result.seq_low:+.4g}, {result.seq_high:+.4g}], p={result.seq_p_value:.3g})"
    if days < definition.min_days:
        return Decision(None, "too_early", f"day {days} of at least {definition.min_days}; {rel}")
    if result.significant:
        winner = definition.treatment if result.diff > 0 else definition.control
        broken = _guardrail_failures(metrics, definition)
        if winner == definition.treatment and broken:
            return Decision(None, "guardrail", "; ".join(broken) + f"; {rel}")
        return Decision(winner, "winner", rel)
    if days < definition.planned_days:
        return Decision(
            None, "too_early",
            f"not significant yet, day {days} of {definition.planned_days} planned; {rel}; "
            f"detectable now at 80% power: {result.mde:.4g}",
        )  # fmt: skip
    return Decision(
        None, "not_significant",
        f"no significant difference after {days} days; {rel}; "
        f"effects below {result.mde:.4g} were not detectable",
    )  # fmt: skip


def _guardrail_failures(
    metrics: dict[str, MetricResult], definition: ExperimentDefinition
) -> list[str]:
    broken = []
    for name, tolerance in sorted(definition.guardrails.items()):
        m = metrics[name]
        # Worse beyond tolerance with always-valid confidence: the whole interval is below it.
        if m.control and m.seq_high / abs(m.control) < -tolerance:
            broken.append(
                f"guardrail {name} regressed: {m.rel:+.2%}, interval upper bound "
                f"{m.seq_high / abs(m.control):+.2%} < -{tolerance:.2%}"
            )
    return broken


def is_finite(result: MetricResult) -> bool:
    """Whether every number of a metric is finite (NaN blocks a decision)."""
    return all(math.isfinite(v) for v in (result.diff, result.ci_low, result.ci_high))
