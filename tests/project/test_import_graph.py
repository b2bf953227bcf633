"""attnlab's modules import each other one way: no cycle, lazy imports included.

``tools/import_graph.py`` draws the graph; a function-local import is still a dependency
(it only moves the moment it happens), and only ``if TYPE_CHECKING:`` imports are left out.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "import_graph", ROOT / "tools" / "import_graph.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return _tool()


def test_attnlab_has_no_import_cycle(tool):
    graph = tool.build_graph(ROOT / "src")
    assert "attnlab.models.decoder" in graph.modules
    found = tool.cycles(graph.all_edges())
    assert found == [], "import cycles (python tools/import_graph.py draws them): " + "; ".join(
        ", ".join(c) for c in found
    )


def test_the_lowest_modules_import_nothing_above_them(tool):
    graph = tool.build_graph(ROOT / "src")
    edges = graph.all_edges()
    assert edges["attnlab.paths"] == set()
    assert edges["attnlab.native"] == {"attnlab.paths"}
    assert edges["attnlab.models.mlp"] == set()


def test_the_tool_finds_a_cycle_through_a_lazy_import_but_not_a_type_checking_one(tool, tmp_path):
    pkg = tmp_path / "attnlab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from attnlab.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from attnlab import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import d\n"
        "if TYPE_CHECKING:\n"
        "    from attnlab import a\n"
    )
    (pkg / "d.py").write_text("if TYPE_CHECKING:\n    import attnlab.c\n")
    graph = tool.build_graph(tmp_path)
    assert tool.cycles(graph.all_edges()) == [["attnlab.a", "attnlab.sub.b"]]
    assert graph.local_counts == {"attnlab.sub.b": 1}
    assert graph.edges["attnlab.c"] == {"attnlab.d"}
    dot = tool.to_dot(graph)
    assert '"attnlab.sub.b" -> "attnlab.a" [style=dashed];' in dot


def test_areas_merge_a_subpackage_and_keep_only_the_edges_between_areas(tool, tmp_path):
    pkg = tmp_path / "attnlab"
    (pkg / "models" / "decode").mkdir(parents=True)
    for init in (pkg, pkg / "models", pkg / "models" / "decode"):
        (init / "__init__.py").write_text("")
    (pkg / "masks.py").write_text("")
    (pkg / "models" / "a.py").write_text("from attnlab.models.decode import b\n")
    (pkg / "models" / "decode" / "b.py").write_text("from attnlab import masks\n")
    areas = tool.by_area(tool.build_graph(tmp_path))
    assert set(areas.modules) == {"attnlab", "attnlab.masks", "attnlab.models"}
    assert areas.all_edges()["attnlab.models"] == {"attnlab.masks"}  # not itself
    assert tool.cycles(areas.all_edges()) == []
