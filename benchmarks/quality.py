"""Model quality on any interaction log, under the evaluation protocol (docs/PROTOCOL.md).

For one or more datasets (`ml-100k`, `amazon-beauty` from datasets/, the logs derived at read
time `amazon-beauty-shuffled` and `synthetic` (`benchmarks.protocol.DERIVED`), or a CSV path
with user/item/timestamp columns) the log is split by `benchmarks.protocol` (leave-last-out by
(timestamp, numeric item id)), and every model ranks the whole catalog for every test user
with the user's non-test items removed:

- popularity (training counts), EASE (lambda chosen on validation NDCG@10, refitted on
  train + validation), implicit ALS (factors/reg/alpha chosen on validation, refitted per
  seed), each fitted on the training rows only while validating;
- SASRec (`benchmarks.sasrec`, full-softmax cross-entropy at every position), lightly tuned
  on validation NDCG@10 with seed 0 (one setting changed at a time from the literature's
  per-dataset start), then refitted per seed on the sequences including the validation item
  for the epoch count validation chose; the test query is the sequence including the
  validation item;
- ours: the project's pipeline (Beam preprocess -> train -> export, `conductor.stages`) on the
  log WITHOUT the test rows, with `configs/default.yaml` (the default settings) whose data
  section alone is replaced (plus `training.seed` per seed); scored as an outside scorer
  would, from the exported users.parquet (each user's vector from their latest history in the
  log given to the pipeline) and items.parquet. Optionally the same with a tuned config (`--tuned`).

Every test score is also computed unfiltered (`test_unfiltered`: the user's known items left
in the ranking, as many published tables rank), printed as a second table.

Each (model, seed) result is written to the results JSON as soon as it exists, so a run can
be resumed (`--resume`) or split across invocations; `--table` prints the markdown tables.
Each run's per-user ranks of the scored item go to `<results>.ranks.npz` beside the JSON, so
`--paired A B` can compare two models on the same users (mean difference per metric and its
bootstrap interval over users: the users are the sample that decides small differences).
`--segments A B` splits the saved runs by history length and test item popularity
(`benchmarks.segments`), A against B in each segment.

Usage:
    .venv/bin/python benchmarks/quality.py --data ml-100k amazon-beauty --seeds 0 1 2
    .venv/bin/python benchmarks/quality.py --data ml-100k --table
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# Run as a script, the repository root (home of the benchmarks package) is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import yaml

from benchmarks import protocol, sasrec, segments
from conductor import stages
from recsys import als_baseline, baselines, tuning
from recsys import evaluation as ev
from recsys.als_baseline import AlsSetting, factor_scores
from recsys.core.config import EvaluationConfig, parse_config
from recsys.core.layout import Workdir
from serving_export.embeddings import read_embeddings

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
EVAL = EvaluationConfig()
REPORTED = stages.REPORTED_METRICS
MODELS = ("popularity", "ease", "als", "sasrec", "ours", "ours_tuned")
log = logging.getLogger("quality")


def _metrics(score_fn: ev.ScoreFn, data: ev.EvalSet) -> dict[str, float]:
    return _scored(score_fn, data)[0]


def _scored(score_fn: ev.ScoreFn, data: ev.EvalSet) -> tuple[dict[str, float], np.ndarray]:
    """The reported metrics and each user's capped rank (`RANK_CAP`: beyond it, or a miss)."""
    result = ev.evaluate(score_fn, data, EVAL)
    rank = result.per_user["rank"]
    ranks = np.where((rank < 0) | (rank > RANK_CAP), RANK_CAP, rank).astype(np.uint8)
    return {k: round(result.metrics[k], 4) for k in REPORTED}, ranks


def _test_scored(
    score_fn: ev.ScoreFn, data: ev.EvalSet
) -> tuple[dict[str, float], np.ndarray, dict[str, float]]:
    """The protocol's test metrics and ranks, and the unfiltered metrics (`unfiltered`)."""
    metrics, ranks = _scored(score_fn, data)
    return metrics, ranks, _metrics(score_fn, unfiltered(data))


def unfiltered(data: ev.EvalSet) -> ev.EvalSet:
    """`data` with every user's known items left in the ranking (nothing excluded).

    The protocol removes them (filtered ranking); many published tables rank them too, where
    a model that scores a user's own items high loses ranks to them.
    """
    return replace(data, exclude=[np.zeros(0, np.int64) for _ in data.users])


UNFILTERED = "test_unfiltered"
"""Results key of the unfiltered test metrics, beside `test` (filtered)."""
RANK_CAP = 100
"""0-based ranks are kept up to 99 (every reported metric reads no further); 100: the rest."""
RANKS_KEY = "_ranks"


