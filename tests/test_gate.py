"""The champion/challenger gate on constructed per-user values: pure statistics, no MLflow."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recsys.core.config import GateConfig, parse_config
from recsys.core.errors import ConfigError
from recsys.core.records import PairedComparison
from recsys.tracking.gate import (
    FORCED_REASON,
    GateDecision,
    compare_with_baseline,
    decide,
    first_model_decision,
    pair_users,
    paired_bootstrap,
    with_baseline,
)

N = 2000
CONFIG = GateConfig(bootstrap_samples=1000, guardrails={"ndcg_at_10": 0.01, "coverage_at_10": 0.05})


def _users(recall50: np.ndarray, ndcg: np.ndarray) -> dict[str, np.ndarray]:
    return {"recall_at_50": recall50.astype(float), "ndcg_at_10": ndcg.astype(float)}


def _hits(rate: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random(N) < rate).astype(float)


SUMMARY = {"coverage_at_10": 0.40}


def test_clear_win_is_promoted() -> None:
    champion = _users(_hits(0.30, 1), _hits(0.10, 2) * 0.5)
    better = np.maximum(champion["recall_at_50"], _hits(0.15, 3))  # strictly more hits
    challenger = _users(better, champion["ndcg_at_10"])
    decision = decide(
        champion, challenger, CONFIG, champion_summary=SUMMARY, challenger_summary=SUMMARY
    )
    assert decision.promote and not decision.forced
    primary = decision.primary
    assert primary is not None and primary.passed
    expected = float((better - champion["recall_at_50"]).mean())
    assert primary.delta == pytest.approx(expected)
    assert 0 < primary.ci_low < expected < primary.ci_high
    assert all(g.passed for g in decision.guardrails)
    assert "confident improvement" in decision.summary()


def test_tie_within_noise_is_kept() -> None:
    champion = _users(_hits(0.30, 1), _hits(0.10, 2))
    # Same hit rate, independently drawn: the mean difference is noise around zero.
    challenger = _users(_hits(0.30, 4), _hits(0.10, 2))
    decision = decide(
        champion, challenger, CONFIG, champion_summary=SUMMARY, challenger_summary=SUMMARY
    )
    assert not decision.promote
    assert decision.primary is not None and decision.primary.ci_low <= 0 <= decision.primary.ci_high
    assert "CI includes 0" in decision.primary.reason or "min_delta" in decision.primary.reason


def test_min_delta_blocks_a_confident_but_small_gain() -> None:
    champion = _users(np.zeros(N), np.zeros(N))
    gain = np.zeros(N)
    gain[:100] = 1.0  # +0.05, confidently above zero
    decision = decide(
        champion, _users(gain, np.zeros(N)), CONFIG.model_copy(update={"min_delta": 0.1})
    )
    assert not decision.promote
    assert "below min_delta" in decision.reasons[0]


def test_guardrail_regression_blocks_promotion() -> None:
    champion = _users(_hits(0.30, 1), np.full(N, 0.20))
    better = np.maximum(champion["recall_at_50"], _hits(0.15, 3))
    challenger = _users(better, np.full(N, 0.15))  # NDCG@10 drops by 0.05 > tolerance 0.01
    decision = decide(
        champion, challenger, CONFIG, champion_summary=SUMMARY, challenger_summary=SUMMARY
    )
    assert decision.primary is not None and decision.primary.passed
    assert not decision.promote
    failed = [g.metric for g in decision.guardrails if not g.passed]
    assert failed == ["ndcg_at_10"]
    assert any("REGRESSED" in r and "ndcg_at_10" in r for r in decision.reasons)


def test_catalog_level_guardrail_uses_summaries() -> None:
    champion = _users(np.zeros(N), np.zeros(N))
    gain = np.zeros(N)
    gain[: N // 2] = 1.0
    decision = decide(
        champion,
        _users(gain, np.zeros(N)),
        CONFIG,
        champion_summary={"coverage_at_10": 0.50},
        challenger_summary={"coverage_at_10": 0.40},  # -0.10 beyond tolerance 0.05
    )
    assert not decision.promote
    coverage = next(g for g in decision.guardrails if g.metric == "coverage_at_10")
    assert not coverage.passed and coverage.ci_low is None
    assert coverage.delta == pytest.approx(-0.10)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_never_passes(bad: float) -> None:
    champion = _users(np.zeros(N), np.zeros(N))
    challenger = _users(np.ones(N), np.zeros(N))  # a huge "win"...
    challenger["recall_at_50"][7] = bad  # ...with one non-finite value
    decision = decide(
        champion, challenger, CONFIG, champion_summary=SUMMARY, challenger_summary=SUMMARY
    )
    assert not decision.promote
    assert "NaN/inf" in decision.reasons[0]


def test_nan_guardrail_summary_never_passes() -> None:
    champion = _users(np.zeros(N), np.zeros(N))
    decision = decide(
        champion,
        _users(np.ones(N), np.zeros(N)),
        CONFIG,
        champion_summary=SUMMARY,
        challenger_summary={"coverage_at_10": float("nan")},
    )
    assert not decision.promote
    assert any("coverage_at_10: NaN/inf" in r for r in decision.reasons)


def test_force_promotes_and_is_recorded() -> None:
    champion = _users(_hits(0.30, 1), _hits(0.10, 2))
    decision = decide(champion, champion, CONFIG, force=True, champion_summary=SUMMARY,
                      challenger_summary=SUMMARY)  # fmt: skip
    assert decision.promote and decision.forced
    assert "FORCED" in decision.reasons[0] and "(forced)" in decision.summary()
    again = GateDecision.from_dict(json.loads(json.dumps(decision.to_dict())))
    assert again == decision


def test_first_model_becomes_champion() -> None:
    decision = first_model_decision()
    assert decision.promote and decision.first_model and decision.decision == "promote"


def test_unknown_primary_metric_is_a_config_error() -> None:
    values = _users(np.zeros(10), np.zeros(10))
    with pytest.raises(ConfigError, match=r"gate\.primary_metric 'recall_at_20'"):
        decide(values, values, CONFIG.model_copy(update={"primary_metric": "recall_at_20"}))


def test_bootstrap_is_seeded_and_matches_a_direct_computation() -> None:
    diff = np.random.default_rng(0).normal(0.02, 0.3, 500)
    a = paired_bootstrap(diff, samples=500, confidence=0.9, seed=3)
    b = paired_bootstrap(diff, samples=500, confidence=0.9, seed=3)
    assert a == b
    rng = np.random.default_rng(3)
    means = diff[rng.integers(0, len(diff), size=(500, len(diff)))].mean(axis=1)
    assert (a.low, a.high) == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])))
    assert a.mean == pytest.approx(diff.mean()) and a.n == 500


def test_pairing_keeps_common_users_in_one_order() -> None:
    common, a, b = pair_users(
        ["u3", "u1", "u2"],
        {"m": np.array([3.0, 1.0, 2.0])},
        ["u2", "u4", "u1"],
        {"m": np.array([20.0, 40.0, 10.0])},
    )
    assert common == ["u1", "u2"]
    assert a["m"].tolist() == [1.0, 2.0] and b["m"].tolist() == [10.0, 20.0]


def test_gate_config_defaults_and_validation() -> None:
    gate = parse_config({}).gate
    assert gate.primary_metric == "recall_at_50" and gate.confidence == 0.95
    assert set(gate.guardrails) == {"ndcg_at_10", "coverage_at_10"}
    with pytest.raises(ConfigError, match=r"gate\.guardrails"):
        parse_config({"gate": {"guardrails": {"ndcg_at_10": -0.1}}})
    with pytest.raises(ConfigError, match=r"gate\.confidence"):
        parse_config({"gate": {"confidence": 1.5}})


# --- the classic baseline (evaluation.classic_baseline.policy refuse) ------------------------


def _against_als(model_rate: float, als_rate: float) -> PairedComparison:
    return compare_with_baseline("recall_at_50", _hits(model_rate, 5), _hits(als_rate, 6), CONFIG)


def _winning_decision() -> GateDecision:
    champion = _users(_hits(0.30, 1), _hits(0.10, 2))
    better = _users(np.maximum(champion["recall_at_50"], _hits(0.15, 3)), champion["ndcg_at_10"])
    decision = decide(
        champion, better, CONFIG, champion_summary=SUMMARY, challenger_summary=SUMMARY
    )
    assert decision.promote
    return decision


def test_the_comparison_with_a_baseline_is_paired() -> None:
    model, als = _hits(0.30, 5), _hits(0.40, 6)
    comparison = compare_with_baseline("recall_at_50", model, als, CONFIG)
    assert comparison.delta == pytest.approx(float((model - als).mean()))
    assert comparison.model == pytest.approx(model.mean())
    assert comparison.baseline == pytest.approx(als.mean())
    assert comparison.ci_low < comparison.delta < comparison.ci_high < 0
    assert comparison.users == N and comparison.model_loses
    line = comparison.line("ALS")
    assert line.startswith("ALS beat the model on recall_at_50: ")
    assert "95% CI [" in line and f"over {N} users" in line


def test_refuse_keeps_a_challenger_that_loses_to_als() -> None:
    decision = with_baseline(_winning_decision(), _against_als(0.30, 0.40), "ALS")
    assert not decision.promote and not decision.forced
    assert decision.baseline is not None and not decision.baseline.passed
    assert decision.baseline.metric == "recall_at_50 vs ALS"
    assert "confident improvement" in decision.reasons[0]  # the gate's own reason stays
    assert "ALS beat the model" in decision.reasons[-1]
    assert "policy is refuse: not promoted" in decision.summary()
    assert decision.checks[-1] == decision.baseline
    again = GateDecision.from_dict(json.loads(json.dumps(decision.to_dict())))
    assert again == decision


def test_refuse_on_the_first_night_promotes_nothing() -> None:
    decision = with_baseline(first_model_decision(), _against_als(0.30, 0.40), "ALS")
    assert not decision.promote and decision.first_model
    (reason,) = decision.reasons
    assert reason.startswith("no champion yet, but ALS beat the model")
    assert "nothing is promoted and nothing serves until a model beats ALS" in reason


def test_a_challenger_that_beats_als_is_gated_as_before() -> None:
    decision = with_baseline(_winning_decision(), _against_als(0.40, 0.30), "ALS")
    assert decision.promote and decision.baseline is not None and decision.baseline.passed
    assert decision.reasons[-1].startswith("The model beat ALS on recall_at_50")
    first = with_baseline(first_model_decision(), _against_als(0.40, 0.30), "ALS")
    assert first.promote and first.first_model


def test_force_promotes_over_the_refusal() -> None:
    decision = with_baseline(first_model_decision(), _against_als(0.30, 0.40), "ALS", force=True)
    assert decision.promote and decision.forced
    assert decision.reasons[0] == FORCED_REASON and "refuse would keep it" in decision.reasons[-1]
    # Forced past the gate already: one FORCED reason, not two.
    champion = _users(_hits(0.30, 1), _hits(0.10, 2))
    forced = decide(champion, champion, CONFIG, force=True, champion_summary=SUMMARY,
                    challenger_summary=SUMMARY)  # fmt: skip
    forced = with_baseline(forced, _against_als(0.30, 0.40), "ALS", force=True)
    assert forced.promote and forced.reasons.count(FORCED_REASON) == 1


def test_decisions_recorded_before_the_baseline_read_back() -> None:
    recorded = first_model_decision().to_dict()
    del recorded["baseline"]
    assert GateDecision.from_dict(recorded) == first_model_decision()
