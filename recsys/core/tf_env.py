"""TensorFlow's process environment, which it reads once, at its first import.

TFRS needs Keras 2 (tf_keras): TensorFlow picks its Keras from TF_USE_LEGACY_KERAS when it is
first imported, so `set_tf_env` must run before any `import tensorflow` in the process. Each of
our top-level packages (recsys, beam_jobs, serving_export, conductor) calls it in its
`__init__`, which Python runs before any module of the package; scripts call it themselves.
"""

import os


def set_tf_env() -> None:
    """Select Keras 2 for TFRS and quiet TensorFlow's C++ logs, unless the caller chose."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
