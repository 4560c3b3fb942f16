"""Online A/B tests: assignment, experiment definitions, analysis and decisions.

Library layer: imports the core (config, errors) and tracking/registry only, never the CLI or
the nightly conductor. See docs/AB_TESTING.md.
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
