"""Training progress as a tqdm bar (recsys.core.progress): steps over all epochs of a fit."""

from __future__ import annotations

from typing import Any, TextIO

import tensorflow as tf

from recsys.core.progress import INTERVAL_S, LogFriendlyBar, bar


class KerasProgress(tf.keras.callbacks.Callback):
    """Training steps over all epochs as a progress bar (the total comes from Keras' params).

    One instance follows every fit it is given to: the first is the `train` bar, a later one
    (`training.refit`'s second fit) the `refit` bar, each with its own total and ETA. The
    trainer names each fit through `begin_fit` (a run resumed during its refit starts there).
    """

    def __init__(self, stream: TextIO | None = None, interval: float = INTERVAL_S) -> None:
        super().__init__()
        # Keras would otherwise turn every batch's logs into numpy for us: a device sync per
        # step. The bar reads no logs, only the step index.
        self._supports_tf_logs = True
        self._stream, self._interval = stream, interval
        self._bar: LogFriendlyBar | None = None
        self._epoch = 0
        self._fits = 0
        self._name = "train"
        self._next: str | None = None

    def begin_fit(self, name: str) -> None:
        """The name of the fit that starts next (`train`, `refit`): its bar's label."""
        self._next = name

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._name = self._next or ("train" if self._fits == 0 else "refit")
        self._next = None
        self._fits += 1
        self._epoch = 0
        self._bar = None  # opened at the first epoch: a resumed fit starts at a later one

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        if self._bar is None:
            steps, epochs = self.params.get("steps"), self.params.get("epochs") or 1
            self._bar = bar(
                self._name,
                steps * epochs if steps else None,
                "steps",
                initial=epoch * (steps or 0),
                stream=self._stream,
                interval=self._interval,
                show=True,
            )

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # From the epoch and batch index, not a count of calls: with steps_per_execution > 1
        # Keras calls this once per N steps, and BackupAndRestore resumes at a later epoch.
        if self._bar is not None:
            done = self._epoch * (self.params.get("steps") or 0) + batch + 1
            self._bar.update(done - self._bar.n)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._epoch + 1} epochs", refresh=False)
            self._bar.close()
            self._bar = None
