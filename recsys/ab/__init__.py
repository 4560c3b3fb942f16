"""Online A/B tests: assignment, experiment definitions, analysis and decisions.

Library layer: imports recsys.core, recsys.tracking and recsys.serving_state only (a promotion
moves serving with the alias), never conductor/ (the CLI and the nightly). See
docs/AB_TESTING.md.
"""

from recsys.ab.analysis import Analysis, Decision, MetricResult, analyze
from recsys.ab.assignment import HOLDOUT, assign, assign_many, bucket
from recsys.ab.definition import ExperimentDefinition, load_definition

__all__ = [
    "HOLDOUT",
    "Analysis",
    "Decision",
    "ExperimentDefinition",
    "MetricResult",
    "analyze",
    "assign",
    "assign_many",
    "bucket",
    "load_definition",
]
