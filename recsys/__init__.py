"""recsys: nightly retraining of two-tower retrieval models.

TFRS needs Keras 2 (tf_keras); TensorFlow picks its Keras at first import, so the flag is set
here, before any submodule can import TensorFlow.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"
