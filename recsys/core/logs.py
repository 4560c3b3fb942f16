"""The logging of a recsys process: one line format, quiet libraries, every line redacted."""

from __future__ import annotations

import logging
import sys

from recsys.core.redact import install_log_redaction

# Libraries whose INFO lines drown ours: warnings and errors only.
NOISY = ("apache_beam", "absl", "tensorflow", "mlflow", "alembic")


def configure_logging(level: int = logging.INFO, tag: str = "") -> None:
    """Log to stderr at `level`, lines tagged `[tag]` when given (a worker process)."""
    where = f" [{tag}]" if tag else ""
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s",
        stream=sys.stderr,
    )
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Every log line (ours, MLflow's, Beam's, and warnings routed through logging) loses URI
    # credentials and secret values before it is written (docs/OPERATIONS.md, Security).
    logging.captureWarnings(True)
    install_log_redaction()
