"""The champion/challenger gate: pure statistics on per-user values, no MLflow I/O.

The challenger is promoted only if, on the same evaluation users,
- the primary metric's mean per-user gain (challenger - champion) is at least `min_delta`,
- the paired bootstrap confidence interval of that gain lies above zero, and
- no guardrail metric drops by more than its tolerance;
- with `evaluation.classic_baseline.policy: refuse`, it scores at least the night's classic
  baseline (ALS) on the primary metric (point estimate; metrics.json's paired comparison).
Any NaN/inf in what is compared fails the gate. See docs/TRACKING.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np

from recsys.core.config import GateConfig
from recsys.core.errors import ConfigError
from recsys.core.records import PairedComparison

# Resampled means are computed in chunks so memory stays ~chunk x users, not samples x users.
_CHUNK_ELEMENTS = 5_000_000
FORCED_REASON = "promotion FORCED by --force-promote despite the gate"


@dataclass(frozen=True)
class Interval:
    """Mean paired difference (b - a) and its bootstrap confidence interval."""

    mean: float
    low: float
    high: float
    confidence: float
    n: int


def paired_bootstrap(diff: np.ndarray, *, samples: int, confidence: float, seed: int) -> Interval:
    """Percentile bootstrap CI of the mean of per-user differences (users resampled, seeded)."""
    diff = np.asarray(diff, dtype=np.float64)
    n = len(diff)
    if n == 0 or not np.all(np.isfinite(diff)):
        return Interval(math.nan, math.nan, math.nan, confidence, n)
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    for start in range(0, samples, chunk):
        stop = min(start + chunk, samples)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(float(diff.mean()), float(low), float(high), confidence, n)


def pair_users(
    a_users: np.ndarray | list[str],
    a_values: Mapping[str, np.ndarray],
    b_users: np.ndarray | list[str],
    b_values: Mapping[str, np.ndarray],
) -> tuple[list[str], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Both sides' per-user values restricted to their common users, in one sorted user order."""
    a_index = {u: i for i, u in enumerate(map(str, a_users))}
    b_index = {u: i for i, u in enumerate(map(str, b_users))}
    common = sorted(a_index.keys() & b_index.keys())
    ai = np.array([a_index[u] for u in common], dtype=np.int64)
    bi = np.array([b_index[u] for u in common], dtype=np.int64)
    names = a_values.keys() & b_values.keys()
    a = {k: np.asarray(a_values[k])[ai] for k in names}
    b = {k: np.asarray(b_values[k])[bi] for k in names}
    return common, a, b


@dataclass(frozen=True)
class Check:
    """One metric's comparison and whether it passed."""

    metric: str
    champion: float
    challenger: float
    delta: float
    ci_low: float | None
    ci_high: float | None
    threshold: float
    passed: bool
    reason: str


