"""Apache Beam preprocessing: raw interaction logs -> validated, split TFRecords + vocab + stats.

`run_preprocess` (in beam_jobs.pipeline) is the entry point; docs/PREPROCESSING.md describes
the inputs, the rejection reasons and the files written.
"""

import os

# TensorFlow picks its Keras at first import, and the TFRecord writer imports TensorFlow.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import recsys  # noqa: F401  (the rest of the package's environment defaults)
from beam_jobs._quiet import import_beam_quietly

import_beam_quietly()

from beam_jobs.pipeline import run_preprocess  # noqa: E402

__all__ = ["run_preprocess"]
