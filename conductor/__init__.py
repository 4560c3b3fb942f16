"""The nightly conductor and the `recsys` CLI: runs the stages in order, tracks, promotes.

The top layer: it imports the library (recsys, beam_jobs, serving_export) and nothing imports
it (an import-linter contract checks it).
"""

from recsys.core.tf_env import set_tf_env

set_tf_env()