class Bench:
    """One dataset's split, evaluation sets and matrices, shared by every model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log = protocol.read_log(name)
        self.split = protocol.leave_last_out(self.log)
        self.val_rows, self.val_set = protocol.eval_set(self.split, "validation")
        self.test_rows, self.test_set = protocol.eval_set(self.split, "test")
        n_users, n_items = len(self.split.users), len(self.split.catalog)
        all_users = list(range(n_users))
        self.train_x = baselines.sparse_interactions(
            *protocol.interactions(self.split, all_users, False), n_users, n_items
        )
        self.trainval_x = baselines.sparse_interactions(
            *protocol.interactions(self.split, all_users, True), n_users, n_items
        )

    def summary(self) -> dict[str, Any]:
        """Sizes of the split, for the results file."""
        last_second_ties = _users_with_last_second_ties(self.log)
        return {
            "source": self.log.source,
            "rows": len(self.log.users),
            "users": len(self.split.users),
            "catalog": len(self.split.catalog),
            "validation_users": len(self.val_rows),
            "test_users": len(self.test_rows),
            "test_items_outside_catalog": int((self.test_set.targets < 0).sum()),
            "tie_order": "numeric item id" if self.split.numeric else "string item id",
            "users_with_last_second_ties": last_second_ties,
        }

    def sequences(self, rows: list[int], with_validation: bool) -> list[np.ndarray]:
        """The users' catalog-index sequences in protocol order."""
        return [self.split.sequence(u, with_validation) for u in rows]


def _users_with_last_second_ties(log: protocol.Log) -> int:
    """Users whose last two events share a timestamp: the tie order picks their test item."""
    order = protocol.protocol_order(log)
    users, stamps = log.users[order], log.timestamps[order]
    last = np.r_[users[1:] != users[:-1], True]
    same_as_before = np.r_[False, (users[1:] == users[:-1]) & (stamps[1:] == stamps[:-1])]
    return int((last & same_as_before).sum())


# --- baselines -------------------------------------------------------------------------------


def run_popularity(b: Bench, seed: int) -> dict[str, Any]:
    """Training (+ validation) interaction counts as every user's scores."""
    val = _metrics(ev.popularity_scores(_counts(b.train_x)), b.val_set)
    test, ranks, raw = _test_scored(ev.popularity_scores(_counts(b.trainval_x)), b.test_set)
    return {"validation": val, "test": test, UNFILTERED: raw, RANKS_KEY: ranks}


def _counts(x: Any) -> np.ndarray:
    return np.asarray(x.sum(axis=0)).ravel()


def ease_grid(num_items: int) -> tuple[float, ...]:
    """Lambdas tried; large catalogs get fewer (one dense items x items inverse each)."""
    small = (25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0)
    return small if num_items <= 5000 else (12.5, 50.0, 200.0, 800.0)


def run_ease(b: Bench, seed: int) -> dict[str, Any]:
    """EASE: lambda on validation (fit on training rows), refit on train + validation."""
    tried = {}
    for l2 in ease_grid(len(b.split.catalog)):
        weights = baselines.ease_weights(b.train_x, l2)
        tried[l2] = _metrics(baselines.ease_scores(b.train_x[b.val_rows], weights), b.val_set)
        log.info("%s ease lambda %g: %s", b.name, l2, tried[l2])
    best = max(tried, key=lambda k: tried[k]["ndcg_at_10"])
    weights = baselines.ease_weights(b.trainval_x, best)
    scores = baselines.ease_scores(b.trainval_x[b.test_rows], weights)
    test, ranks, raw = _test_scored(scores, b.test_set)
    return {
        "lambda": best,
        "validation": tried[best],
        "grid": tried,
        "test": test,
        UNFILTERED: raw,
        RANKS_KEY: ranks,
    }


def als_grid(num_items: int) -> list[tuple[int, float, float]]:
    """(factors, reg, alpha) tried: each fit takes seconds with the `implicit` library."""
    return [
        (f, r, a)
        for f in (64, 128, 256)
        for r in (0.1, 1.0, 10.0, 30.0, 100.0)
        for a in (0.3, 1.0, 5.0, 20.0, 50.0)
    ]


_ALS_CHOICE: dict[str, tuple[tuple[int, float, float], dict[str, Any]]] = {}


def als_fit(x: Any, factors: int, reg: float, alpha: float, seed: int) -> tuple:
    """Implicit ALS factors of `x`, 15 iterations: the nightly's own fit (`recsys.als_baseline`)."""
    return als_baseline.fit(x.tocsr().astype(np.float32), AlsSetting(factors, reg, alpha), 15, seed)


