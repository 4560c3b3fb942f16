"""Adam whose embedding-table updates touch only the rows a batch used (a tf_keras adapter).

tf_keras' Adam decays the first and second moments of EVERY row of a table on every step,
even for an embedding gradient (IndexedSlices) that names a few hundred rows, and then
rewrites the whole table: its step cost grows with the vocabulary (docs/BENCHMARKS.md). Lazy
Adam (as in TF Addons' LazyAdam and PyTorch's SparseAdam) applies the Adam step to the rows
the gradient names only; with g the (deduplicated) rows' gradient and t the step,

    m[rows] <- b1 m[rows] + (1 - b1) g          v[rows] <- b2 v[rows] + (1 - b2) g^2
    w[rows] <- w[rows] - lr sqrt(1 - b2^t) / (1 - b1^t) * m[rows] / (sqrt(v[rows]) + eps)

and leaves the other rows, and their moments, as they are. A row updated at every step gets
exactly Adam's values; a row skipped for a while keeps its stale moments instead of decaying
them (the usual sparse approximation). Dense gradients (towers' dense layers) get plain Adam.

This module is the one place that reads tf_keras Adam's private slot lists (`_momentums`,
`_velocities`, `_index_dict`, `_var_key`); tests/test_lazy_adam.py fails if they change.
"""

from __future__ import annotations

import tensorflow as tf


class LazyAdam(tf.keras.optimizers.Adam):
    """tf_keras Adam with row-wise (lazy) updates for IndexedSlices gradients."""

    def update_step(self, gradient: tf.Tensor, variable: tf.Variable) -> None:
        """Adam on the gradient's rows only when it is sparse; plain Adam otherwise."""
        if not isinstance(gradient, tf.IndexedSlices) or self.amsgrad:
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        alpha = (
            tf.cast(self.learning_rate, dtype)
            * tf.sqrt(1 - tf.pow(beta_2, step))
            / (1 - tf.pow(beta_1, step))
        )
        slot = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[slot], self._velocities[slot]
        rows, values = gradient.indices, gradient.values
        m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
        v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        epsilon = tf.cast(self.epsilon, dtype)
        if self.adaptive_epsilon:
            epsilon = epsilon * tf.sqrt(1 - tf.pow(beta_2, step))
        variable.scatter_sub(tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + epsilon), rows))
        return None
