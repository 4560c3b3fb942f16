"""A saved model scored on a data folder's test split: the one scoring path of every report.

`recsys evaluate` (conductor.stages) and the champion/challenger gate (conductor.promotion)
both call `evaluate_model`, so a champion re-evaluated on today's data is scored exactly as the
challenger.
"""

from __future__ import annotations

from pathlib import Path

from recsys import evaluation as ev
from recsys.core.config import RecsysConfig
from recsys.data_io import load_sequences
from recsys.model import TrainedModel


def evaluate_model(
    config: RecsysConfig, model_dir: Path, data_dir: Path, progress: str = "evaluate"
) -> tuple[ev.EvalSet, ev.EvalResult]:
    """A saved model on data_dir's test split: (EvalSet, EvalResult), exact over the catalog.

    One example per test position of the per-user sequence records: the query is the user
    with their positions before it (the model keeps its last `history_length`), the user's
    train and validation items are excluded. With `evaluation.sample_users` a seeded uniform
    sample of the test examples (the same for every model scored on the same data, so
    comparisons stay paired) is ranked. `progress` labels the bar of users ranked (shown by
    the CLI only).
    """
    model = TrainedModel.load(model_dir)
    # Item ids become the model's indices inside tf.data: no Python string per position.
    sequences = load_sequences(data_dir, model.item_lookup())
    sample = config.evaluation
    examples = ev.eval_examples(
        sequences, "test", model.config.oov_buckets, sample.sample_users, sample.sample_seed
    )
    eval_set = examples.eval_set(sequences.users, len(model.items))
    histories = examples.histories(sequences.items, model.config.history_length)
    user_vectors = model.query_embeddings(model.user_indices(eval_set.users), histories)
    scores = ev.dot_product_scores(user_vectors, model.item_embeddings())
    return eval_set, ev.evaluate(scores, eval_set, config.evaluation, progress)
