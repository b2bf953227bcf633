"""The tutorial notebook (docs/tutorial.ipynb) is stored without outputs and runs clean.

It follows the seed text section by section and asserts its own numbers against attnlab
(``torch.testing.assert_close``), so running it checks the tutorial's claims.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"


def test_notebook_is_stored_without_outputs() -> None:
    nbformat = pytest.importorskip("nbformat", reason="needs the [docs] extra")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the tutorial has no code"
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} keep outputs: clear them before committing"


def test_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat", reason="needs the [docs] extra")
    nbclient = pytest.importorskip("nbclient", reason="needs the [docs] extra")
    pytest.importorskip("ipykernel", reason="needs the [docs] extra")
    # The kernel is another process: give it this checkout's sources and no display.
    src = str(ROOT / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the cell on any failure
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the tutorial's figures did not render"
    text = "".join(str(o.get("data", {}).get("text/plain", o.get("text", ""))) for o in outputs)
    for printed in ("0.4306, 1.4551", "0.3061, 0.8210", "-0.0739", "all backends agree"):
        assert printed in text, f"the tutorial no longer shows {printed!r}"
