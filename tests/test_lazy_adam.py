"""LazyAdam: plain Adam on the rows a sparse gradient names, nothing on the others."""

import numpy as np
import tensorflow as tf

from recsys.training.lazy_adam import LazyAdam


def _sparse_steps(optimizer: tf.keras.optimizers.Optimizer, steps: list[list[int]]) -> np.ndarray:
    """Apply embedding-style gradients (IndexedSlices on the given rows) to a fresh table."""
    table = tf.Variable(np.arange(24, dtype=np.float32).reshape(6, 4) / 10)
    for rows in steps:
        with tf.GradientTape() as tape:
            looked_up = tf.gather(table, rows)
            loss = tf.reduce_sum(tf.sin(looked_up) * tf.range(1.0, 5.0))
        grad = tape.gradient(loss, table)
        assert isinstance(grad, tf.IndexedSlices)
        optimizer.apply_gradients([(grad, table)])
    return table.numpy()


def test_lazy_adam_equals_adam_on_touched_rows_and_skips_the_others():
    steps = [[0, 1, 1], [0, 1], [0, 2], [0]]  # row 1: touched twice then skipped; 3-5 never
    initial = np.arange(24, dtype=np.float32).reshape(6, 4) / 10
    lazy = _sparse_steps(LazyAdam(0.1), steps)
    dense = _sparse_steps(tf.keras.optimizers.Adam(0.1), steps)
    # Row 0 is touched at every step: exactly Adam's trajectory.
    np.testing.assert_allclose(lazy[0], dense[0], atol=1e-5)  # float32 operation order
    # Never-touched rows are unchanged; Adam leaves them alone too (zero moments).
    np.testing.assert_array_equal(lazy[3:], initial[3:])
    # Row 1 after its last use: lazy keeps it, Adam keeps moving it with decayed moments.
    after_two = _sparse_steps(LazyAdam(0.1), steps[:2])
    np.testing.assert_array_equal(lazy[1], after_two[1])
    assert np.abs(dense[1] - after_two[1]).max() > 1e-3
    assert np.abs(lazy[1] - initial[1]).max() > 1e-3


def test_lazy_adam_dense_gradients_are_plain_adam():
    def run(optimizer: tf.keras.optimizers.Optimizer) -> np.ndarray:
        w = tf.Variable([[1.0, -2.0], [0.5, 3.0]])
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(w @ w))
            optimizer.apply_gradients([(tape.gradient(loss, w), w)])
        return w.numpy()

    np.testing.assert_allclose(run(LazyAdam(0.05)), run(tf.keras.optimizers.Adam(0.05)))