@dataclass
class GateDecision:
    """The gate's outcome, with every number and reason behind it."""

    promote: bool
    reasons: list[str]
    primary: Check | None = None
    guardrails: list[Check] = field(default_factory=list)
    forced: bool = False
    first_model: bool = False
    users: int = 0
    confidence: float = 0.95
    # The challenger against the classic baseline (policy refuse only): `champion` holds the
    # baseline's score. Absent from decisions recorded before it existed.
    baseline: Check | None = None

    @property
    def decision(self) -> str:
        """'promote' or 'keep'."""
        return "promote" if self.promote else "keep"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record (gate.json)."""
        out = asdict(self)
        out["decision"] = self.decision
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GateDecision:
        """The decision recorded by `to_dict` (a rerun reads it back from gate.json)."""
        primary, baseline = data.get("primary"), data.get("baseline")
        return cls(
            promote=bool(data["promote"]),
            reasons=list(data.get("reasons", [])),
            primary=Check(**primary) if primary else None,
            guardrails=[Check(**g) for g in data.get("guardrails", [])],
            forced=bool(data.get("forced", False)),
            first_model=bool(data.get("first_model", False)),
            users=int(data.get("users", 0)),
            confidence=float(data.get("confidence", 0.95)),
            baseline=Check(**baseline) if baseline else None,
        )

    @property
    def checks(self) -> list[Check]:
        """Every comparison made: primary, guardrails, then the classic baseline."""
        primary = [self.primary] if self.primary else []
        return primary + self.guardrails + ([self.baseline] if self.baseline else [])

    def summary(self) -> str:
        """One line for the terminal and logs."""
        head = f"gate: {self.decision.upper()}"
        if self.forced:
            head += " (forced)"
        return f"{head}: " + "; ".join(self.reasons)


def first_model_decision() -> GateDecision:
    """No champion yet: the first model becomes champion."""
    return GateDecision(
        True, ["no champion yet: the first model becomes champion"], first_model=True
    )


def not_compared_decision(reason: str, *, force: bool = False) -> GateDecision:
    """The champion could not be compared: keep it (safe), unless a person forces promotion."""
    reasons = [FORCED_REASON, reason] if force else [reason]
    return GateDecision(force, reasons, forced=force)


def decide(
    champion: Mapping[str, np.ndarray],
    challenger: Mapping[str, np.ndarray],
    config: GateConfig,
    *,
    champion_summary: Mapping[str, float] | None = None,
    challenger_summary: Mapping[str, float] | None = None,
    force: bool = False,
) -> GateDecision:
    """Gate the challenger against the champion on paired per-user values (same users, same order).

    Metrics without per-user values (coverage) are compared on the summaries, without an interval.
    """
    champion_summary = champion_summary or {}
    challenger_summary = challenger_summary or {}
    n = _paired_length(champion, challenger)
    primary = _primary_check(champion, challenger, config)
    guards = [
        _guardrail_check(
            name, tol, champion, challenger, champion_summary, challenger_summary, config
        )
        for name, tol in sorted(config.guardrails.items())
    ]
    passed = primary.passed and all(g.passed for g in guards)
    reasons = [primary.reason] + [g.reason for g in guards if not g.passed]
    if force and not passed:
        reasons.insert(0, FORCED_REASON)
    return GateDecision(
        promote=passed or force,
        reasons=reasons,
        primary=primary,
        guardrails=guards,
        forced=force and not passed,
        users=n,
        confidence=config.confidence,
    )


def compare_with_baseline(
    metric: str, model: np.ndarray, baseline: np.ndarray, config: GateConfig
) -> PairedComparison:
    """The model against a baseline scored on the same users in the same order: the mean
    per-user difference (model - baseline) of `metric` and its paired bootstrap interval
    (the gate's resamples, level and seed)."""
    a = np.asarray(model, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"per-user arrays must be paired, got shapes {a.shape} and {b.shape}")
    ci = paired_bootstrap(
        a - b, samples=config.bootstrap_samples, confidence=config.confidence, seed=config.seed
    )
    return PairedComparison(
        metric=metric,
        model=_mean(a),
        baseline=_mean(b),
        delta=ci.mean,
        ci_low=ci.low,
        ci_high=ci.high,
        confidence=config.confidence,
        users=len(a),
    )


BASELINE_POLICY = "evaluation.classic_baseline.policy"


def with_baseline(
    decision: GateDecision, comparison: PairedComparison, name: str, *, force: bool = False
) -> GateDecision:
    """`decision` once the challenger is held against the night's classic baseline (policy
    refuse): a challenger whose point estimate is below the baseline's is not promoted, the
    first model included (then nothing is), unless forced."""
    passed = not comparison.model_loses
    reason = comparison.line(name)
    if not passed and force:
        reason += f"; {BASELINE_POLICY} refuse would keep it"
    elif not passed and decision.first_model:
        reason = (
            f"no champion yet, but {reason}; {BASELINE_POLICY} is refuse, so nothing is "
            f"promoted and nothing serves until a model beats {name} (or --force-promote)"
        )
    elif not passed:
        reason += f"; {BASELINE_POLICY} is refuse: not promoted"
    decision.baseline = Check(
        metric=f"{comparison.metric} vs {name}",
        champion=comparison.baseline,
        challenger=comparison.model,
        delta=comparison.delta,
        ci_low=comparison.ci_low,
        ci_high=comparison.ci_high,
        threshold=0.0,
        passed=passed,
        reason=reason,
    )
    if passed or not decision.promote:  # nothing changes: the reason is added
        decision.reasons.append(reason)
        return decision
    if force:
        forced = [] if decision.forced else [FORCED_REASON]  # forced past the gate already
        decision.forced = True
        decision.reasons = [*forced, *decision.reasons, reason]
    else:
        decision.promote = False
        decision.reasons = [reason] if decision.first_model else [*decision.reasons, reason]
    return decision


def _paired_length(champion: Mapping[str, np.ndarray], challenger: Mapping[str, np.ndarray]) -> int:
    lengths = {len(v) for v in champion.values()} | {len(v) for v in challenger.values()}
    if len(lengths) > 1:
        raise ValueError(f"per-user arrays must be paired (one length), got lengths {lengths}")
    return lengths.pop() if lengths else 0


def _primary_check(
    champion: Mapping[str, np.ndarray], challenger: Mapping[str, np.ndarray], config: GateConfig
) -> Check:
    name = config.primary_metric
    if name not in champion or name not in challenger:
        available = sorted(champion.keys() & challenger.keys())
        raise ConfigError(
            f"gate.primary_metric {name!r} has no per-user values (available: {available}); "
            "set gate.primary_metric to one of them"
        )
    a = np.asarray(champion[name], dtype=np.float64)
    b = np.asarray(challenger[name], dtype=np.float64)
    ci = paired_bootstrap(
        b - a, samples=config.bootstrap_samples, confidence=config.confidence, seed=config.seed
    )
    pct = f"{config.confidence:.0%}"
    champion_mean, challenger_mean = _mean(a), _mean(b)
    check = partial(
        Check,
        metric=name,
        champion=champion_mean,
        challenger=challenger_mean,
        delta=ci.mean,
        ci_low=ci.low,
        ci_high=ci.high,
        threshold=config.min_delta,
    )
    if len(a) == 0:
        return check(passed=False, reason=f"{name}: no common evaluation users")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return check(passed=False, reason=f"{name}: NaN/inf per-user values never pass")
    text = (
        f"{name} {challenger_mean:.4f} vs {champion_mean:.4f}: "
        f"delta {ci.mean:+.4f}, {pct} CI [{ci.low:+.4f}, {ci.high:+.4f}] over {len(a)} users"
    )
    if ci.mean < config.min_delta:
        return check(passed=False, reason=f"{text}; below min_delta {config.min_delta}")
    if not ci.low > 0:
        return check(passed=False, reason=f"{text}; CI includes 0 (not confident)")
    return check(passed=True, reason=f"{text}; confident improvement")


def _guardrail_check(
    name: str,
    tolerance: float,
    champion: Mapping[str, np.ndarray],
    challenger: Mapping[str, np.ndarray],
    champion_summary: Mapping[str, float],
    challenger_summary: Mapping[str, float],
    config: GateConfig,
) -> Check:
    low = high = None
    if name in champion and name in challenger:
        a = np.asarray(champion[name], dtype=np.float64)
        b = np.asarray(challenger[name], dtype=np.float64)
        finite = bool(np.all(np.isfinite(a)) and np.all(np.isfinite(b)))
        a_mean, b_mean = _mean(a), _mean(b)
        ci = paired_bootstrap(
            b - a, samples=config.bootstrap_samples, confidence=config.confidence, seed=config.seed
        )
        low, high = ci.low, ci.high
    elif name in champion_summary and name in challenger_summary:
        a_mean, b_mean = float(champion_summary[name]), float(challenger_summary[name])
        finite = math.isfinite(a_mean) and math.isfinite(b_mean)
    else:
        return Check(
            name, math.nan, math.nan, math.nan, None, None, -tolerance, False,
            f"guardrail {name}: not measured for both models (check gate.guardrails)",
        )  # fmt: skip
    delta = b_mean - a_mean
    if not finite:
        reason, passed = f"guardrail {name}: NaN/inf values never pass", False
    else:
        # Point estimate against the tolerance: a guardrail stops clear regressions, it does not
        # demand proof of no change (that would block every tie on small evaluation sets).
        passed = delta >= -tolerance
        verdict = "ok" if passed else "REGRESSED beyond tolerance"
        reason = (
            f"guardrail {name} {b_mean:.4f} vs {a_mean:.4f}: delta {delta:+.4f} "
            f"(tolerance -{tolerance}) {verdict}"
        )
    return Check(name, a_mean, b_mean, delta, low, high, -tolerance, passed, reason)


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan
