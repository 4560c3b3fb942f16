"""A compact SASRec (Kang and McAuley, ICDM 2018) as the sequence-model reference.

Causal self-attention over a user's last L items: x_0 = E[s] * sqrt(d) + P (learned
positions, padding rows zeroed), then per block (pre-norm, as the authors' code)
  q = LN(x);  x = q + MHA(q, x, x; causal and padding mask);  x = x + FFN(LN(x))
with FFN(z) = W2 dropout(ReLU(W1 z)), dropout on the attention and FFN outputs, and a final LN.
The output h_t at every position t scores every catalog item by the shared item table,
logits = h_t E^T, and training minimises the full-softmax cross-entropy of the next item
at every non-padding position (not the paper's one sampled negative per positive: the
full softmax is the stronger variant, Petrov and Macdonald, RecSys 2023). A user's query is
h at the last position of their sequence. Early stopping on validation NDCG@10 (evaluated
every `eval_every` epochs; the best weights are kept).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from recsys.core.tf_env import set_tf_env

set_tf_env()  # before TensorFlow's first import, below: TFRS needs Keras 2

# isort: split
import numpy as np
import tensorflow as tf

from recsys import evaluation as ev
from recsys.core.config import EvaluationConfig

VALIDATION_METRIC = "ndcg_at_10"
log = logging.getLogger("quality.sasrec")


@dataclass(frozen=True)
class Settings:
    """SASRec hyper-parameters and the training budget."""

    hidden: int = 64
    blocks: int = 2
    heads: int = 1
    dropout: float = 0.2
    max_length: int = 50
    learning_rate: float = 1e-3
    batch_size: int = 128
    max_epochs: int = 200
    eval_every: int = 5
    patience: int = 3  # evaluations without a validation gain before stopping
    seed: int = 0
    # Batches of users of similar length (Trainer.epoch) instead of uniformly random ones:
    # much less attention work on sparse logs, but other batches; tuned like the rest.
    length_batches: bool = False

    def label(self) -> str:
        """A short name of the settings that are tuned."""
        return (
            f"d{self.hidden}-b{self.blocks}-drop{self.dropout}-L{self.max_length}"
            f"-lr{self.learning_rate:g}" + ("-bylength" if self.length_batches else "")
        )


def _init() -> tf.keras.initializers.Initializer:
    # One instance per table: Keras repeats an unseeded instance's values (global seed rules).
    return tf.keras.initializers.TruncatedNormal(stddev=0.02)


class SASRec(tf.keras.Model):
    """The encoder; `item_table` rows 1..n are the catalog items, row 0 is padding."""

    def __init__(self, num_items: int, s: Settings) -> None:
        super().__init__()
        self.s = s
        self.item_table = tf.keras.layers.Embedding(
            num_items + 1, s.hidden, embeddings_initializer=_init()
        )
        self.positions = tf.keras.layers.Embedding(
            s.max_length, s.hidden, embeddings_initializer=_init()
        )
        self.drop = tf.keras.layers.Dropout(s.dropout)
        self.layers_ = []
        for _ in range(s.blocks):
            self.layers_.append(
                (
                    tf.keras.layers.LayerNormalization(epsilon=1e-8),
                    tf.keras.layers.MultiHeadAttention(
                        s.heads, s.hidden // s.heads, dropout=s.dropout
                    ),
                    tf.keras.layers.LayerNormalization(epsilon=1e-8),
                    tf.keras.layers.Dense(s.hidden, activation="relu"),
                    tf.keras.layers.Dense(s.hidden),
                    tf.keras.layers.Dropout(s.dropout),
                )
            )
        self.final_norm = tf.keras.layers.LayerNormalization(epsilon=1e-8)

    def call(self, seq: tf.Tensor, training: bool = False) -> tf.Tensor:
        """[batch, L] item rows (0: padding, left-padded) -> [batch, L, d] outputs."""
        keep = tf.cast(seq > 0, tf.float32)[..., None]
        length = tf.shape(seq)[1]
        # Positions count from the right end of a max_length window, so a batch trimmed of
        # its all-padding columns (Trainer.epoch) gives every item the position it has untrimmed.
        window = tf.range(self.s.max_length - length, self.s.max_length)
        x = self.item_table(seq) * math.sqrt(self.s.hidden) + self.positions(window)
        x = self.drop(x, training=training) * keep
        causal = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
        mask = tf.logical_and(causal[None], (seq > 0)[:, None, :])
        for norm1, attention, norm2, inner, outer, drop in self.layers_:
            q = norm1(x)
            x = q + attention(q, x, x, attention_mask=mask, training=training)
            h = drop(inner(norm2(x)), training=training)
            x = (x + drop(outer(h), training=training)) * keep
        return self.final_norm(x)

    def item_vectors(self) -> tf.Tensor:
        """[n, d] the catalog items' rows of the shared table."""
        return self.item_table.embeddings[1:]


def pad_left(sequences: list[np.ndarray], length: int) -> np.ndarray:
    """The last `length` entries of each sequence, left-padded with 0 into one matrix."""
    out = np.zeros((len(sequences), length), np.int32)
    for r, seq in enumerate(sequences):
        tail = seq[-length:]
        if len(tail):
            out[r, length - len(tail) :] = tail
    return out


