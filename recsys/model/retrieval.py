"""The retrieval task: in-batch sampled softmax over the global batch, and the train step."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from recsys.core.config import ModelConfig
from recsys.losses import in_batch_softmax_loss, softmax_loss
from recsys.model.inputs import HISTORY_INDEX, ITEM_INDEX, ITEM_LOG_PROB, TARGET_INDEX, USER_INDEX
from recsys.model.negatives import (
    full_softmax_loss,
    mixture_log_q,
    pool_log_q,
    sample_pool,
    sampled_softmax_loss,
)
from recsys.model.towers import CandidateTower, QueryTower


def gather_global_candidates(*tensors: tf.Tensor) -> list[tf.Tensor]:
    """Under several replicas, every replica's rows gathered, this replica's rows first.

    In-batch negatives then come from the global batch. Rolling the local rows first keeps the
    positives on the diagonal (what tfrs.tasks.Retrieval's labels assume); the softmax does not
    depend on the order of the other columns. ReplicaContext.all_gather is differentiable: the
    gradient reaching another replica's candidates is summed back to that replica.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(tensors)
    # Input tensors straight from the dataset iterator carry no device under a multi-worker
    # strategy; all_gather needs one (it is its destination): copy them under the step's.
    tensors = tuple(t if t.device else tf.identity(t) for t in tensors)
    sizes = ctx.all_gather(tf.shape(tensors[0])[:1], axis=0)
    offset = tf.reduce_sum(sizes[: ctx.replica_id_in_sync_group])
    # A roll, not a gather: its gradient stays dense, which all_gather's gradient needs.
    return [tf.roll(ctx.all_gather(t, axis=0), shift=-offset, axis=0) for t in tensors]


class TwoTowerModel(tfrs.Model):
    """Sampled-softmax retrieval over the global batch (plus a shared pool, or the catalog).

    For a batch of (query, item) pairs with query vectors q_i and candidate vectors c_j (all
    replicas' candidates under a distribution strategy) the logits are
    `s_ij = q_i . c_j / temperature - log Q(j)` (logQ correction on), other columns holding the
    positive item are masked (accidental hits), optionally only the top `num_hard_negatives`
    negatives are kept, and the loss is the softmax cross-entropy of the positive, summed over
    the replica's queries (so gradients summed over replicas equal one-device gradients).
    `model.negatives` mixed appends a pool of sampled items to the candidates and corrects
    every column by the mixture's log Q; full replaces the candidates by the whole catalog
    (exact softmax, no correction): `recsys.model.negatives`.
    Logits and loss are float32 whatever the towers' precision. The logged `loss` is the mean
    per example over the epoch.

    A batch is either one example per row (`item_index`, the per-prefix path: each row's
    history encoded on its own) or windows of user sequences (`target_index`, one causal pass:
    the query tower's `sequence` gives a vector at every position, and every position with a
    target is one example of the same loss; its negatives are the other positions' targets,
    the pool or the catalog exactly as for rows).
    """

    def __init__(
        self,
        query_tower: QueryTower,
        candidate_tower: CandidateTower,
        config: ModelConfig,
        item_log_probs: np.ndarray | None = None,
    ) -> None:
        super().__init__()
        self.query_tower = query_tower
        self.candidate_tower = candidate_tower
        self.config = config
        if config.negatives in ("mixed", "full", "sampled") and item_log_probs is None:
            raise ValueError(f"model.negatives {config.negatives!r} needs item_log_probs")
        if config.negatives == "auto":
            raise ValueError("model.negatives 'auto' must be resolved before building")
        # log p(item) per item index (OOV rows first): pool sampling and its logQ correction.
        self.item_log_probs = None if item_log_probs is None else tf.constant(item_log_probs)
        self.task = tfrs.tasks.Retrieval(
            temperature=config.temperature,
            remove_accidental_hits=config.remove_accidental_hits,
            num_hard_negatives=config.num_hard_negatives,
        )
        self.loss_tracker = tf.keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[tf.keras.metrics.Metric]:
        return [self.loss_tracker]

    def compute_loss(self, features: dict[str, tf.Tensor], training: bool = False) -> tf.Tensor:
        return self._loss_and_examples(features, training)[0]

    def _loss_and_examples(
        self, features: dict[str, tf.Tensor], training: bool
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The batch's summed loss and its number of examples (rows, or trained positions)."""
        if TARGET_INDEX in features:
            query, items = self._positions(features, training)
            log_p = tf.gather(self.item_log_probs, items)
        else:
            query_inputs = {k: features[k] for k in (USER_INDEX, HISTORY_INDEX) if k in features}
            query = self.query_tower(query_inputs, training=training)
            items, log_p = features[ITEM_INDEX], features[ITEM_LOG_PROB]
        return self._loss(query, items, log_p, training), tf.shape(items)[0]

    def _positions(
        self, features: dict[str, tf.Tensor], training: bool
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """[P, d] query vectors and [P] target items of the P positions that have a target."""
        inputs = {USER_INDEX: features[USER_INDEX], HISTORY_INDEX: features[HISTORY_INDEX]}
        outputs = self.query_tower.sequence(inputs, training=training)
        targets = features[TARGET_INDEX]
        trained = targets >= 0
        return tf.boolean_mask(outputs, trained), tf.boolean_mask(targets, trained)

    def _loss(
        self, query: tf.Tensor, items: tf.Tensor, log_p: tf.Tensor, training: bool
    ) -> tf.Tensor:
        """Summed softmax loss of each query's item under `model.negatives`."""
        if self.config.negatives == "full":
            rows = tf.range(tf.shape(self.item_log_probs, out_type=tf.int64)[0])
            catalog = self.candidate_tower(rows, training=training)
            if self.jit_compile:  # XLA cannot compile the blocked loop (recsys/losses.py)
                return full_softmax_loss(query, catalog, items, self.config.temperature)
            return softmax_loss(query, catalog, items, self.config.temperature)
        if self.config.negatives == "sampled":
            return self._sampled(query, items, log_p, training)
        candidates = self.candidate_tower(items, training=training)
        candidates, ids, log_q = gather_global_candidates(candidates, items, log_p)
        if self.config.negatives == "mixed":
            candidates, ids, log_q = self._add_pool(candidates, ids, log_q, training)
        log_q = log_q if self.config.logq_correction else None
        ids = ids if self.config.remove_accidental_hits else None
        if self.config.num_hard_negatives is None and not self.jit_compile:
            # The task's loss in cache-sized row blocks (recsys/losses.py): ~2x faster on CPU.
            # Its loop has dynamic shapes XLA cannot compile; under XLA the task is fused.
            return in_batch_softmax_loss(query, candidates, self.config.temperature, log_q, ids)
        return self.task(
            query,
            candidates,
            candidate_sampling_probability=None if log_q is None else tf.exp(log_q),
            candidate_ids=ids,
            compute_metrics=False,
            compute_batch_metrics=False,
        )

    def _sampled(
        self, query: tf.Tensor, items: tf.Tensor, log_p: tf.Tensor, training: bool
    ) -> tf.Tensor:
        """Sampled softmax: each query against its own item and a shared sampled pool."""
        cfg, oov, item_log_probs = self.config, self.config.oov_buckets, self.item_log_probs
        if item_log_probs is None:  # __init__ refuses sampled negatives without them
            raise ValueError("a sampled pool needs item_log_probs")
        pool = sample_pool(cfg.sampled_negatives, item_log_probs, oov, cfg.negative_sampler)
        positives = self.candidate_tower(items, training=training)
        pooled = self.candidate_tower(pool, training=training)
        log_q_positive = log_q_pool = None
        if cfg.logq_correction:
            catalog = int(item_log_probs.shape[0]) - oov
            args = (cfg.sampled_negatives, cfg.negative_sampler, catalog)
            log_q_positive = pool_log_q(log_p, *args)
            log_q_pool = pool_log_q(tf.gather(item_log_probs, pool), *args)
        return sampled_softmax_loss(
            query, positives, pooled, items, pool, cfg.temperature, log_q_positive, log_q_pool
        )

    def _add_pool(
        self, candidates: tf.Tensor, ids: tf.Tensor, log_p: tf.Tensor, training: bool
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """The global batch's candidates followed by a shared pool of sampled items, with
        every column's mixture log Q (`recsys.model.negatives`)."""
        cfg, oov, item_log_probs = self.config, self.config.oov_buckets, self.item_log_probs
        if item_log_probs is None:  # __init__ refuses sampled negatives without them
            raise ValueError("a sampled pool needs item_log_probs")
        pool = sample_pool(cfg.sampled_negatives, item_log_probs, oov, cfg.negative_sampler)
        pooled = tf.cast(self.candidate_tower(pool, training=training), candidates.dtype)
        ids = tf.concat([ids, tf.cast(pool, ids.dtype)], 0)
        log_p = tf.concat([log_p, tf.gather(item_log_probs, pool)], 0)
        catalog = int(item_log_probs.shape[0]) - oov
        log_q = mixture_log_q(
            log_p, tf.shape(candidates)[0], cfg.sampled_negatives, cfg.negative_sampler, catalog
        )
        return tf.concat([candidates, pooled], 0), ids, log_q

    def _step(self, features: dict[str, tf.Tensor], train: bool) -> dict[str, tf.Tensor]:
        loss_scaling = isinstance(self.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        with tf.GradientTape() as tape:
            loss, examples = self._loss_and_examples(features, train)
            # Regularisation is added on every replica and the gradients are summed: 1/R each.
            total = loss + tf.add_n(self.losses) / replicas if self.losses else loss
            # TFRS's own train_step never scales the loss, so float16 gradients underflow.
            scaled = self.optimizer.get_scaled_loss(total) if train and loss_scaling else total
        if train:
            grads = tape.gradient(scaled, self.trainable_variables)
            if loss_scaling:
                grads = self.optimizer.get_unscaled_gradients(grads)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        batch = tf.cast(examples, tf.float32)
        self.loss_tracker.update_state(loss / tf.maximum(batch, 1.0), sample_weight=batch)
        return {"loss": self.loss_tracker.result()}

    def train_step(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        with _replica_device():
            return self._step(features, train=True)

    def test_step(self, features: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        with _replica_device():
            return self._step(features, train=False)


def _replica_device() -> contextlib.AbstractContextManager[object]:
    """Pin the step to the worker's device under a one-device-per-worker multi-worker strategy.

    There, replica tensors carry no device, and all_gather (and its gradient) derive their
    destination from the tensor's device: "destinations can not be empty" otherwise.
    """
    strategy = tf.distribute.get_strategy()
    devices: Sequence[str] = (
        strategy.extended.worker_devices if strategy.num_replicas_in_sync > 1 else ()
    )
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and len(devices) == 1:
        return tf.device(devices[0])
    return contextlib.nullcontext()
