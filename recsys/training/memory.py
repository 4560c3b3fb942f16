"""Training's memory estimate, checked before anything is allocated.

A config typo (`embedding_dim: 10000000`, a huge `batch_size`, millions of `oov_buckets`)
must be a config error naming the value, not a process that grows past the machine's memory
and is OOM-killed minutes later. The estimate counts the big float32 buffers only:

- embedding tables: (users + oov) x d and (items + oov) x d, plus the hidden layers;
- optimizer slots and gradients: Adam keeps m and v per weight, Adagrad one accumulator, and
  tf_keras Adam rewrites every row of its slots each step, so one more table-sized gradient
  buffer;
- logits block: the in-batch softmax scores r x b logits at a time (r = min(b, BLOCK_ROWS);
  the whole b x b without the blocked loss); the `mixed` and `full` negatives score b x (b +
  pool) and b x items at once; with softmax and gradient, 3 copies;
- tower activations: b x d per tower and per hidden layer, forward and backward; the
  transformer encoder adds b x L x d per layer (x 8: attention, MLP, norms, backward) and its
  b x heads x L x L attention weights; the GRU adds its 3 gates per step, b x L x 3d, kept
  for backpropagation through time (x 4: input and recurrent projections, their gradients).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from recsys.core.auto import DataShape
from recsys.core.auto import negatives as auto_negatives
from recsys.core.config import RecsysConfig
from recsys.core.errors import ConfigError
from recsys.losses import BLOCK_ROWS

FLOAT = 4  # bytes of float32
GIB = 1 << 30
# cgroup v2, then v1: a container's limit is what the OOM killer enforces, not the host's RAM.
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)
USABLE_SHARE = 0.8  # TensorFlow, the input pipeline and Python need the rest


def estimate(config: RecsysConfig, users: int, items: int, examples: int) -> dict[str, int]:
    """Bytes of each large training buffer (see the module docstring), by name."""
    m, t = config.model, config.training
    d = m.embedding_dim
    widths = [d, *m.hidden_dims]
    dense = sum(a * b for a, b in itertools.pairwise(widths)) * 2
    user_rows = 0 if m.user_embedding is False else users + m.oov_buckets  # auto: maybe on
    tables = (user_rows + (items + m.oov_buckets)) * d + dense
    slots = 1 if t.optimizer == "adagrad" else 2
    batch = max(1, min(t.batch_size, examples or t.batch_size))
    negatives = auto_negatives(DataShape(items, 0.0))[0] if m.negatives == "auto" else m.negatives
    columns = {"full": items, "mixed": batch + m.sampled_negatives}.get(negatives, batch)
    blocked = m.num_hard_negatives is None and negatives == "in_batch"
    rows = min(batch, BLOCK_ROWS) if blocked else batch
    activations = batch * sum(widths) * 2 * 2
    if m.query_encoder == "transformer":
        length = m.history_length
        activations += m.encoder_layers * batch * length * (8 * d + m.encoder_heads * length)
    elif m.query_encoder == "gru":
        activations += batch * m.history_length * 3 * d * 4
    return {
        "embedding tables": tables * FLOAT,
        "optimizer slots and gradients": tables * (slots + 1) * FLOAT,
        "logits block": rows * columns * 3 * FLOAT,
        "tower activations": activations * FLOAT,
    }


def limit_bytes() -> int:
    """The memory this process may use: physical memory, or the cgroup's limit if lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def check_memory(
    config: RecsysConfig, users: int, items: int, examples: int, limit: int | None = None
) -> dict[str, int]:
    """The estimate, or ConfigError naming the setting to lower when it exceeds the machine."""
    parts = estimate(config, users, items, examples)
    total = sum(parts.values())
    usable = int((limit_bytes() if limit is None else limit) * USABLE_SHARE)
    if total <= usable:
        return parts
    biggest = max(parts, key=parts.__getitem__)
    detail = ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items())
    raise ConfigError(
        f"training would need about {total / GIB:.1f} GiB ({detail} GiB) for {users:,} users "
        f"and {items:,} items, above the {usable / GIB:.1f} GiB usable here; nothing was "
        f"allocated. The largest part is the {biggest}: lower {_setting(config, biggest)}"
    )


def _setting(config: RecsysConfig, part: str) -> str:
    """The config values that drive one part of the estimate, as the message names them."""
    m, t = config.model, config.training
    if part == "logits block" and m.negatives != "in_batch":
        return f"training.batch_size ({t.batch_size}) or model.negatives ({m.negatives})"
    if part in ("logits block", "tower activations"):
        return f"training.batch_size ({t.batch_size}) or model.embedding_dim ({m.embedding_dim})"
    return f"model.embedding_dim ({m.embedding_dim}) or model.oov_buckets ({m.oov_buckets})"
