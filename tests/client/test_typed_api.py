"""The public client API's types are derived, never hand-kept: the generated files
are current, and each TowerdAPI method's annotation names its wire method's result.

That the types are *true* is tests/integration/test_typed_results.py (every answer
of a real daemon against its TypedDict); that a type checker *sees* them is
tests/typing/client_types.py, which .ci/run gives to mypy.
"""

from __future__ import annotations

import ast
import inspect

import pytest

from towerd.client import api, stubgen
from towerd.protocol.methods import METHODS


@pytest.mark.parametrize(
    ("path", "render"),
    [
        (stubgen.RESULTS_PATH, stubgen.render_results),
        (stubgen.ASYNC_API_PATH, stubgen.render_async_api),
    ],
    ids=["results.py", "aio_api.pyi"],
)
def test_generated_files_are_current(path, render):
    """Compared as syntax trees (ruff formats the written file); run
    ``python -m towerd.client.stubgen`` when this fails."""
    assert ast.dump(ast.parse(path.read_text())) == ast.dump(ast.parse(render())), (
        f"{path.name} is stale: run `python -m towerd.client.stubgen`"
    )


def test_each_method_is_annotated_with_its_wire_result():
    calls = stubgen.api_methods()
    public = {
        name
        for name, member in vars(api.TowerdAPI).items()
        if inspect.isfunction(member) and not name.startswith("_") and name != "call"
    }
    assert public == set(calls), "a TowerdAPI method calls no wire method stubgen can read"
    for name, wire in calls.items():
        annotation = inspect.signature(getattr(api.TowerdAPI, name)).return_annotation
        assert annotation == METHODS[wire].result.__name__, (name, wire)


def test_every_result_struct_has_its_typed_dict():
    from towerd.client import results

    for wire, spec in METHODS.items():
        assert spec.result.__name__ in results.__all__, wire