def run_als(b: Bench, seed: int) -> dict[str, Any]:
    """Implicit ALS: settings on validation (seed 0), then a train+validation fit per seed."""
    if b.name not in _ALS_CHOICE:
        tried = {}
        for f, r, a in als_grid(len(b.split.catalog)):
            users, items = als_fit(b.train_x, f, r, a, seed=0)
            tried[(f, r, a)] = _metrics(factor_scores(users, items, b.val_rows), b.val_set)
            log.info("%s als %s: %s", b.name, (f, r, a), tried[(f, r, a)])
        best = max(tried, key=lambda k: tried[k]["ndcg_at_10"])
        _ALS_CHOICE[b.name] = (best, {str(k): v for k, v in tried.items()})
    (f, r, a), grid = _ALS_CHOICE[b.name]
    users, items = als_fit(b.trainval_x, f, r, a, seed=seed)
    test, ranks, raw = _test_scored(factor_scores(users, items, b.test_rows), b.test_set)
    return {
        "factors": f, "reg": r, "alpha": a, "validation": grid[str((f, r, a))],
        "grid": grid, "test": test, UNFILTERED: raw, RANKS_KEY: ranks,
    }  # fmt: skip


# --- SASRec ----------------------------------------------------------------------------------


def sasrec_start(b: Bench, max_epochs: int, length_batches: bool = False) -> sasrec.Settings:
    """The literature's per-dataset start (Kang and McAuley: L=200 dense, L=50 sparse)."""
    lengths = [len(s) for s in b.split.train]
    dense = float(np.mean(lengths)) >= 50
    return sasrec.Settings(
        hidden=64, blocks=2, dropout=0.2 if dense else 0.5, max_length=200 if dense else 50,
        learning_rate=1e-3, batch_size=128, max_epochs=max_epochs, length_batches=length_batches,
    )  # fmt: skip


def sasrec_candidates(start: sasrec.Settings) -> list[sasrec.Settings]:
    """The start, then one setting changed at a time (a light coordinate search).

    A change the start already has (e.g. length batches under `--sasrec-length-batches`) is
    dropped, so every candidate, and every one of `--sasrec-trials`, is a distinct fit.
    """

    other_dropout = 0.5 if start.dropout < 0.5 else 0.2
    other_length = 50 if start.max_length > 50 else 200
    changed = [
        replace(start, learning_rate=3e-3),
        replace(start, dropout=other_dropout),
        replace(start, hidden=128),
        replace(start, blocks=1),
        replace(start, max_length=other_length),
        replace(start, length_batches=True),
    ]
    return list(dict.fromkeys([start, *changed]))


def best_sasrec_label(tuning: dict[str, Any]) -> str:
    """The label of the tuning fit with the best validation NDCG@10 (the chosen settings)."""
    return max(tuning, key=lambda k: tuning[k]["validation_ndcg_at_10"])


def _best_sasrec(tuning: dict[str, Any], max_epochs: int) -> sasrec.Settings:
    """The best tuning fit's settings (a new round's start)."""
    best = tuning[best_sasrec_label(tuning)]
    return replace(sasrec.Settings(**best["settings"]), max_epochs=max_epochs, seed=0)


def tune_sasrec(b: Bench, results: dict[str, Any], args: Any) -> dict[str, Any]:
    """SASRec's tuning fits (seed 0, stored under sasrec_tuning) not already in `results`.

    Every tuning fit records its validation NDCG@10, the epoch early stopping kept and the
    test metrics of that fit (`test_without_refit`), also when the candidates ran in separate
    processes (`--sasrec-candidates`, merged by `--merge`).
    """

    tuning = results.setdefault("sasrec_tuning", {})
    first = sasrec_start(b, args.sasrec_max_epochs, args.sasrec_length_batches)
    if args.sasrec_from_best and tuning:
        first = _best_sasrec(tuning, args.sasrec_max_epochs)
    candidates = sasrec_candidates(first)
    chosen = args.sasrec_candidates or range(args.sasrec_trials)
    todo = [candidates[i] for i in chosen if i < len(candidates)]
    todo = [s for s in todo if s.label() not in tuning]
    if not todo:  # e.g. a refit process whose candidates are all in --out already
        return tuning
    validation = (b.sequences(b.val_rows, False), b.val_set)
    train = b.sequences(list(range(len(b.split.users))), False)
    test_queries = b.sequences(b.test_rows, True)
    n = len(b.split.catalog)
    for s in todo:
        trainer, info = sasrec.fit(n, train, validation, s)
        info["test_without_refit"] = _metrics(trainer.scores(test_queries), b.test_set)
        tuning[s.label()] = info
        log.info("%s sasrec %s: %s", b.name, s.label(), info["validation_ndcg_at_10"])
        _save(args, results)
    return tuning


