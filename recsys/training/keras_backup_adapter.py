"""The one place recsys drives private Keras 2 (tf_keras) state: BackupAndRestore's counters.

Private names used, all of `tf_keras.callbacks.BackupAndRestore` (tf_keras/src/callbacks.py):
`_training_state._ckpt_saved_batch` (the step a resume continues after), `_batches_count`
(steps since the last backup), `_current_epoch` and `_backup(epoch, batch)`. They are verified
for tf_keras 2.21 (constraints.txt). A tf_keras upgrade that renames or restructures
BackupAndRestore's step accounting (e.g. moving `_ckpt_saved_batch` off `WorkerTrainingState`,
or counting steps itself) breaks this module; tests/test_keras_backup_adapter.py then fails
loudly, naming the missing attribute, before any training run depends on it.
"""

from __future__ import annotations

import tensorflow as tf

from recsys.core.faults import fault_point

# The private attributes this adapter reads or writes, checked by the pin test.
PRIVATE_STATE = ("_batches_count", "_current_epoch", "_training_state")
PRIVATE_TRAINING_STATE = ("_ckpt_saved_batch",)
PRIVATE_METHODS = ("_backup",)


class BackupEveryStepsAndEpoch(tf.keras.callbacks.BackupAndRestore):
    """BackupAndRestore that, given a step frequency, also backs up at every epoch end, and
    counts steps (not calls) under `steps_per_execution` > 1.

    Keras saves either every N steps or at epoch ends; a run killed between an epoch's end and
    the next N-step mark would otherwise redo up to N steps of the finished epoch. With
    several steps per call, Keras' callback counts calls (N calls = N x steps_per_execution
    steps) and records the call's *first* step as the last one done, so a resume redid the
    call's other steps, and a kill after an epoch's end resumed inside the finished epoch
    (its validation and checkpoint callbacks ran twice). Here the recorded step is the last
    one the call ran, and a backup happens at the first call end at or after every
    `save_freq` steps.
    """

    _batches_count: int  # tf_keras' own counter (PRIVATE_STATE), typed for the checker

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        super().on_train_batch_begin(batch, logs)
        self._call_first_step = batch

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        # `batch` is the last step this call ran: resume continues after it.
        self._training_state._ckpt_saved_batch.assign(batch)
        self._training_state.backup_if_preempted()
        if self.save_freq == "epoch":
            return
        self._batches_count += batch - getattr(self, "_call_first_step", batch) + 1
        if self._batches_count >= self.save_freq:
            self._batches_count = 0
            self._backup(epoch=self._current_epoch, batch=batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        fault_point("train:checkpoint")
        super().on_epoch_end(epoch, logs)
        if self.save_freq != "epoch":
            # The saved step is the epoch's last one: resume starts the next epoch.
            self._batches_count = 0
            self._backup(epoch=epoch)
