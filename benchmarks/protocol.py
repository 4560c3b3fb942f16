"""The evaluation protocol (docs/PROTOCOL.md), computed from the raw log by the benchmark.

Per user, events sort by (timestamp, item id) with NUMERIC item ids when every id is an
integer (ML-100K has many same-second events: string order would make "98" sort after "1000"
and pick other test items). Of every user with at least
`min_interactions` events, the last is the test item and the one before it the validation
item; everything else is training. The catalog is every item of a non-test row; a test item
outside it is a miss. Scoring ranks the whole catalog with the user's non-test items removed
(validation: the user's training items removed).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from recsys import evaluation as ev

DATASETS = Path(__file__).resolve().parent.parent / "datasets"  # datasets/README.md
NAMED = {"ml-100k": DATASETS / "ml-100k", "amazon-beauty": DATASETS / "amazon-beauty"}
DERIVED = ("amazon-beauty-shuffled", "synthetic")
"""Logs made at read time: Amazon Beauty with each user's order shuffled (only collaborative
signal left), and the embedded default data (`recsys.synthetic`, latent tastes, no order)."""
SHUFFLE_SEED = 0
_USER = ("user_id", "userId", "user")
_ITEM = ("item_id", "movieId", "itemId", "item")
_TIME = ("timestamp", "time", "ts")


@dataclass
class Log:
    """Interactions as parallel arrays; ids are strings, `numeric` when all item ids are ints."""

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    numeric: bool
    source: str


def read_log(data: str) -> Log:
    """`ml-100k`, `amazon-beauty` (under datasets/), a `DERIVED` log, or a path: u.data, or a
    CSV with a header."""
    if data == "amazon-beauty-shuffled":
        return shuffled(read_log("amazon-beauty"), SHUFFLE_SEED)
    if data == "synthetic":
        return synthetic_log()
    path = NAMED.get(data, Path(data))
    if path.is_dir():
        path = path / "u.data" if (path / "u.data").is_file() else path / "ratings.csv"
    if path.name == "u.data":
        table = pcsv.read_csv(
            path,
            read_options=pcsv.ReadOptions(column_names=["user", "item", "rating", "ts"]),
            parse_options=pcsv.ParseOptions(delimiter="\t"),
            convert_options=pcsv.ConvertOptions(column_types={"user": pa.string(),
                                                              "item": pa.string()}),
        )  # fmt: skip
        cols = ("user", "item", "ts")
    else:
        with path.open(newline="") as f:
            header = next(csv.reader(f))
        cols = tuple(_pick(header, names, path) for names in (_USER, _ITEM, _TIME))
        table = pcsv.read_csv(
            path,
            convert_options=pcsv.ConvertOptions(
                include_columns=list(cols),
                column_types={cols[0]: pa.string(), cols[1]: pa.string()},
            ),
        )
    users = table[cols[0]].to_numpy(zero_copy_only=False).astype(str)
    items = table[cols[1]].to_numpy(zero_copy_only=False).astype(str)
    stamps = table[cols[2]].to_numpy().astype(np.int64)
    numeric = bool(len(items)) and all(s.isdigit() for s in np.unique(items))
    return Log(users, items, stamps, numeric, str(path))


def shuffled(log: Log, seed: int, keep_last: int = 2) -> Log:
    """Each user's items in a random order (seeded), the last `keep_last` left in place.

    Timestamps keep their positions and items move between them, so the protocol's validation
    and test items (the last two) are unchanged and every order signal before them is gone.
    """
    order = protocol_order(log)
    users, items = log.users[order], log.items[order].copy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    rng = np.random.default_rng(seed)
    for s, e in zip(starts, ends - keep_last, strict=True):
        if e - s > 1:
            items[s:e] = items[s:e][rng.permutation(e - s)]
    return Log(
        users, items, log.timestamps[order], log.numeric,
        f"{log.source} (each user's order shuffled, seed {seed}, last {keep_last} kept)",
    )  # fmt: skip


def synthetic_log() -> Log:
    """The embedded default data (`configs/default.yaml`'s synthetic section, its defaults)."""
    from recsys import synthetic
    from recsys.core.config import SyntheticConfig

    rows = synthetic.generate(SyntheticConfig())
    users, items, stamps, _ = (np.array(c) for c in zip(*rows, strict=True))
    return Log(
        users.astype(str), items.astype(str), stamps.astype(np.int64), False,
        "synthetic (recsys.synthetic, the default data: 2,000 users, 1,000 items)",
    )  # fmt: skip


def _pick(header: list[str], names: tuple[str, ...], path: Path) -> str:
    for name in names:
        if name in header:
            return name
    raise ValueError(f"{path}: no column named any of {names} in the header {header}")


def protocol_order(log: Log) -> np.ndarray:
    """Row order by (user, timestamp, item id): numeric item ids when they all are integers."""
    item_key = log.items.astype(np.int64) if log.numeric else log.items
    return np.lexsort((item_key, log.timestamps, log.users))


@dataclass
class Split:
    """Leave-last-out split in catalog index space (items) and user order (users)."""

    users: list[str]  # every user with a training row, sorted
    catalog: list[str]  # every item of a non-test row, sorted (numeric when ids are)
    train: list[np.ndarray]  # per user: catalog indices of training items, protocol order
    validation: dict[int, int]  # user index -> catalog index of the validation item
    test: dict[int, int]  # user index -> catalog index of the test item (-1: outside catalog)
    test_rows: np.ndarray  # bool per log row: the row is a test item
    numeric: bool
    validation_rows: np.ndarray | None = None  # bool per log row: a validation item

    def sequence(self, user: int, with_validation: bool) -> np.ndarray:
        """The user's items in protocol order (training, then the validation item if asked)."""
        seq = self.train[user]
        if with_validation and user in self.validation:
            seq = np.append(seq, self.validation[user])
        return seq


def leave_last_out(log: Log, min_interactions: int = 5) -> Split:
    """The protocol's split: last item test, the one before validation (users with >= N)."""
    order = protocol_order(log)
    users, items = log.users[order], log.items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    role = np.zeros(len(users), np.int8)  # 0 train, 1 validation, 2 test
    eligible = (ends - starts) >= min_interactions
    role[ends[eligible] - 1] = 2
    role[ends[eligible] - 2] = 1
    kept = np.unique(items[role < 2])
    catalog = sorted(kept.tolist(), key=int) if log.numeric else sorted(kept.tolist())
    position = {item: i for i, item in enumerate(catalog)}
    index = np.array([position.get(i, -1) for i in items], np.int64)
    user_names = users[starts].tolist()
    train, validation, test = [], {}, {}
    for u, (s, e) in enumerate(zip(starts, ends, strict=True)):
        r = role[s:e]
        train.append(index[s:e][r == 0])
        if (r == 1).any():
            validation[u] = int(index[s:e][r == 1][0])
            test[u] = int(index[s:e][r == 2][0])
    test_rows = np.zeros(len(order), bool)
    test_rows[order[role == 2]] = True
    validation_rows = np.zeros(len(order), bool)
    validation_rows[order[role == 1]] = True
    return Split(
        user_names, catalog, train, validation, test, test_rows, log.numeric, validation_rows
    )


def eval_set(split: Split, stage: str) -> tuple[list[int], ev.EvalSet]:
    """(user indices, EvalSet) of the validation or test stage, in `recsys.evaluation` form."""
    targets = split.validation if stage == "validation" else split.test
    rows = sorted(targets)
    exclude = [
        np.unique(split.sequence(u, with_validation=stage == "test")) for u in rows
    ]  # the target itself is never excluded: a repeat of a known item stays rankable
    exclude = [e[e != targets[u]] for e, u in zip(exclude, rows, strict=True)]
    data = ev.EvalSet(
        [split.users[u] for u in rows],
        np.array([targets[u] for u in rows], np.int64),
        exclude,
        len(split.catalog),
    )
    return rows, data


def interactions(split: Split, rows: list[int], with_validation: bool) -> tuple[np.ndarray, ...]:
    """(row positions, catalog indices) of the given users' known items, for sparse matrices."""
    r, c = [], []
    for pos, u in enumerate(rows):
        seq = split.sequence(u, with_validation)
        r.append(np.full(len(seq), pos))
        c.append(seq)
    if not r:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(r).astype(np.int64), np.concatenate(c).astype(np.int64)
