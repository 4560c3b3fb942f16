"""Import Apache Beam without the warning it logs when the optional GCP clients are absent."""

import logging

_NOISE = "apitools not found"


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _NOISE not in record.getMessage()


def import_beam_quietly() -> None:
    """Import apache_beam, dropping its 'apitools not found' root-logger warning."""
    root = logging.getLogger()
    noise_filter = _DropNoise()
    # The warning goes through logging.warning(), which calls basicConfig() when the root logger
    # has no handler: a placeholder handler stops that from configuring the app's logging.
    placeholder = logging.NullHandler() if not root.handlers else None
    if placeholder:
        root.addHandler(placeholder)
    root.addFilter(noise_filter)
    try:
        import apache_beam  # noqa: F401
    finally:
        root.removeFilter(noise_filter)
        if placeholder:
            root.removeHandler(placeholder)
