"""The package graph: no import cycle anywhere in our code (the layers are `lint-imports`')."""

import graphlib

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
