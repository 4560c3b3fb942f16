"""Exact validation metrics each epoch, and early stopping on them (a Keras callback).

The validation users' query vectors are computed from what the fit reads: the validation
split's rows with their stored histories (`training.input: rows`), or the per-user sequence
records (`sequences`), where a validation position's history is the positions before it.
Either way every catalog item is ranked exactly (recsys.evaluation), the user's training
items removed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

from recsys import evaluation as ev
from recsys.core import schema
from recsys.core.config import EvaluationConfig, RecsysConfig
from recsys.data_io import concat_batches, count_rows, iter_split
from recsys.model import TrainedModel
from recsys.training.windows import TrainingSequences

log = logging.getLogger(__name__)

QueryVectors = Callable[[TrainedModel], np.ndarray]
"""The validation users' query vectors under a model's current weights."""


class ValidationRecall(tf.keras.callbacks.Callback):
    """Exact validation metrics each epoch (`val_<metric>` in the logs), with early stopping.

    Ranks the whole catalog for every validation user (recsys.evaluation, training items
    removed). With `patience` > 0, stops after that many epochs without improving `metric`
    and at the end puts back the best epoch's tower weights (0: metrics only, last weights).
    With a `state_dir` (in the BackupAndRestore folder) the best value, epoch, patience count
    and best weights are written there every epoch, so a killed and resumed run still keeps
    the best epoch of the whole run, not only of the epochs since the resume.
    """

    STATE = "state.json"

    def __init__(
        self,
        trained: TrainedModel,
        eval_set: ev.EvalSet,
        queries: QueryVectors,
        metric: str,
        patience: int,
        state_dir: Path | None = None,
        chief: bool = True,
    ) -> None:
        super().__init__()
        self.trained = trained
        self.eval_set = eval_set
        self.queries = queries
        self.metric = metric
        self.patience = patience
        k = int(metric.rsplit("_", 1)[1])
        self.eval_config = EvaluationConfig(ks=[k], ndcg_k=k, mrr_k=k, coverage_k=0)
        self.best = -np.inf
        self.best_epoch: int | None = None
        self.best_weights: list[list[np.ndarray]] | None = None
        self.wait = 0
        # Only early stopping needs the state; every worker reads the chief's copy.
        self.state_dir = state_dir if patience else None
        self.chief = chief
        self.best_checkpoint: str | None = None  # the resumed run's best weights, on disk

    def _towers(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(
            query=self.trained.query_tower, candidate=self.trained.candidate_tower
        )

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        if self.state_dir is None or not (self.state_dir / self.STATE).is_file():
            return
        state = json.loads((self.state_dir / self.STATE).read_text())
        self.best, self.best_epoch, self.wait = state["best"], state["best_epoch"], state["wait"]
        self.best_checkpoint = str(self.state_dir / state["weights"])
        log.info(
            "resumed early stopping: best %s=%.4f at epoch %d, %d epoch(s) without gain",
            self.metric,
            self.best,
            self.best_epoch + 1,
            self.wait,
        )

    def _save_state(self, epoch: int, improved: bool) -> None:
        """Best weights first (a new prefix per epoch), then the JSON naming them, atomically."""
        if self.state_dir is None:
            return
        target = self.state_dir if self.chief else Path(tempfile.mkdtemp(prefix="es-workertemp-"))
        target.mkdir(parents=True, exist_ok=True)
        state_file = self.state_dir / self.STATE
        previous = json.loads(state_file.read_text()) if state_file.is_file() else None
        if improved or previous is None:
            weights = f"best-{self.best_epoch}"
            self._towers().write(str(target / weights / "towers"))
        else:
            weights = previous["weights"]
        state = {
            "metric": self.metric,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "wait": self.wait,
            "epoch": epoch,
            "weights": weights,
        }
        (target / (self.STATE + ".tmp")).write_text(json.dumps(state))
        os.replace(target / (self.STATE + ".tmp"), target / self.STATE)
        if not self.chief:  # the Keras multi-worker pattern: write everything, keep nothing
            shutil.rmtree(target, ignore_errors=True)
            return
        for old in target.glob("best-*"):
            if old.name != weights:
                shutil.rmtree(old, ignore_errors=True)

    def score(self) -> float:
        """The metric of the current weights on the validation users."""
        users = self.queries(self.trained)
        scores = ev.dot_product_scores(users, self.trained.item_embeddings())
        return ev.evaluate(scores, self.eval_set, self.eval_config).metrics[self.metric]

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        value = self.score()
        if logs is not None:
            logs[f"val_{self.metric}"] = value
        if value > self.best:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            self.best_weights = [
                tower.get_weights()
                for tower in (self.trained.query_tower, self.trained.candidate_tower)
            ]
            self.best_checkpoint = None
            self._save_state(epoch, improved=True)
            return
        self.wait += 1
        self._save_state(epoch, improved=False)
        if self.patience and self.wait >= self.patience:
            log.info("early stopping: no %s gain for %d epochs", self.metric, self.wait)
            self.model.stop_training = True

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        if self.patience and self.best_epoch is not None:
            log.info("keeping epoch %d (val %s=%.4f)", self.best_epoch + 1, self.metric, self.best)
            if self.best_checkpoint is not None:  # best before the resume: from the backup
                restored = self._towers().read(self.best_checkpoint + "/towers")
                restored.assert_existing_objects_matched()
            elif self.best_weights is not None:
                for tower, weights in zip(
                    (self.trained.query_tower, self.trained.candidate_tower),
                    self.best_weights,
                    strict=True,
                ):
                    tower.set_weights(weights)
        if self.state_dir is not None and self.chief:  # a finished run starts afresh next time
            shutil.rmtree(self.state_dir, ignore_errors=True)


def validation_callback(
    config: RecsysConfig,
    data_dir: Path,
    trained: TrainedModel,
    state_dir: Path | None = None,
    chief: bool = True,
    sequences: TrainingSequences | None = None,
) -> ValidationRecall | None:
    """Exact validation metrics (and early stopping), or None without a validation split.

    With `sequences` (one-pass training) the validation examples come from them, else from
    the validation split's rows.
    """
    if sequences is not None:
        built = sequence_validation(config, sequences, trained)
    else:
        built = rows_validation(config, data_dir, trained)
    if built is None:
        return None
    eval_set, queries = built
    tc = config.training
    return ValidationRecall(
        trained,
        eval_set,
        queries,
        tc.early_stopping_metric,
        tc.early_stopping_patience,
        state_dir=state_dir,
        chief=chief,
    )


def rows_validation(
    config: RecsysConfig, data_dir: Path, trained: TrainedModel
) -> tuple[ev.EvalSet, QueryVectors] | None:
    """The validation split's rows (sampled as the test evaluation samples) and histories."""
    # The same user sample as the test evaluation: exact ranking of every validation user
    # over the catalog each epoch is the cost that sampling bounds. The split streams, so
    # only the sampled rows' histories are ever held (not every row's, then a sample).
    total = count_rows(data_dir, "validation")
    if not total:
        return None
    chosen = ev.sample_indices(total, config.evaluation.sample_users, config.evaluation.sample_seed)
    validation = concat_batches(
        ev.sampled_batches(iter_split(data_dir, "validation"), chosen), schema.FEATURE_NAMES
    )
    ids = (schema.USER_ID, schema.ITEM_ID)
    eval_set = ev.build_eval_set(trained.items, validation, iter_split(data_dir, "train", ids))
    histories = list(validation[schema.HISTORY]) if schema.HISTORY in validation else None
    users = eval_set.users
    return eval_set, lambda model: model.user_embeddings(users, histories)


def sequence_validation(
    config: RecsysConfig, sequences: TrainingSequences, trained: TrainedModel
) -> tuple[ev.EvalSet, QueryVectors] | None:
    """Validation positions of the sequences: target, history before it, training items,
    with the seeded sample of `evaluation.sample_users` the test evaluation draws."""
    seqs = sequences.sequences
    examples = ev.eval_examples(
        seqs,
        "validation",
        trained.config.oov_buckets,
        config.evaluation.sample_users,
        config.evaluation.sample_seed,
    )
    if not len(examples.rows):
        return None
    eval_set = examples.eval_set(seqs.users, len(trained.items))
    history = examples.histories(seqs.items, trained.config.history_length)
    user_index = sequences.user_index[examples.rows]
    return eval_set, lambda model: model.query_embeddings(user_index, history)
