"""`training.candidates_prune_after`, replayed on the validation curves of unpruned runs.

`benchmarks/quality.py` with a config whose candidates all train in full (pruning 0, refit
off) records each candidate's validation curve (`candidates[].curve` of every `ours/seed<N>`
run). This script replays the nightly's pruning rule (`recsys.training.candidates`:
`pruning_bar` and `trails`, the functions the trainer runs) on those curves for each value of
`--after`, and reports per run whether the kept candidate changes and what share of the
candidates' first-fit epochs and seconds the rule saves (a pruned fit's seconds pro rata of
its epochs). Validation data only: the choice it informs is made without the test split.

    .venv/bin/python benchmarks/candidate_pruning.py benchmarks/results/candidate_curves_*.json \\
        --after 1 2 3 4 --out benchmarks/results/candidate_pruning.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from recsys.core.records import CandidateRecord
from recsys.training.candidates import chosen, pruning_bar, trails


def replay(trials: list[CandidateRecord], after: int) -> list[CandidateRecord]:
    """The records the candidates would have had under pruning from epoch `after`."""
    kept: list[CandidateRecord] = []
    for trial in trials:
        bar = pruning_bar(kept)
        stop, best = None, math.nan
        for epoch, value in enumerate(trial.curve, start=1):
            if value is not None:
                best = value if math.isnan(best) else max(best, value)
            if trial.index and trails(best, bar, epoch, after, len(trial.curve)):
                stop = epoch
                break
        curve = trial.curve[:stop] if stop else trial.curve
        scored = [v for v in curve if v is not None]
        share = len(curve) / len(trial.curve) if trial.curve else 1.0
        kept.append(
            trial.model_copy(
                update={
                    "curve": curve,
                    "epochs": len(curve),
                    "validation": max(scored) if scored else None,
                    "seconds": trial.seconds * share,
                    "pruned_after": stop,
                }
            )
        )
    return kept


def run_rows(path: Path, afters: list[int]) -> list[dict[str, Any]]:
    """One row per run of `path` and value of `after`."""
    results = json.loads(path.read_text())
    rows = []
    for key, run in sorted(results["runs"].items()):
        if not key.startswith("ours/") or not run.get("candidates"):
            continue
        trials = [CandidateRecord(**c) for c in run["candidates"]]
        # The full run's choice from its curves (the best epoch's score), as replay scores.
        full = replay(trials, 0)
        for after in afters:
            pruned = replay(trials, after)
            rows.append(
                {
                    "data": results["dataset"],
                    "run": key,
                    "after": after,
                    "kept_full": chosen(full),
                    "kept_pruned": chosen(pruned),
                    "pruned_after": [t.pruned_after for t in pruned],
                    "epochs": [t.epochs for t in pruned],
                    "epochs_full": [t.epochs for t in full],
                    "seconds": round(sum(t.seconds for t in pruned), 1),
                    "seconds_full": round(sum(t.seconds for t in full), 1),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| data | run | after | kept (full / pruned) | epochs per candidate | first-fit seconds |",
        "|---|---|---:|---|---|---:|",
    ]
    for r in rows:
        kept = f"{r['kept_full']} / {r['kept_pruned']}"
        if r["kept_full"] != r["kept_pruned"]:
            kept += " **changed**"
        epochs = ", ".join(f"{a}/{b}" for a, b in zip(r["epochs"], r["epochs_full"], strict=True))
        share = r["seconds"] / r["seconds_full"] if r["seconds_full"] else 1.0
        lines.append(
            f"| {r['data']} | {r['run']} | {r['after']} | {kept} | {epochs} | "
            f"{r['seconds']:.0f} of {r['seconds_full']:.0f} ({share:.2f}) |"
        )
    return "\n".join(lines)


def main() -> int:
    """Replay the rule on each file and print (and optionally save) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="benchmarks/quality.py JSON files")
    parser.add_argument("--after", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    rows = [row for path in args.results for row in run_rows(path, args.after)]
    print(markdown(rows))
    if args.out:
        command = "benchmarks/candidate_pruning.py " + " ".join(map(str, args.results))
        payload = {"command": command, "after": args.after, "rows": rows}
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
