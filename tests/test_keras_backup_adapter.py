"""Pins the private tf_keras state recsys.training.keras_backup_adapter drives.

A tf_keras upgrade that renames BackupAndRestore's counters fails here, naming the attribute.
"""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from recsys.training import keras_backup_adapter as adapter


class Recording(adapter.BackupEveryStepsAndEpoch):
    """The adapter, recording (epoch, step a resume continues after) at every backup."""

    def __init__(self, backup_dir: str, save_freq: int | str) -> None:
        super().__init__(backup_dir, save_freq=save_freq)
        self.backups: list[tuple[int, int]] = []
        self.seen: dict[str, bool] = {}

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self.seen.update({name: hasattr(self, name) for name in adapter.PRIVATE_STATE})
        state = getattr(self, "_training_state", None)
        self.seen.update({n: hasattr(state, n) for n in adapter.PRIVATE_TRAINING_STATE})
        super().on_train_batch_end(batch, logs)

    def _backup(self, epoch: int, batch: int = 0) -> None:
        self.backups.append((epoch, int(self._training_state._ckpt_saved_batch.numpy())))
        super()._backup(epoch, batch)


def test_private_methods_exist_on_the_installed_keras() -> None:
    """BackupAndRestore still has the private methods the adapter overrides or calls."""
    for name in adapter.PRIVATE_METHODS:
        assert hasattr(tf.keras.callbacks.BackupAndRestore, name), (
            f"tf_keras {tf.keras.__version__} BackupAndRestore lacks {name}: "
            "rework recsys/training/keras_backup_adapter.py for this upgrade"
        )


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_adapter_backs_up_by_steps_and_at_epoch_end(
    tmp_path: Path, steps_per_execution: int
) -> None:
    """5 steps an epoch, a backup every 2 steps: after steps 1 and 3 (or the call ending at or
    after them) and at the epoch's last step 4, each recording the last step done."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    x = np.zeros((10, 2), np.float32)
    callback = Recording(str(tmp_path / "backup"), save_freq=2)
    model.fit(x, x[:, :1], batch_size=2, epochs=1, callbacks=[callback], verbose=0)
    missing = [name for name, present in callback.seen.items() if not present]
    assert not missing, (
        f"tf_keras {tf.keras.__version__} BackupAndRestore lacks {missing}: "
        "rework recsys/training/keras_backup_adapter.py for this upgrade"
    )
    assert set(callback.seen) == {*adapter.PRIVATE_STATE, *adapter.PRIVATE_TRAINING_STATE}
    assert callback.backups == [(0, 1), (0, 3), (0, 4)]