def training_pairs(sequences: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, next-item targets) per user: every position of the sequence is an example."""
    rows = [np.asarray(s, np.int32) + 1 for s in sequences if len(s) >= 2]
    return pad_left([s[:-1] for s in rows], length), pad_left([s[1:] for s in rows], length)


class Trainer:
    """Fits SASRec with full-softmax cross-entropy; scores users for `recsys.evaluation`."""

    def __init__(self, num_items: int, s: Settings) -> None:
        tf.keras.utils.set_random_seed(s.seed)
        self.s = s
        self.model = SASRec(num_items, s)
        self.model(tf.zeros([1, s.max_length], tf.int32))
        self.optimizer = tf.keras.optimizers.Adam(s.learning_rate, beta_2=0.98)
        self.step = tf.function(self._step, reduce_retracing=True)

    def _step(self, seq: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            h = self.model(seq, training=True)
            real = target > 0
            logits = tf.matmul(
                tf.boolean_mask(h, real), self.model.item_vectors(), transpose_b=True
            )
            labels = tf.boolean_mask(target, real) - 1
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
            )
        variables = self.model.trainable_variables
        gradients = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
        return loss

    def epoch(self, inputs: np.ndarray, targets: np.ndarray, rng: np.random.Generator) -> float:
        """One pass over the users in a random order; the mean batch loss.

        Each batch drops the columns that are padding in all of its rows (the loss is the same
        function of the same examples). With `length_batches` the users are sorted by sequence
        length (random order within a length), cut into batches and the batches shuffled, so
        that on sparse logs (Amazon Beauty: median 6 items, L = 50) most of the attention work
        is skipped; the batches then differ from uniformly random ones, and so may the fit.
        """
        lengths = (targets > 0).sum(axis=1)
        order = rng.permutation(len(inputs))
        if self.s.length_batches:
            order = np.lexsort((rng.random(len(inputs)), lengths))
        batches = [
            order[lo : lo + self.s.batch_size] for lo in range(0, len(order), self.s.batch_size)
        ]
        losses = []
        for i in rng.permutation(len(batches)):
            batch = batches[i]
            keep = max(int(lengths[batch].max()), 1)
            seq, target = inputs[batch, -keep:], targets[batch, -keep:]
            losses.append(float(self.step(tf.constant(seq), tf.constant(target))))
        return float(np.mean(losses))

    def user_vectors(self, sequences: list[np.ndarray]) -> np.ndarray:
        """[users, d] the output at the last position of each user's sequence."""
        padded = pad_left([np.asarray(s, np.int32) + 1 for s in sequences], self.s.max_length)
        out = [
            self.model(tf.constant(padded[lo : lo + 512]), training=False)[:, -1, :].numpy()
            for lo in range(0, len(padded), 512)
        ]
        return np.concatenate(out) if out else np.zeros((0, self.s.hidden), np.float32)

    def scores(self, sequences: list[np.ndarray]) -> ev.ScoreFn:
        """Dot-product scores of these users' query vectors against every catalog item."""
        return ev.dot_product_scores(
            self.user_vectors(sequences), self.model.item_vectors().numpy()
        )


def refit(num_items: int, sequences: list[np.ndarray], s: Settings, epochs: int) -> Trainer:
    """A fresh model trained `epochs` epochs on `sequences` (train + validation), no stopping.

    The epoch count is the one `fit` chose on validation; the newest item of each user then
    reaches the model, as in EASE's and ALS's train + validation refit and ours.
    """
    trainer = Trainer(num_items, s)
    inputs, targets = training_pairs(sequences, s.max_length)
    rng = np.random.default_rng(s.seed)
    for _ in range(epochs):
        trainer.epoch(inputs, targets, rng)
    return trainer


def fit(
    num_items: int,
    train_sequences: list[np.ndarray],
    validation: tuple[list[np.ndarray], ev.EvalSet],
    s: Settings,
) -> tuple[Trainer, dict[str, Any]]:
    """Train with early stopping on validation NDCG@10; the best evaluation's weights stay."""
    trainer = Trainer(num_items, s)
    inputs, targets = training_pairs(train_sequences, s.max_length)
    rng = np.random.default_rng(s.seed)
    config = EvaluationConfig(ks=[10], ndcg_k=10, mrr_k=10, coverage_k=0)
    best, best_epoch, best_weights, waited = -1.0, 0, None, 0
    curve, seconds = [], []
    for epoch in range(1, s.max_epochs + 1):
        start = time.perf_counter()
        loss = trainer.epoch(inputs, targets, rng)
        seconds.append(time.perf_counter() - start)
        if epoch % s.eval_every and epoch != s.max_epochs:
            continue
        value = ev.evaluate(trainer.scores(validation[0]), validation[1], config).metrics[
            VALIDATION_METRIC
        ]
        curve.append((epoch, round(loss, 4), round(value, 4)))
        log.info(
            "sasrec %s epoch %d: loss %.4f, validation %s %.4f (%.1f s/epoch)",
            s.label(), epoch, loss, VALIDATION_METRIC, value, float(np.median(seconds)),
        )  # fmt: skip
        if value > best:
            best, best_epoch, best_weights, waited = value, epoch, trainer.model.get_weights(), 0
        else:
            waited += 1
            if waited >= s.patience:
                break
    if best_weights is not None:
        trainer.model.set_weights(best_weights)
    steady = seconds[1:] or seconds
    info = {
        "settings": asdict(s),
        "best_epoch": best_epoch,
        "epochs_run": len(seconds),
        f"validation_{VALIDATION_METRIC}": round(best, 4),
        "curve": curve,
        "seconds": round(sum(seconds), 1),
        "seconds_per_epoch": round(float(np.median(steady)), 2),
        "examples_per_second": round(int((targets > 0).sum()) / float(np.median(steady))),
    }
    return trainer, info
