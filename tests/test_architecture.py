"""The package graph: no import cycle anywhere in our code (the layers are `lint-imports`').

And the one environment setting TensorFlow reads at its first import reaches every entry point.
"""

import graphlib
import os
import subprocess
import sys

import grimp
import pytest

PACKAGES = ("conductor", "beam_jobs", "serving_export", "recsys")


def import_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One cycle a -> b -> ... -> a of module imports, or None when the graph has none."""
    order = graphlib.TopologicalSorter(
        {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    )
    try:
        order.prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


@pytest.fixture
def graph() -> grimp.ImportGraph:
    """Our four packages' import graph, top-level and function-local imports alike."""
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_no_import_cycle(graph: grimp.ImportGraph) -> None:
    """A cycle hides the data flow and the layer a module belongs to."""
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_cycle_check_finds_a_cycle(graph: grimp.ImportGraph) -> None:
    """The check is not vacuous: one import back up the layers is reported as a cycle."""
    graph.add_import(importer="recsys.core.layout", imported="conductor.stages")
    cycle = import_cycle(graph)
    assert cycle is not None and "conductor.stages" in cycle


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter whose environment has no TF_USE_LEGACY_KERAS."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_selects_keras_2_before_any_module_runs(package: str) -> None:
    """Each package's __init__ sets TF_USE_LEGACY_KERAS (recsys.core.tf_env): any entry works."""
    code = f"import os, {package}; print(os.environ.get('TF_USE_LEGACY_KERAS'))"
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1"


def test_tensorflow_imported_by_the_model_uses_tf_keras() -> None:
    """The model module imports TensorFlow at its top: Keras is still Keras 2 (tf_keras)."""
    done = _fresh_python("import recsys.model, tensorflow as tf; print(tf.keras.__name__)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("tf_keras"), done.stdout
