"""Apache Beam preprocessing: raw interaction logs -> validated, split TFRecords + vocab + stats.

`run_preprocess` (in beam_jobs.pipeline) is the entry point; docs/PREPROCESSING.md describes
the inputs, the rejection reasons and the files written.
"""

from recsys.core.tf_env import set_tf_env

# Before Beam: its TFRecord writer imports TensorFlow, which reads the environment once.
set_tf_env()

from beam_jobs._quiet import import_beam_quietly  # noqa: E402

import_beam_quietly()

from beam_jobs.pipeline import run_preprocess  # noqa: E402

__all__ = ["run_preprocess"]
