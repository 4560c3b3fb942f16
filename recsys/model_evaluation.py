"""A saved model scored on a data folder's test split: the one scoring path of every report.

`recsys evaluate` (conductor.stages) and the champion/challenger gate (conductor.promotion)
both call `evaluate_model`, so a champion re-evaluated on today's data is scored exactly as the
challenger.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from recsys import evaluation as ev
from recsys.core import schema
from recsys.core.config import RecsysConfig
from recsys.data_io import concat_batches, count_rows, iter_split
from recsys.model import TrainedModel


def evaluate_model(
    config: RecsysConfig, model_dir: Path, data_dir: Path
) -> tuple[ev.EvalSet, ev.EvalResult]:
    """A saved model on data_dir's test split: (EvalSet, EvalResult), exact over the catalog.

    With `evaluation.sample_users` a seeded uniform sample of the test users (the same for
    every model scored on the same data, so comparisons stay paired) is ranked.
    """
    model = TrainedModel.load(model_dir)
    sample = config.evaluation.sample_users
    # The test split streams: with a sample only the sampled rows (and their histories) are
    # kept; without one each batch's query vectors are computed and its histories dropped,
    # in batches of the size user_embeddings uses, so the vectors are the same either way.
    population = count_rows(data_dir, "test") if sample else 0
    chosen = (
        ev.sample_indices(population, sample, config.evaluation.sample_seed) if sample else None
    )
    ids = (schema.USER_ID, schema.ITEM_ID)
    kept: list[dict[str, np.ndarray]] = []
    vectors: list[np.ndarray] = []
    for batch in ev.sampled_batches(iter_split(data_dir, "test", batch_size=_BATCH), chosen):
        if chosen is None:
            # Each test example carries the user's history before the test item (empty if
            # the data has none): the query the model would have seen at that moment.
            users = [u.decode("utf-8") for u in batch[schema.USER_ID].tolist()]
            vectors.append(model.user_embeddings(users, _histories(batch), batch_size=_BATCH))
            kept.append({name: batch[name] for name in ids})
        else:
            kept.append(batch)
    test = concat_batches(kept, ids if chosen is None else schema.FEATURE_NAMES)
    # Exclusions stream from the splits' id columns (no histories, no whole split in memory).
    known = itertools.chain(
        iter_split(data_dir, "train", ids), iter_split(data_dir, "validation", ids)
    )
    eval_set = ev.build_eval_set(model.items, test, known)
    if chosen is not None:
        eval_set.population = population
        user_vectors = model.user_embeddings(eval_set.users, _histories(test))
    elif vectors:
        user_vectors = np.concatenate(vectors)
    else:
        user_vectors = model.user_embeddings([], None)
    scores = ev.dot_product_scores(user_vectors, model.item_embeddings())
    return eval_set, ev.evaluate(scores, eval_set, config.evaluation)


_BATCH = 65536
"""Test rows read (and embedded) at a time."""


def _histories(rows: dict[str, np.ndarray]) -> list | None:
    return list(rows[schema.HISTORY]) if schema.HISTORY in rows else None
