"""The classic baseline of every night: implicit ALS, chosen on validation, scored like the model.

Implicit ALS (Hu, Koren and Volinsky 2008; the `implicit` library: confidence 1 + alpha x,
conjugate-gradient solves) on the binary user x item matrix of the per-user sequence records
(`recsys.data_io.load_sequences`, the records the model's evaluation reads):

1. each setting of the grid (`evaluation.classic_baseline`) is fitted on the train positions
   and scored on the validation positions by the exact evaluator, each example's train items
   excluded (the model's per-epoch validation, same `evaluation.sample_users` sample); no
   test position is read before the choice is made;
2. the best setting on the chosen metric is fitted again on train + validation positions and
   scored on the test `EvalSet` the model was scored on, so per-user values pair up.

`max_seconds` bounds the search: a setting starts only while the time spent so far plus one
more fit and the final refit (each estimated as the slowest fit so far) stays within it; the
first setting always runs. What was tried, and whether the budget cut the grid, is returned.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from implicit.cpu.als import AlternatingLeastSquares
from scipy import sparse
from threadpoolctl import threadpool_limits

from recsys import evaluation as ev
from recsys.core import schema
from recsys.core.config import ClassicBaselineConfig, EvaluationConfig
from recsys.core.progress import bar
from recsys.data_io import Sequences, load_sequences, sparse_interactions, vocabulary_lookup

log = logging.getLogger(__name__)

SEED = 0
"""implicit's random_state: the factors' initialisation (the fit is otherwise deterministic)."""


@dataclass(frozen=True)
class AlsSetting:
    """One point of the grid."""

    factors: int
    regularization: float
    alpha: float

    def __str__(self) -> str:
        reg, alpha = f"{self.regularization:g}", f"{self.alpha:g}"
        return f"factors {self.factors}, regularization {reg}, alpha {alpha}"


@dataclass(frozen=True)
class AlsTrial:
    """One setting fitted on the train positions and scored on the validation positions."""

    setting: AlsSetting
    validation: float  # the metric's mean over the validation examples (nan: none)
    seconds: float  # fit and validation scoring


@dataclass
class AlsChoice:
    """The grid search on validation: every trial, the best, and whether time ran out."""

    metric: str
    trials: list[AlsTrial]
    grid_size: int
    budget_exhausted: bool
    seconds: float

    @property
    def best(self) -> AlsTrial:
        """The trial with the highest validation score (the first on ties or without scores)."""
        scored = [t for t in self.trials if math.isfinite(t.validation)]
        return max(scored, key=lambda t: t.validation) if scored else self.trials[0]


@dataclass
class AlsBaseline:
    """The chosen ALS refitted on train + validation and scored on the model's test EvalSet."""

    choice: AlsChoice
    test: ev.EvalResult
    refit_seconds: float
    seconds: float  # everything: reading the sequences, the search, the refit, the test score
    iterations: int
    notes: list[str] = field(default_factory=list)


def grid(config: ClassicBaselineConfig) -> list[AlsSetting]:
    """The settings tried, in order (factors slowest, then regularization, then alpha)."""
    return [
        AlsSetting(f, r, a)
        for f, r, a in itertools.product(config.factors, config.regularization, config.alpha)
    ]


def interactions(sequences: Sequences, num_items: int, max_split: str) -> sparse.csr_matrix:
    """The binary float32 users x items CSR matrix of the positions in splits up to
    `max_split` (train; or train and validation), rows in the sequences' user order;
    `sequences.items` are catalog indices (below 0: not in the catalog, left out)."""
    last = schema.SPLITS.index(max_split)
    keep = (sequences.splits <= last) & (sequences.items >= 0)
    rows = sequences.user_of_position()[keep]
    cols = sequences.items[keep].astype(np.int64)
    return sparse_interactions(rows, cols, len(sequences.users), num_items)


