"""Deterministic, language-independent assignment of users to variants.

The hash (docs/AB_TESTING.md has test vectors and Go / Java versions):

    digest = SHA-256(UTF-8 bytes of f"{experiment}:{salt}:{user_id}")
    bucket = (first 8 bytes of digest as an unsigned big-endian integer) mod 10000

Buckets 0..9999 are basis points of traffic. The holdout takes buckets [0, holdout_bp); then
each variant, in the order of the split, takes the next `round(share * 10000)` buckets. Shares
must be whole basis points and, with the holdout, add up to exactly 10000. Only integers are
compared, so a router in any language with SHA-256 and 64-bit unsigned arithmetic agrees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from recsys.core.errors import ConfigError

BUCKETS = 10_000
HOLDOUT = "holdout"


def bucket(user_id: str, experiment: str, salt: str = "") -> int:
    """The user's bucket in [0, 10000) for this experiment and salt."""
    digest = hashlib.sha256(f"{experiment}:{salt}:{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def basis_points(share: float, what: str) -> int:
    """A traffic share as whole basis points (ConfigError if it is not a multiple of 0.0001)."""
    bp = round(share * BUCKETS)
    if not 0 <= share <= 1 or abs(share * BUCKETS - bp) > 1e-6:
        raise ConfigError(
            f"{what} share {share!r} must be between 0 and 1 in whole basis points (0.0001)"
        )
    return bp


def thresholds(split: Mapping[str, float], holdout: float = 0.0) -> list[tuple[str, int]]:
    """(name, exclusive upper bucket) for the holdout then each variant, in order."""
    if not split:
        raise ConfigError("an experiment needs at least one variant in its split")
    bounds = [(HOLDOUT, basis_points(holdout, "holdout"))]
    for name, share in split.items():
        if name == HOLDOUT:
            raise ConfigError(f"{HOLDOUT!r} is reserved for the holdout; rename the variant")
        bounds.append((name, bounds[-1][1] + basis_points(share, f"variant {name!r}")))
    if bounds[-1][1] != BUCKETS:
        total = bounds[-1][1] / BUCKETS
        raise ConfigError(
            f"split {dict(split)} plus holdout {holdout} adds up to {total:g}, not 1: "
            "every user must land in a variant or the holdout"
        )
    return bounds


def assign(
    user_id: str | int,
    experiment: str,
    split: Mapping[str, float],
    *,
    holdout: float = 0.0,
    salt: str = "",
) -> str:
    """The variant of `user_id` ('holdout' when held out): same answer in every process."""
    b = bucket(str(user_id), experiment, salt)
    for name, upper in thresholds(split, holdout):
        if b < upper:
            return name
    raise AssertionError("unreachable: thresholds end at BUCKETS")


def assign_many(
    user_ids: Iterable[str | int],
    experiment: str,
    split: Mapping[str, float],
    *,
    holdout: float = 0.0,
    salt: str = "",
) -> list[str]:
    """`assign` for many users (the split is checked once)."""
    bounds = thresholds(split, holdout)
    out = []
    for user in user_ids:
        b = bucket(str(user), experiment, salt)
        out.append(next(name for name, upper in bounds if b < upper))
    return out