def run_sasrec(b: Bench, seed: int, results: dict[str, Any], args: Any) -> dict[str, Any]:
    """Tuning (`tune_sasrec`), then a refit of the chosen settings with `seed`.

    The settings are chosen by validation NDCG@10 only, then refitted per seed on the
    sequences including the validation item for the kept epoch count, like EASE, ALS and
    ours, and that refit is scored on the test item.
    """

    tuning = tune_sasrec(b, results, args)
    test_queries = b.sequences(b.test_rows, True)
    n = len(b.split.catalog)
    label = best_sasrec_label(tuning)
    chosen = tuning[label]
    settings = replace(sasrec.Settings(**chosen["settings"]), seed=seed)
    start = time.perf_counter()
    trainer = sasrec.refit(n, b.sequences(list(range(len(b.split.users))), True), settings,
                           chosen["best_epoch"])  # fmt: skip
    test, ranks, raw = _test_scored(trainer.scores(test_queries), b.test_set)
    return {
        "label": label, "settings": asdict(settings), "best_epoch": chosen["best_epoch"],
        "refit_seconds": round(time.perf_counter() - start, 1),
        "validation": {"ndcg_at_10": chosen["validation_ndcg_at_10"]},
        "test_without_refit": chosen.get("test_without_refit", chosen.get("test")),
        "test": test, UNFILTERED: raw, RANKS_KEY: ranks,
    }  # fmt: skip


# --- ours: the project's pipeline, scored from its exported Parquet --------------------------


def pipeline_config(b: Bench, base: Path, log_csv: Path, seed: int) -> dict[str, Any]:
    """`base` with its data section replaced by the benchmark's log (and the seed set)."""
    raw = yaml.safe_load(base.read_text()) or {}
    data: dict[str, Any] = {"source": "csv", "path": str(log_csv)}
    item_file = Path(b.log.source).parent / "u.item"
    if Path(b.log.source).name == "u.data" and item_file.is_file():
        data["items"] = {"path": str(item_file), "format": "movielens-100k"}
    raw["data"] = data
    raw.setdefault("training", {})["seed"] = seed
    return raw


def write_log_without_test(b: Bench, path: Path, stage: str = "test") -> dt.date:
    """The log minus every test row (and, to score the validation item the way the test
    item is scored, every validation row), as the CSV the pipeline reads; returns the run
    date."""
    keep = ~b.split.test_rows
    if stage == "validation":
        assert b.split.validation_rows is not None
        keep &= ~b.split.validation_rows
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp"])
        writer.writerows(
            zip(b.log.users[keep], b.log.items[keep], b.log.timestamps[keep], strict=True)
        )
    last = int(b.log.timestamps[keep].max())
    return dt.datetime.fromtimestamp(last, dt.UTC).date()