def fit(
    x: sparse.csr_matrix, setting: AlsSetting, iterations: int, seed: int = SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Implicit ALS user and item factors ([users, f], [items, f] float32) of matrix `x`."""
    # implicit parallelises over rows itself; a BLAS thread pool underneath oversubscribes
    # (and implicit warns about it when the model is made: made inside the limit).
    with threadpool_limits(1, "blas"):
        model = AlternatingLeastSquares(
            factors=setting.factors,
            regularization=setting.regularization,
            alpha=setting.alpha,
            iterations=iterations,
            random_state=seed,
        )
        model.fit(x, show_progress=False)
    return np.asarray(model.user_factors), np.asarray(model.item_factors)


def factor_scores(users: np.ndarray, items: np.ndarray, rows: np.ndarray) -> ev.ScoreFn:
    """Scores of the evaluation examples whose users are rows `rows` of `users`."""
    chosen = np.ascontiguousarray(users[rows], dtype=np.float32)
    items_t = np.ascontiguousarray(items.T, dtype=np.float32)

    def scores(batch: np.ndarray) -> np.ndarray:
        return chosen[batch] @ items_t

    scores.returns_fresh_arrays = True  # type: ignore[attr-defined]  # a new product each call
    return scores


def choose(
    sequences: Sequences,
    num_items: int,
    config: EvaluationConfig,
    metric: str,
    *,
    clock_start: float | None = None,
) -> AlsChoice:
    """Each grid setting fitted on the train positions and scored on the validation positions.

    Reads only the train and validation positions (a test position changes nothing here).
    `clock_start` (time.perf_counter) is where the budget began; default now.
    """
    baseline = config.classic_baseline
    start = time.perf_counter() if clock_start is None else clock_start
    settings = grid(baseline)
    examples = ev.eval_examples(sequences, "validation", 0, config.sample_users, config.sample_seed)
    validation = examples.eval_set(sequences.users, num_items)
    if not len(validation.users):
        # Nothing to choose on (a log too short for validation positions): no search.
        unscored = AlsTrial(settings[0], math.nan, 0.0)
        return AlsChoice(metric, [unscored], len(settings), False, time.perf_counter() - start)
    train = interactions(sequences, num_items, "train")
    trials: list[AlsTrial] = []
    slowest = 0.0
    fits = bar("evaluate als", len(settings), "fits")
    with fits:
        for setting in settings:
            spent = time.perf_counter() - start
            # This fit and the final refit, each as long as the slowest so far.
            if trials and spent + 2 * slowest > baseline.max_seconds:
                break
            began = time.perf_counter()
            trials.append(_trial(train, examples.rows, validation, setting, config, metric))
            slowest = max(slowest, time.perf_counter() - began)
            fits.update()
    exhausted = len(trials) < len(settings)
    if exhausted:
        log.warning(
            "evaluate: the ALS search stopped after %d of %d settings "
            "(evaluation.classic_baseline.max_seconds %s); the best so far is used",
            len(trials),
            len(settings),
            baseline.max_seconds,
        )
    return AlsChoice(metric, trials, len(settings), exhausted, time.perf_counter() - start)


def _trial(
    train: sparse.csr_matrix,
    rows: np.ndarray,
    validation: ev.EvalSet,
    setting: AlsSetting,
    config: EvaluationConfig,
    metric: str,
) -> AlsTrial:
    began = time.perf_counter()
    users, items = fit(train, setting, config.classic_baseline.iterations)
    result = ev.evaluate(factor_scores(users, items, rows), validation, config)
    score = float(result.metrics[metric])
    seconds = time.perf_counter() - began
    log.info("evaluate: ALS %s: validation %s %.4f (%.1f s)", setting, metric, score, seconds)
    return AlsTrial(setting, score, seconds)


def als_baseline(
    config: EvaluationConfig,
    data_dir: Path,
    catalog: Sequence[str],
    test: ev.EvalSet,
    metric: str,
) -> AlsBaseline:
    """ALS chosen on data_dir's validation positions and scored on `test` (the model's test
    EvalSet over `catalog`, the model's items in its order) by `metric`, a per-user metric.
    """
    start = time.perf_counter()
    if test.num_items != len(catalog):
        raise ValueError(
            f"the test EvalSet ranks {test.num_items} items but the catalog has {len(catalog)}"
        )
    sequences = load_sequences(data_dir, vocabulary_lookup(catalog))
    choice = choose(sequences, len(catalog), config, metric, clock_start=start)
    best = choice.best
    notes = []
    if not math.isfinite(best.validation):
        notes.append("no validation positions: the grid's first setting is used, unchosen")
    refit_start = time.perf_counter()
    users, items = fit(
        interactions(sequences, len(catalog), "validation"),
        best.setting,
        config.classic_baseline.iterations,
    )
    refit_seconds = time.perf_counter() - refit_start
    row_of = {user: row for row, user in enumerate(sequences.users)}
    rows = np.fromiter((row_of[u] for u in test.users), np.int64, count=len(test.users))
    result = ev.evaluate(factor_scores(users, items, rows), test, config)
    return AlsBaseline(
        choice,
        result,
        refit_seconds,
        time.perf_counter() - start,
        config.classic_baseline.iterations,
        notes,
    )
