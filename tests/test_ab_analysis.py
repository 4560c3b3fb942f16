"""A/B assignment, the exposure log, and the analysis's decision on generated logs (no MLflow)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from recsys.ab import HOLDOUT, analyze, assign, assign_many, bucket
from recsys.ab import simulate as sim
from recsys.ab.definition import ExperimentDefinition, make_definition
from recsys.ab.events import user_table
from recsys.core.errors import ConfigError, DataError

# The test vectors of docs/AB_TESTING.md: a router in another language must reproduce them.
VECTORS = [
    # user, experiment, salt, bucket, 50/50, 45/45 + 10% holdout
    ("42", "homepage", "", 3161, "A", "A"),
    ("42", "homepage", "2026q1", 999, "A", HOLDOUT),
    ("ü-ñ", "recs", "", 8006, "B", "B"),
    ("6", "homepage", "", 5236, "B", "A"),
    ("8", "homepage", "", 9742, "B", "B"),
]


@pytest.mark.parametrize(("user", "experiment", "salt", "expected", "even", "held"), VECTORS)
def test_assignment_matches_the_documented_vectors(
    user: str, experiment: str, salt: str, expected: int, even: str, held: str
) -> None:
    assert bucket(user, experiment, salt) == expected
    assert assign(user, experiment, {"A": 0.5, "B": 0.5}, salt=salt) == even
    assert assign(user, experiment, {"A": 0.45, "B": 0.45}, holdout=0.1, salt=salt) == held


def test_assignment_is_stable_across_processes() -> None:
    # A different PYTHONHASHSEED must not matter: only SHA-256 is used.
    code = "from recsys.ab import bucket; print([bucket(str(u), 'e', 's') for u in range(50)])"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parent.parent,
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {str([bucket(str(u), "e", "s") for u in range(50)]) + "\n"}


def test_split_and_holdout_proportions() -> None:
    users = [f"user-{i}" for i in range(40_000)]
    got = pd.Series(assign_many(users, "exp", {"A": 0.2, "B": 0.7}, holdout=0.1)).value_counts(
        normalize=True
    )
    assert got[HOLDOUT] == pytest.approx(0.1, abs=0.01)
    assert got["A"] == pytest.approx(0.2, abs=0.01)
    assert got["B"] == pytest.approx(0.7, abs=0.01)
    # Another experiment name reshuffles users independently of this one.
    other = assign_many(users, "exp2", {"A": 0.5, "B": 0.5})
    same = assign_many(users, "exp", {"A": 0.5, "B": 0.5})
    assert 0.45 < np.mean(np.array(other) == np.array(same)) < 0.55


@pytest.mark.parametrize(
    ("split", "holdout", "message"),
    [
        ({"A": 0.5, "B": 0.4}, 0.0, "adds up to 0.9"),
        ({"A": 0.50005, "B": 0.49995}, 0.0, "whole basis points"),
        ({"holdout": 0.5, "B": 0.5}, 0.0, "reserved"),
    ],
)
def test_bad_split_is_a_config_error(split: dict[str, float], holdout: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        assign("u", "e", split, holdout=holdout)


def test_definition_rejects_unknown_fields_and_three_variants() -> None:
    with pytest.raises(ConfigError, match="experiment field primary"):
        make_definition({"name": "x", "primary": "ctr"})
    with pytest.raises(ConfigError, match="two variants"):
        make_definition({"name": "x", "variants": {"A": "1", "B": "2", "C": "3"}})


def _log(tmp_path: Path, **kwargs: object) -> Path:
    seed = int(kwargs.pop("seed", 0))  # type: ignore[call-overload]
    frame = sim.event_log(np.random.default_rng(seed), experiment="exp", **kwargs)  # type: ignore[arg-type]
    path = tmp_path / "events.parquet"
    frame.to_parquet(path)
    return path


def _definition(**extra: object) -> ExperimentDefinition:
    return make_definition({"name": "exp", "start": "2026-01-01", **extra})


def _analyze(path: Path, definition: ExperimentDefinition):  # type: ignore[no-untyped-def]
    table = user_table(path, start=definition.start, variants=list(definition.variants))
    return analyze(table, definition)


def test_clear_winner_after_the_minimum_duration(tmp_path: Path) -> None:
    result = _analyze(_log(tmp_path, users=3000, days=10, lift=0.3), _definition())
    assert result.primary == "ctr"
    assert result.metrics["ctr"].kind == "ratio" and result.metrics["ctr"].cuped
    assert result.decision.winner == "B" and result.decision.status == "winner"
    assert set(result.metrics) == {"clicks", "impressions", "watch_seconds", "ctr"}
    assert len(result.metrics["ctr"].daily) == 10


def test_too_early_before_min_days_even_if_significant(tmp_path: Path) -> None:
    result = _analyze(_log(tmp_path, users=3000, days=3, lift=0.3), _definition())
    assert result.decision.winner is None and result.decision.status == "too_early"
    assert "day 3 of at least 7" in result.decision.reason


def test_no_effect_is_not_significant_after_the_planned_days(tmp_path: Path) -> None:
    result = _analyze(_log(tmp_path, users=2000, days=14, seed=4), _definition())
    assert result.decision.status == "not_significant", result.decision.reason


def test_a_52_48_split_blocks_the_decision(tmp_path: Path) -> None:
    path = _log(tmp_path, users=20_000, days=8, lift=0.3, drop_treatment=0.08, pre_days=0)
    result = _analyze(path, _definition())
    assert result.decision.status == "srm" and result.decision.winner is None
    assert result.srm_p_value < 0.001
    assert "sample ratio mismatch" in result.decision.line("exp")


def test_guardrail_regression_blocks_the_winner(tmp_path: Path) -> None:
    frame = sim.event_log(np.random.default_rng(1), users=3000, days=8, lift=0.3, experiment="exp")
    # A "higher is better" metric that B halves from the start: beyond the 5% tolerance.
    during = frame["timestamp"] >= pd.Timestamp("2026-01-01", tz="UTC")
    halved = (frame["variant"] == "B") & during
    frame["sessions"] = np.where(halved, 0.5, 1.0) * frame["impressions"]
    path = tmp_path / "events.csv"
    frame.to_csv(path, index=False)
    tolerated = _analyze(path, _definition(guardrails={"watch_seconds": 0.0}))
    assert tolerated.decision.winner == "B"
    worse = _analyze(path, _definition(guardrails={"sessions": 0.05}))
    assert worse.decision.status == "guardrail" and worse.decision.winner is None
    assert "sessions regressed" in worse.decision.reason


def test_csv_and_parquet_give_the_same_numbers(tmp_path: Path) -> None:
    parquet = _log(tmp_path, users=1000, days=8, lift=0.1)
    csv = tmp_path / "events.csv"
    pd.read_parquet(parquet).to_csv(csv, index=False)
    a, b = _analyze(parquet, _definition()), _analyze(csv, _definition())
    assert a.metrics["ctr"].diff == pytest.approx(b.metrics["ctr"].diff, rel=1e-12)


def test_users_in_two_variants_and_holdout_rows_are_excluded(tmp_path: Path) -> None:
    frame = sim.event_log(np.random.default_rng(0), users=500, days=8, experiment="exp")
    first = frame[frame["timestamp"] >= pd.Timestamp("2026-01-01", tz="UTC")].iloc[[0]]
    leak = first.assign(variant="B" if first["variant"].iloc[0] == "A" else "A")
    held = first.assign(variant=HOLDOUT, user_id="h1")
    path = tmp_path / "events.parquet"
    pd.concat([frame, leak, held]).to_parquet(path)
    result = _analyze(path, _definition())
    assert sum(result.users.values()) == frame["user_id"].nunique() - 1
    assert any("more than one variant" in n for n in result.notes)
    assert any("holdout" in n for n in result.notes)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.drop(columns=["variant"]), r"missing column\(s\) \['variant'\]"),
        (lambda f: f.assign(clicks=f["clicks"].where(f.index != 5, np.nan)), "row 5 .* 'clicks'"),
        (lambda f: f.assign(variant=f["variant"].where(f.index != f.index[-1], "C")), "C"),
        (lambda f: f.assign(timestamp="yesterday"), "'timestamp'"),
    ],
)
def test_bad_logs_name_the_row_and_field(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    frame = sim.event_log(np.random.default_rng(0), users=50, days=2, experiment="exp")
    path = tmp_path / "events.csv"
    mutate(frame).to_csv(path, index=False)
    with pytest.raises(DataError, match=message):
        _analyze(path, _definition())


def test_no_pre_period_means_no_cuped(tmp_path: Path) -> None:
    result = _analyze(_log(tmp_path, users=500, days=8, pre_days=0), _definition())
    assert not result.metrics["ctr"].cuped
    assert any("CUPED not applied" in n for n in result.notes)
    assert result.first_day == dt.date(2026, 1, 1).isoformat()


def test_plan_from_a_log_without_variants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conductor import cli
    from recsys.ab import stats
    from recsys.ab.planning import plan

    frame = sim.event_log(np.random.default_rng(0), users=2000, days=7, experiment="exp")
    path = tmp_path / "traffic.csv"
    frame.drop(columns=["variant"]).to_csv(path, index=False)
    plans = {p.metric: p for p in plan(path, rel_effect=0.05)}
    ctr = plans["ctr"]
    # Round trip: at the users needed, the MDE is the planned effect.
    mde = stats.mde(ctr.sd**2, ctr.users_needed / 2, ctr.users_needed / 2)
    assert float(mde) == pytest.approx(0.05 * ctr.mean, rel=1e-3)
    assert ctr.users_in_log == 2000
    assert cli.main(["ab", "plan", "--events", str(path), "--workdir", str(tmp_path)]) == 0
    assert "users for +2.0%" in capsys.readouterr().out


def test_definition_file_with_overrides_and_errors(tmp_path: Path) -> None:
    from recsys.ab.definition import load_definition

    path = tmp_path / "exp.yaml"
    path.write_text(
        "variants: {control: '3', treatment: v5}\nsplit: {control: 0.3, treatment: 0.6}\n"
        "holdout: 0.1\nguardrails: {watch_seconds: 0.02}\nstart: 2026-02-01\n"
    )
    definition = load_definition(path, name="feed", holdout=None)
    assert (definition.control, definition.treatment) == ("control", "treatment")
    assert definition.assignment_split() == {"control": 0.3, "treatment": 0.6}
    assert definition.start == dt.date(2026, 2, 1)
    path.write_text("variants: {A: '1', B: '2'}\nsplit: {A: 0.5, B: 0.4}\n")
    with pytest.raises(ConfigError, match=r"exp.yaml: experiment field .*adds up to 0.9"):
        load_definition(path, name="feed")


def test_no_impressions_in_one_arm_is_no_decision(tmp_path: Path) -> None:
    frame = sim.event_log(np.random.default_rng(0), users=400, days=8, experiment="exp")
    # No impressions, hence no clicks (clicks > impressions would be rejected as impossible).
    frame.loc[frame["variant"] == "B", ["impressions", "clicks"]] = 0
    path = tmp_path / "events.parquet"
    frame.to_parquet(path)
    result = _analyze(path, _definition())
    assert result.decision.status == "not_computable" and result.decision.winner is None


@pytest.mark.parametrize(("user", "experiment", "salt", "expected"), [v[:4] for v in VECTORS])
def test_bucket_agrees_with_coreutils_sha256sum(
    user: str, experiment: str, salt: str, expected: int
) -> None:
    # Another SHA-256 implementation, as a router in another language would have.
    digest = subprocess.run(
        ["sha256sum"], input=f"{experiment}:{salt}:{user}".encode(), capture_output=True,
        check=True,
    ).stdout.split()[0]  # fmt: skip
    assert int(digest[:16], 16) % 10_000 == expected


def test_the_ab_library_imports_only_core_tracking_and_serving_state() -> None:
    # The layer rule (docs/ARCHITECTURE.md): never the CLI, the nightly conductor or TensorFlow;
    # serving_state is how --promote moves models.config and champion.json with the alias.
    code = (
        "import sys; import recsys.ab, recsys.ab.workflow, recsys.ab.planning, recsys.ab.chart; "
        "ours = ('recsys', 'conductor', 'tensorflow'); "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(ours))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parent.parent,
    ).stdout.split()  # fmt: skip
    allowed = ("recsys.ab", "recsys.core", "recsys.tracking", "recsys.serving_state")
    outside = [m for m in out if m != "recsys" and not m.startswith(allowed)]
    assert outside == [], outside


@pytest.mark.parametrize(
    ("option", "value"),
    [("--power", "1"), ("--alpha", "0"), ("--alpha", "1"), ("--effect", "nan"),
     ("--effect", "1e308"), ("--effect", "0"), ("--share", "1")],
)  # fmt: skip
def test_plan_arguments_out_of_bounds_are_one_line_exit_2(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conductor import cli

    frame = sim.event_log(np.random.default_rng(0), users=300, days=3, experiment="exp")
    path = tmp_path / "traffic.csv"
    frame.drop(columns=["variant"]).to_csv(path, index=False)
    args = ["ab", "plan", "--events", str(path), "--workdir", str(tmp_path), option, value]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("recsys: error:")]
    assert f"{option} {float(value)!r} must be between" in line
