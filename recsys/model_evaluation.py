"""A saved model scored on a data folder's test split: the one scoring path of every report.

`recsys evaluate` (conductor.stages) and the champion/challenger gate (conductor.promotion)
both call `evaluate_model`, so a champion re-evaluated on today's data is scored exactly as the
challenger.
"""

from __future__ import annotations

from pathlib import Path

from recsys import evaluation as ev
from recsys.core.config import RecsysConfig
from recsys.data_io import load_split
from recsys.model import TrainedModel


def evaluate_model(
    config: RecsysConfig, model_dir: Path, data_dir: Path
) -> tuple[ev.EvalSet, ev.EvalResult]:
    """A saved model on data_dir's test split: (EvalSet, EvalResult), exact over the catalog."""
    model = TrainedModel.load(model_dir)
    test = load_split(data_dir, "test")
    eval_set = ev.build_eval_set(
        model.items, test, [load_split(data_dir, "train"), load_split(data_dir, "validation")]
    )
    # Each test example carries the user's history before the test item (empty if the data
    # has none): the query the model would have seen at that moment.
    histories = list(test["history"]) if "history" in test else None
    scores = ev.dot_product_scores(
        model.user_embeddings(eval_set.users, histories), model.item_embeddings()
    )
    return eval_set, ev.evaluate(scores, eval_set, config.evaluation)
