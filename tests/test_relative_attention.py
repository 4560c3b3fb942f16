"""The relative-position attention adapter: fails loudly if tf_keras changes the hook."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from recsys.model.attention import RelativeAttention


def _pair() -> tuple[tf.keras.layers.MultiHeadAttention, RelativeAttention, tf.Tensor, tf.Tensor]:
    tf.keras.utils.set_random_seed(0)
    x = tf.random.normal([3, 6, 8])
    mask = tf.tile(tf.linalg.band_part(tf.ones([6, 6], tf.bool), -1, 0)[None], [3, 1, 1])
    keras = tf.keras.layers.MultiHeadAttention(2, key_dim=4)
    ours = RelativeAttention(2, 4, max_distance=6)
    keras(x, x, attention_mask=mask)
    ours(x, x, attention_mask=mask)
    keras_weights = keras.get_weights()
    ours.set_weights([ours.distance_bias.numpy(), *keras_weights])
    return keras, ours, x, mask


def test_without_a_bias_it_is_keras_attention_with_the_same_variables() -> None:
    keras, ours, x, mask = _pair()
    assert [w.shape for w in ours.weights[1:]] == [w.shape for w in keras.weights]
    np.testing.assert_allclose(
        ours(x, x, attention_mask=mask).numpy(),
        keras(x, x, attention_mask=mask).numpy(),
        atol=1e-5,
    )


def test_call_goes_through_the_overridden_hook_and_the_bias_counts_distances() -> None:
    keras, ours, x, mask = _pair()
    ours.distance_bias.assign(np.tile(np.linspace(0.0, 3.0, 6), (2, 1)).astype(np.float32))
    out = ours(x, x, attention_mask=mask).numpy()
    # If tf_keras stops calling `_compute_attention`, the bias is ignored: this fails.
    assert np.abs(out - keras(x, x, attention_mask=mask).numpy()).max() > 1e-3
    # Only distances matter: the last 3 items alone give the last output of the window.
    alone = ours(x[:, 3:], x[:, 3:], attention_mask=mask[:, :3, :3]).numpy()
    shifted = ours(
        x[:, :, :], x, attention_mask=tf.concat([tf.zeros([3, 6, 3], tf.bool), mask[:, :, 3:]], 2)
    ).numpy()
    np.testing.assert_allclose(alone[:, -1], shifted[:, -1], atol=1e-5)
    # The latest position alone (queries = last key) equals the full pass's last row.
    latest = ours(x[:, -1:], x, attention_mask=mask[:, -1:]).numpy()
    np.testing.assert_allclose(latest[:, 0], out[:, -1], atol=1e-5)
