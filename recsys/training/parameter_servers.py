"""`training.strategy: parameter_server`: embedding tables sharded over parameter-server tasks.

TF_CONFIG names a `chief` (the coordinator: it runs `recsys train`, builds the model and
schedules steps), `worker` tasks (they run the steps on their own input pipelines) and `ps`
tasks (they hold the variables). Each variable of at least `ps_min_shard_bytes` is split in
row ranges over up to one shard per PS task (`MinSizePartitioner`): an embedding lookup then
reads, and its sparse gradient updates, only the shards holding the batch's rows. Workers
and PS tasks serve until they are stopped (docs/TRAINING.md "Parameter servers").
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import tensorflow as tf

from recsys.core.errors import ConfigError

log = logging.getLogger(__name__)

SERVING_TASKS = ("worker", "ps")


def cluster_resolver() -> tf.distribute.cluster_resolver.TFConfigClusterResolver:
    """TF_CONFIG's cluster; a ConfigError unless it has a chief, workers and PS tasks."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON with a cluster spec: {exc}") from None
    missing = [job for job in ("chief", "worker", "ps") if not cluster.get(job)]
    if missing:
        raise ConfigError(
            "training.strategy parameter_server needs TF_CONFIG naming a chief, workers and "
            f"ps tasks; it has no {', '.join(missing)}"
        )
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def serve(resolver: tf.distribute.cluster_resolver.ClusterResolver) -> None:
    """Run this worker or PS task's server until the process is stopped (never returns)."""
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    log.info("%s %d serving the parameter-server cluster", resolver.task_type, resolver.task_id)
    server.join()


def parameter_server_strategy(
    min_shard_bytes: int,
) -> tf.distribute.experimental.ParameterServerStrategy:
    """The coordinator's strategy; on a worker or PS task this serves instead (no return)."""
    resolver = cluster_resolver()
    if resolver.task_type in SERVING_TASKS:
        serve(resolver)
    num_ps = resolver.cluster_spec().num_tasks("ps")
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=min_shard_bytes, max_shards=num_ps
    )
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner
    )


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
    """Whether steps are scheduled on remote workers (fit needs steps_per_epoch, a creator)."""
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def per_worker_dataset(
    make: Callable[[], tf.data.Dataset],
) -> tf.keras.utils.experimental.DatasetCreator:
    """Each worker builds and repeats its own input pipeline (read from the shared data dir).

    Workers pull steps as they are free, so an epoch is `steps_per_epoch` steps taken by
    whichever worker is idle; each pipeline shuffles with its own unseeded order, so the
    workers do not train the same batches in lock-step.
    """
    return tf.keras.utils.experimental.DatasetCreator(lambda _context: make().repeat())
