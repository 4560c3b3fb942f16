"""Proof by simulation of the A/B statistics (recsys.ab.stats) on experiments with a known effect.

    .venv/bin/python benchmarks/ab_simulation.py [--experiments 400] [--users 4000] [--seed 0]

Prints a Markdown table (docs/BENCHMARKS.md) and writes benchmarks/results/ab_simulation.json:
1. coverage of the 95% fixed-horizon and always-valid intervals (true CTR lift 5%);
2. A/A false-positive rate of the fixed-horizon test at the end;
3. daily peeking over 14 days: P(any day "significant") for the fixed-horizon z-test read every
   day vs the always-valid test (mSPRT confidence sequence), and both tests' power at a 10% lift;
4. CUPED: median interval width with / without the pre-period covariate;
5. SRM: how often the chi-square check fires at 50/50 and at an injected 52/48 split.
Every experiment is simulated with numpy and analysed by the same vectorised code the CLI runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from recsys.ab import simulate as sim
from recsys.ab import stats

CTR = stats.MetricColumns(0, 1)
CTR_CUPED = stats.MetricColumns(0, 1, 2, 3)
CLICKS = stats.MetricColumns(0)
CLICKS_CUPED = stats.MetricColumns(0, None, 2)


def _effects(s: sim.Simulated, spec: stats.MetricColumns) -> stats.Effect:
    cols = [0, 1, 2, 3]
    return stats.effect(
        stats.arms(
            sim.moments_by_day(s.control, s.control_in, cols),
            sim.moments_by_day(s.treatment, s.treatment_in, cols),
            spec,
        )
    )


def _covers(e: stats.Effect, truth: float) -> tuple[float, float]:
    fixed = np.mean((e.ci_low[:, -1] <= truth) & (truth <= e.ci_high[:, -1]))
    seq = np.mean((e.seq_low[:, -1] <= truth) & (truth <= e.seq_high[:, -1]))
    return float(fixed), float(seq)


def coverage(rng: np.random.Generator, experiments: int, users: int) -> dict[str, object]:
    """Coverage and width of both intervals for CTR and clicks per user, with/without CUPED."""
    s = sim.simulate(rng, experiments=experiments, users=users, lift=0.05)
    out: dict[str, object] = {}
    for name, spec, truth in (
        ("ctr", CTR, s.true_ctr_diff),
        ("ctr+cuped", CTR_CUPED, s.true_ctr_diff),
        ("clicks", CLICKS, s.true_clicks_diff),
        ("clicks+cuped", CLICKS_CUPED, s.true_clicks_diff),
    ):
        e = _effects(s, spec)
        fixed, seq = _covers(e, truth)
        width = float(np.median(e.ci_high[:, -1] - e.ci_low[:, -1]))
        out[name] = {"fixed_coverage": fixed, "sequential_coverage": seq, "median_width": width}
    return out


def a_a(rng: np.random.Generator, experiments: int, users: int) -> dict[str, float]:
    """False positives of one fixed-horizon look when nothing differs."""
    s = sim.simulate(rng, experiments=experiments, users=users)
    return {
        name: float(np.mean(_effects(s, spec).p_value[:, -1] < 0.05))
        for name, spec in (("ctr", CTR), ("ctr+cuped", CTR_CUPED), ("clicks", CLICKS))
    }


def peeking(
    rng: np.random.Generator, experiments: int, users: int, days: int = 14
) -> dict[str, float]:
    """Daily looks for `days`: false positives (A/A) and power (10% lift) of both tests."""
    out = {}
    for label, lift in (("aa", 0.0), ("lift10", 0.10)):
        e = _effects(sim.simulate(rng, experiments=experiments, users=users, days=days, lift=lift),
                     CTR)  # fmt: skip
        out[f"{label}_fixed_any_day"] = float(np.mean(np.any(e.p_value < 0.05, axis=1)))
        out[f"{label}_fixed_last_day"] = float(np.mean(e.p_value[:, -1] < 0.05))
        significant = (e.seq_low > 0) | (e.seq_high < 0)
        out[f"{label}_sequential_any_day"] = float(np.mean(np.any(significant, axis=1)))
    return out


def srm(rng: np.random.Generator, experiments: int, users: int) -> dict[str, float]:
    """Share of experiments whose SRM check fires, at 50/50 and at an injected 52/48."""
    out = {}
    for label, share in (("50/50", 0.5), ("52/48", 0.52)):
        a = rng.binomial(users, share, size=experiments)
        fired = [stats.srm_p_value(np.array([n, users - n]), np.ones(2)) < stats.SRM_ALPHA
                 for n in a]  # fmt: skip
        out[label] = float(np.mean(fired))
    return out


def main() -> None:
    """Run every simulation and print the results table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", type=int, default=400)
    parser.add_argument("--users", type=int, default=4000)
    parser.add_argument("--peek-users", type=int, default=2000)
    parser.add_argument("--srm-users", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/ab_simulation.json")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    results = {
        "settings": vars(args),
        "coverage": coverage(rng, args.experiments, args.users),
        "a_a": a_a(rng, args.experiments, args.users),
        "peeking": peeking(rng, args.experiments, args.peek_users),
        "srm": srm(rng, args.experiments, args.srm_users),
    }
    results["seconds"] = time.perf_counter() - started
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    _print(results)


def _print(r: dict) -> None:  # type: ignore[type-arg]
    p, n = r["peeking"], r["settings"]["experiments"]
    rows = [
        (
            f"95% interval covers the true effect, {name}",
            f"fixed {v['fixed_coverage']:.1%}, always-valid {v['sequential_coverage']:.1%}; "
            f"median width {v['median_width']:.4g}",
        )
        for name, v in r["coverage"].items()
    ]
    rows += [(f"A/A rejections at alpha 5%, {name}", f"{v:.1%}") for name, v in r["a_a"].items()]
    rows += [
        (
            "A/A, 14 daily looks: fixed-horizon z-test significant on any day",
            f"{p['aa_fixed_any_day']:.1%} (last day only: {p['aa_fixed_last_day']:.1%})",
        ),
        (
            "A/A, 14 daily looks: always-valid test significant on any day",
            f"{p['aa_sequential_any_day']:.1%}",
        ),
        ("10% CTR lift: power, fixed-horizon on day 14", f"{p['lift10_fixed_last_day']:.1%}"),
        ("10% CTR lift: power, always-valid (any day)", f"{p['lift10_sequential_any_day']:.1%}"),
        ("SRM check fires (p < 0.001), 50/50", f"{r['srm']['50/50']:.1%}"),
        ("SRM check fires (p < 0.001), injected 52/48", f"{r['srm']['52/48']:.1%}"),
    ]
    print(f"| check ({n} simulated experiments each) | result |")
    print("|---|---|")
    for check, result in rows:
        print(f"| {check} | {result} |")
    print(f"\n{r['seconds']:.0f} s")


if __name__ == "__main__":
    main()