class Ours:
    """The project's stages on the log without test rows; one data folder, a run per seed."""

    def __init__(self, b: Bench, root: Path, stage: str = "test") -> None:
        self.b, self.root, self.stage = b, root, stage
        root.mkdir(parents=True, exist_ok=True)
        self.log_csv = root / "log.csv"
        self.date = write_log_without_test(b, self.log_csv, stage)
        self.scored = b.val_set if stage == "validation" else b.test_set
        self.workdir = Workdir(root / "work")
        self.data: dict[str, Path] = {}

    def run(self, base: Path, seed: int) -> dict[str, Any]:
        """Preprocess (once per config), train, export; score from the Parquet files."""
        config = parse_config(pipeline_config(self.b, base, self.log_csv, seed), str(base))
        key = config.model_copy(update={"training": config.training.model_copy(
            update={"seed": 0})}).digest()  # fmt: skip
        if key not in self.data:
            self.data[key], _ = stages.preprocess(
                config, self.workdir, self.date, output=self.root / f"data-{key}"
            )
        start, cpu = time.perf_counter(), time.process_time()
        run_dir, result = stages.train(config, self.workdir, self.date, self.data[key])
        train_seconds = time.perf_counter() - start
        # CPU seconds of every thread of the process: what the training cost, whatever else
        # the machine was doing (refit modes are compared per CPU-second).
        train_cpu = time.process_time() - cpu
        # The pipeline's own test item is the protocol's validation item (the log it was given
        # ends before the protocol's test item): its evaluate stage is ours' validation score.
        # With --stage validation the log also lacks the validation rows, and the validation
        # item is scored from the Parquet files like the test item (the evaluate stage's item
        # is then the one before it).
        _, report = stages.evaluate(config, self.workdir, self.date, run_dir.name)
        exported = stages.export(config, self.workdir, self.date, run_dir.name, verify=False)
        scores, missing = self.parquet_scores(exported.embeddings)
        evaluated = {k: round(report.model[k], 4) for k in REPORTED}
        scored, ranks = _scored(scores, self.scored)
        raw = (
            {}
            if self.stage == "validation"
            else {UNFILTERED: _metrics(scores, unfiltered(self.scored))}
        )
        return {
            "config": str(base.relative_to(REPO) if base.is_relative_to(REPO) else base),
            "seed": seed,
            "examples_per_second": round(result.steady_examples_per_second),
            "seconds_per_epoch": round(float(np.median(result.epoch_seconds)), 2),
            "train_seconds": round(train_seconds, 1),
            "train_cpu_seconds": round(train_cpu, 1),
            "epochs_run": len(result.epoch_seconds),
            "best_epoch": result.best_epoch,
            "refit_epochs": result.refit_epochs,
            # training.candidates: each first fit's settings and validation score, and the kept.
            "candidates": result.candidates,
            "chosen_candidate": result.chosen_candidate,
            **(
                {"pipeline_evaluate": evaluated, "validation": scored}
                if self.stage == "validation"
                else {"validation": evaluated, "test": scored}
            ),
            **raw,
            "export_version": exported.version,
            "scored_users_missing_from_users_parquet": missing["users"],
            "catalog_items_missing_from_items_parquet": missing["items"],
            RANKS_KEY: ranks,
        }

    def tune(self, base: Path, trials: int, keep: Path) -> tuple[Path, dict[str, Any]]:
        """`recsys tune`'s library call on this log (its validation split; test rows absent).

        Returns the tuned config to train with and a summary; `keep` gets the winner as a
        config with `base`'s own data section (the tuned settings, reusable elsewhere).
        """
        raw = pipeline_config(self.b, base, self.log_csv, seed=0)
        config = parse_config(raw, str(base))
        prepared = tuning.preprocess_config(config)
        data_dir, _ = stages.preprocess(
            prepared, self.workdir, self.date, output=self.root / "tune-data"
        )
        tuned = self.root / "tuned.yaml"
        result = tuning.tune(
            config, data_dir, tuned, workdir=self.workdir.root, trials=trials, base_yaml=raw
        )
        original = yaml.safe_load(base.read_text()) or {}
        tuning.write_config(
            parse_config(original, str(base)), result.best_params, keep, original,
            f"recsys tune on {self.b.name} without its test rows ({sum(result.states.values())} "
            f"of {trials} trials ran, validation {config.tune.metric} {result.best_value:.4f}); "
            f"every other setting and the data section from {base}",
        )  # fmt: skip
        summary = {
            "trials": trials, "states": result.states, "best_params": result.best_params,
            f"validation_{config.tune.metric}": round(result.best_value, 4),
            "seconds": round(result.seconds), "config": str(keep.relative_to(REPO)),
        }  # fmt: skip
        return tuned, summary

    def parquet_scores(self, files: dict[str, Path]) -> tuple[ev.ScoreFn, dict[str, int]]:
        """Scored users' vectors (test, or validation) from users.parquet against items.parquet.

        A catalog item the export lacks (seen only in rows the pipeline held out) gets -inf:
        it cannot be retrieved. A scored user the export lacks would score zeros (counted).
        """
        user_ids, user_vectors, _ = read_embeddings(files["users"])
        item_ids, item_vectors, _ = read_embeddings(files["items"])
        user_row = {u: i for i, u in enumerate(user_ids)}
        item_row = {i: r for r, i in enumerate(item_ids)}
        dim = item_vectors.shape[1]
        queries = np.zeros((len(self.scored.users), dim), np.float32)
        missing_users = 0
        for r, u in enumerate(self.scored.users):
            if u in user_row:
                queries[r] = user_vectors[user_row[u]]
            else:
                missing_users += 1
        cols = np.array([item_row.get(i, -1) for i in self.b.split.catalog])
        items = item_vectors[np.maximum(cols, 0)]
        absent = cols < 0
        base = ev.dot_product_scores(queries, items)

        def scores(rows: np.ndarray) -> np.ndarray:
            out = base(rows)
            out[:, absent] = -np.inf
            return out

        scores.returns_fresh_arrays = True  # type: ignore[attr-defined]
        return scores, {"users": missing_users, "items": int(absent.sum())}


