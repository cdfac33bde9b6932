"""Every notebook in notebooks/ runs clean, top to bottom, in a fresh kernel on the CPU (as
a reader would run it), and is stored without outputs."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    stored = [i for i, cell in enumerate(notebook.cells)
              if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))]
    assert not stored, f"{path.name}: cells {stored} keep outputs; strip them before committing"
    # The kernel runs the venv's own Python (jupyter_client swaps "python" for sys.executable),
    # in a scratch directory: what a notebook writes stays out of the repository.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
