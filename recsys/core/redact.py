"""Redaction of credentials from everything recsys writes: MLflow params, tags, artifacts, logs.

Three kinds of secret are removed:
- the user-info part of a URI (`http://user:password@host` -> `http://host`);
- the value of a setting whose name says it is a secret (`password`, `token`, `secret`,
  `api_key`, `sig`, ...), whether it is a mapping key or `name=value` / `name: value` in text;
- the literal value of a secret environment variable (MLFLOW_TRACKING_PASSWORD,
  MLFLOW_TRACKING_TOKEN, AWS_SECRET_ACCESS_KEY, ...) wherever it appears.

No dependency on the rest of recsys, so config, tracking and the CLI can all use it.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

# `scheme://user:password@host`: everything between `//` and `@` before the host is userinfo.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#\s@]+@")
# Name segments (split on . _ - and case changes) that make a setting a secret. Not "pwd":
# the shell's PWD (the working directory) would make every path in the logs "***".
_SECRET_SEGMENTS = frozenset(
    {
        "password", "passwd", "passphrase", "secret", "token", "apikey",
        "credential", "credentials", "sig", "signature", "bearer", "authorization",
    }
)  # fmt: skip
# `key` alone is too common ("sort key", `key=` in reprs): a secret only after one of these.
_KEY_QUALIFIERS = frozenset(
    {"api", "access", "private", "account", "storage", "signing", "encryption", "master", "ssh"}
)
# Whole names that are secrets although no segment says so.
_SECRET_NAMES = frozenset({"mlflow_tracking_token", "mlflow_tracking_password", "auth"})
# `name=value` or `name: value` in free text (CLI flags, query strings, YAML, log lines).
# Leading dashes are part of the name (`--aws_secret_access_key=...`); quotes may surround the
# name and the value (`{'password': 'x'}` in a repr).
# The value is a lookahead, not consumed: a pair nested in another's value is still seen
# (`--temp_location=gs://b/t?sig=SECRET`).
_NAMED_VALUE = re.compile(
    r"(?P<name>(?<![\w.\-])-*[A-Za-z_][\w.\-]*)(?P<sep>[\"']?\s*[=:]\s*[\"']?)"
    r"(?=(?P<value>[^\s&,;'\"()\[\]{}<>]+))"
)
# Environment variables whose values are always secrets even when short.
_ALWAYS_SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# Shorter values of other secret-named variables are not replaced in text: a variable set to
# "1" or "true" would otherwise turn every "1" into "***".
_MIN_ENV_SECRET = 6
_HARMLESS_VALUES = frozenset({"true", "false", "none", "null", "yes", "no"})


def is_secret_name(name: str) -> bool:
    """Whether a setting, tag, parameter or variable of this name holds a secret."""
    lowered = name.lower()
    if lowered in _SECRET_NAMES:
        return True
    # "max_title_tokens" is not a token, "aws_secret_access_key" and "apiKey" are secrets.
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    parts = [part for part in re.split(r"[^a-z0-9]+", spaced) if part]
    if any(part in _SECRET_SEGMENTS for part in parts):
        return True
    return any(a in _KEY_QUALIFIERS and b == "key" for a, b in itertools.pairwise(parts))


def strip_userinfo(text: str) -> str:
    """`text` with the user:password part of every URI in it removed (deterministic)."""
    return _USERINFO.sub(r"\1", text)


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret environment variables, longest first (so overlaps redact fully)."""
    env = os.environ if environ is None else environ
    values = set()
    for name, value in env.items():
        if not value or value.lower() in _HARMLESS_VALUES:
            continue
        if name in _ALWAYS_SECRET_ENV or (is_secret_name(name) and len(value) >= _MIN_ENV_SECRET):
            values.add(value)
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` without URI credentials, secret-named values or secret environment values.

    `environ` defaults to os.environ; pass `{}` for a result that does not depend on it.
    """
    text = strip_userinfo(text)
    text = _redact_named_values(text)
    for secret in environment_secrets(environ):
        text = text.replace(secret, REDACTED)
    return text


def _redact_named_values(text: str) -> str:
    pieces, position = [], 0
    for match in _NAMED_VALUE.finditer(text):
        if match.start() < position:
            continue  # inside a value already replaced
        if is_secret_name(match["name"]) and match["value"] != REDACTED:
            pieces += [text[position : match.end()], REDACTED]
            position = match.end() + len(match["value"])
    pieces.append(text[position:])
    return "".join(pieces)


def redact_value(name: str, value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A parameter/tag/setting value made safe to record: `***` if its name is a secret."""
    if is_secret_name(name) and value not in (None, "", [], {}):
        return REDACTED
    return redact_tree(value, environ)


def redact_tree(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A copy of JSON-like data (dicts, lists, strings) with every secret redacted."""
    if isinstance(value, str):
        return redact_text(value, environ)
    if isinstance(value, Mapping):
        return {key: redact_value(str(key), item, environ) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact_tree(item, environ) for item in value]
    return value


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's message and traceback before it is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place; never drops it."""
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            # Formatters cache the traceback text here; filling it first means they print ours.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add a RedactingFilter to every handler of `logger` (default: the root logger)."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
