"""recsys: the library of nightly retraining of two-tower retrieval models.

`recsys.core` (schema, config, errors, run layout) imports nothing of ours; the model, training
and evaluation sit on it; `recsys.tracking` (MLflow runs, registry, gate, comparisons) above
them. The nightly conductor and the CLI live in the top-level `conductor` package;
`recsys.api` gathers the documented entry points of all of them in one namespace.
"""

from recsys.core.tf_env import set_tf_env

set_tf_env()

__version__ = "0.1.0"