# --- driver ----------------------------------------------------------------------------------


def _save(args: Any, results: dict[str, Any], ranks: dict[str, np.ndarray] | None = None) -> None:
    path = Path(args.current_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(path)
    if ranks:
        save_ranks(ranks_path(path), ranks)


def ranks_path(results: Path) -> Path:
    """The results file's per-user ranks: `<stem>.ranks.npz` beside it."""
    return results.with_name(f"{results.stem}.ranks.npz")


def save_ranks(path: Path, ranks: dict[str, np.ndarray]) -> None:
    """Each run's per-user capped ranks (key "model/seedN"; users in the protocol's order)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        np.savez_compressed(f, **{k.replace("/", "__"): v for k, v in ranks.items()})
    tmp.replace(path)


def load_ranks(path: Path) -> dict[str, np.ndarray]:
    """What `save_ranks` wrote; empty if there is no such file (older results)."""
    if not path.is_file():
        return {}
    with np.load(path, allow_pickle=False) as data:
        return {k.replace("__", "/"): data[k] for k in data.files}


def out_path(name: str, out: str | None) -> Path:
    """benchmarks/results/quality_<dataset>.json unless given."""
    if out:
        return Path(out)
    stem = Path(name).stem if name not in protocol.NAMED else name
    return RESULTS / f"quality_{stem.replace('-', '_')}.json"


def run_dataset(name: str, args: Any) -> dict[str, Any]:
    """Every requested model and seed on one dataset; results saved as they come."""
    args.current_out = out_path(name, args.out if len(args.data) == 1 else None)
    results: dict[str, Any] = {}
    if args.resume and Path(args.current_out).is_file():
        results = json.loads(Path(args.current_out).read_text())
    b = Bench(name)
    results["dataset"] = name
    results["protocol"] = (
        "leave-last-out per user by (timestamp, item id), users with >= 5 events; test item "
        "ranked against the whole catalog (items of non-test rows) with the user's non-test "
        "items removed; validation item (training items removed) for every choice"
    )
    results["data"] = b.summary()
    results["command"] = "python benchmarks/quality.py " + " ".join(sys.argv[1:])
    runs = results.setdefault("runs", {})
    ranks = load_ranks(ranks_path(Path(args.current_out))) if args.resume else {}
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        ours: Ours | None = None
        tuned: Path | None = None
        for model in args.models:
            for seed in args.seeds:
                key = f"{model}/seed{seed}"
                if key in runs:
                    continue
                if model in ("popularity", "ease") and seed != args.seeds[0]:
                    continue  # deterministic: one fit is every seed's result
                if model == "ours_tuned" and not (args.tuned or args.tune_trials):
                    continue
                log.info("%s: %s", name, key)
                start = time.perf_counter()
                try:
                    if model in ("ours", "ours_tuned"):
                        ours = ours or Ours(b, Path(tmp), args.stage)
                        base = Path(args.config)
                        if model == "ours_tuned" and args.tuned:
                            base = Path(args.tuned)
                        elif model == "ours_tuned":
                            if tuned is None:
                                keep = RESULTS / f"tuned_{out_path(name, None).stem[8:]}.yaml"
                                tuned, results["tune"] = ours.tune(
                                    Path(args.config), args.tune_trials, keep
                                )
                                _save(args, results)
                            base = tuned
                        out = ours.run(base, seed)
                    elif model == "sasrec" and args.sasrec_tune_only:
                        tune_sasrec(b, results, args)
                        break  # the tuning fits are seed 0's; no refit, no run recorded
                    elif model == "sasrec":
                        out = run_sasrec(b, seed, results, args)
                    else:
                        runner: Callable[[Bench, int], dict[str, Any]] = globals()[f"run_{model}"]
                        out = runner(b, seed)
                except Exception as exc:  # one failed model must not cost the others' results
                    log.exception("%s %s failed", name, key)
                    results.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
                    _save(args, results)
                    continue
                out["wall_seconds"] = round(time.perf_counter() - start, 1)
                out["load_average_1min"] = round(os.getloadavg()[0], 1)
                ranks[key] = out.pop(RANKS_KEY)
                runs[key] = out
                results.get("errors", {}).pop(key, None)
                log.info("%s %s %s %s", name, key, args.stage, out.get(args.stage))
                _save(args, results, ranks)
    results["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    _save(args, results, ranks)
    return results


def merge_ranks(paths: list[Path], merged: dict[str, Any]) -> dict[str, np.ndarray]:
    """The per-user ranks of the merged runs, each from the file its run was taken from."""
    ranks: dict[str, np.ndarray] = {}
    for path in paths:
        for key, value in load_ranks(ranks_path(path)).items():
            ranks.setdefault(key, value)
    return {k: v for k, v in ranks.items() if k in merged["runs"]}


def paired(ranks: dict[str, np.ndarray], a: str, b: str, resamples: int = 10_000) -> str:
    """Model `a` against `b` on the same users: each metric's mean difference, 95% CI.

    Each user's value is averaged over the model's seeds first; the interval is a percentile
    bootstrap over users (seeded), so it measures how much the users sampled decide.
    """
    values = {m: _per_user(ranks, m) for m in (a, b)}
    rng = np.random.default_rng(0)
    users = len(next(iter(values[a].values())))
    picks = rng.integers(0, users, size=(resamples, users))
    lines = [f"| metric | {a} | {b} | {a} - {b} (95% CI over users) | relative |",
             "|---|---:|---:|---|---:|"]  # fmt: skip
    for metric in ("recall_at_10", "ndcg_at_10", "recall_at_50", "mrr_at_100"):
        mean, low, high = segments.difference_interval(values[a][metric] - values[b][metric], picks)
        base = values[b][metric].mean()
        lines.append(
            f"| {metric} | {values[a][metric].mean():.4f} | {base:.4f} | {mean:+.4f} "
            f"({low:+.4f}, {high:+.4f}) | {mean / base:+.1%} ({low / base:+.1%}, "
            f"{high / base:+.1%}) |"
        )
    return "\n".join(lines)


def _per_user(ranks: dict[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
    seeds = [v for k, v in sorted(ranks.items()) if k.split("/")[0] == model]
    if not seeds:
        raise SystemExit(f"no per-user ranks of {model!r} in the results (rerun it)")
    per_seed = [
        ev.per_user_values(np.where(r >= RANK_CAP, np.inf, r.astype(np.float64)), EVAL)
        for r in seeds
    ]
    return {m: np.mean([p[m] for p in per_seed], axis=0) for m in per_seed[0] if m != "rank"}


def segment_tables(name: str, ranks: dict[str, np.ndarray], model: str, reference: str) -> str:
    """Markdown: the saved runs by history length and by test item popularity (segments.py)."""
    split = protocol.leave_last_out(protocol.read_log(name))
    models = [m for m in MODELS if any(k.split("/")[0] == m for k in ranks)]
    per_user = {m: _per_user(ranks, m) for m in models}
    users = len(next(iter(per_user.values()))["ndcg_at_10"])
    if users != len(split.test):
        raise SystemExit(f"{name}: the ranks hold {users} users, the split {len(split.test)}")
    tables = []
    for kind, (band, labels) in segments.segments_of_test_users(split).items():
        table_md = segments.segment_table(per_user, band, labels, model, reference)
        tables.append(f"By {kind}:\n\n{table_md}")
    return "\n\n".join(tables)


def merge(paths: list[Path]) -> dict[str, Any]:
    """One dataset's results from several processes' JSON files (first file's header).

    SASRec's settings are re-chosen among all candidates by validation NDCG@10, and SASRec
    runs (refits) are kept only when they used the chosen settings.
    """
    parts = [json.loads(p.read_text()) for p in paths]
    merged = {k: v for k, v in parts[0].items() if k not in ("runs", "errors")}
    merged["runs"], merged["errors"], merged["merged_from"] = {}, {}, [str(p) for p in paths]
    merged["commands"] = sorted({p["command"] for p in parts if "command" in p})
    tuning: dict[str, Any] = {}
    for part in parts:
        for key, run in part.get("runs", {}).items():
            merged["runs"].setdefault(key, run)
        merged["errors"].update(part.get("errors", {}))
        tuning.update(part.get("sasrec_tuning", {}))
        if "tune" in part:
            merged["tune"] = part["tune"]
    merged["errors"] = {k: v for k, v in merged["errors"].items() if k not in merged["runs"]}
    if tuning:
        merged["sasrec_tuning"] = tuning
        best = best_sasrec_label(tuning)
        runs = merged["runs"]
        for key in [k for k in runs if k.startswith("sasrec/") and runs[k]["label"] != best]:
            del runs[key]
    return merged


def table(results: dict[str, Any], stage: str = "test") -> str:
    """Markdown: mean (and spread over seeds) of every reported metric per model.

    `stage` validation tabulates the runs' validation metrics (a model lacking one is left
    out): for ours, the validation item scored from the Parquet files (`--stage validation`).
    """
    names = {
        "popularity": "popularity", "ease": "EASE", "als": "implicit ALS",
        "sasrec": "SASRec (full-softmax CE)", "ours": "ours, default config",
        "ours_tuned": "ours, tuned config",
    }  # fmt: skip
    header = "| model | seeds | " + " | ".join(REPORTED) + " |"
    lines = [header, "|---|---:|" + "---:|" * len(REPORTED)]
    runs = results.get("runs", {})
    for model, label in names.items():
        per_seed = [
            v
            for k, v in runs.items()
            if k.split("/")[0] == model and set(REPORTED) <= set(v.get(stage, {}))
        ]
        if not per_seed:
            continue
        cells = []
        for metric in REPORTED:
            values = [r[stage][metric] for r in per_seed]
            mean = statistics.fmean(values)
            spread = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
            cells.append(f"{mean:.4f}{spread}")
        lines.append(f"| {label} | {len(per_seed)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    """Parse the arguments and run (or tabulate) each dataset."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        nargs="+",
        default=["ml-100k"],
        help="ml-100k, amazon-beauty, amazon-beauty-shuffled, synthetic, or a path",
    )
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS[:-1]), choices=MODELS, help="in this order"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--config", default=str(REPO / "configs" / "default.yaml"))
    parser.add_argument(
        "--tuned", help="a tuned config for ours_tuned (its data section is replaced)"
    )
    parser.add_argument(
        "--tune-trials", type=int, default=0,
        help="ours_tuned without --tuned: run recsys tune's search (N trials) on the log first",
    )  # fmt: skip
    parser.add_argument(
        "--sasrec-trials", type=int, default=6,
        help="SASRec settings tried (<= 7; 6 with --sasrec-length-batches)",
    )  # fmt: skip
    parser.add_argument("--sasrec-max-epochs", type=int, default=200)
    parser.add_argument(
        "--sasrec-length-batches", action="store_true",
        help="all SASRec candidates batch users by length (less padding: cheaper on sparse logs)",
    )  # fmt: skip
    parser.add_argument(
        "--sasrec-candidates", nargs="+", type=int,
        help="indices of the SASRec settings to try in this process (default: the first N)",
    )  # fmt: skip
    parser.add_argument(
        "--sasrec-from-best", action="store_true",
        help="a second coordinate round: the candidates change one setting of the best "
        "tuning fit already in --out (with --resume) instead of the literature's start",
    )  # fmt: skip
    parser.add_argument(
        "--sasrec-tune-only", action="store_true",
        help="only SASRec's tuning fits (saved under sasrec_tuning); refit later with --resume",
    )  # fmt: skip
    parser.add_argument(
        "--stage", choices=("test", "validation"), default="test",
        help="validation: ours' pipeline gets the log without its validation and test rows and "
        "is scored on the validation item, exactly as on the test item (to choose settings)",
    )  # fmt: skip
    parser.add_argument("--out", help="results JSON (one dataset only)")
    parser.add_argument("--resume", action="store_true", help="keep results already in the JSON")
    parser.add_argument("--table", action="store_true", help="print the tables of saved results")
    parser.add_argument(
        "--paired", nargs=2, metavar=("A", "B"),
        help="saved results: model A against model B on the same test users (bootstrap CI)",
    )  # fmt: skip
    parser.add_argument(
        "--segments", nargs=2, metavar=("A", "B"),
        help="saved results: every model by history length and by test item popularity, "
        "model A against model B per segment (benchmarks/segments.py)",
    )  # fmt: skip
    parser.add_argument(
        "--merge", nargs="+", help="merge these results files of one dataset into --out"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("apache_beam", "absl", "tensorflow", "recsys", "beam_jobs", "serving_export"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.merge:
        paths = [Path(p) for p in args.merge]
        merged = merge(paths)
        args.current_out = out_path(args.data[0], args.out)
        _save(args, merged, merge_ranks(paths, merged))
        print(table(merged, args.stage))
        return 0
    for name in args.data:
        if args.table or args.paired or args.segments:
            results = json.loads(out_path(name, args.out).read_text())
        else:
            results = run_dataset(name, args)
        print(f"\n{name}: {results['data']}\n{results.get('command', '')}\n")
        print(table(results, args.stage))
        if args.stage == "test" and any(UNFILTERED in r for r in results.get("runs", {}).values()):
            print("\nunfiltered (each user's known items left in the ranking):\n")
            print(table(results, UNFILTERED))
        if args.paired:
            ranks = load_ranks(ranks_path(out_path(name, args.out)))
            print("\n" + paired(ranks, *args.paired))
        if args.segments:
            print("\n" + segment_tables(name, load_ranks(ranks_path(out_path(name, args.out))),
                                         *args.segments))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
