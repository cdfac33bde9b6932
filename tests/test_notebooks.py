"""Every notebook in notebooks/ runs clean, top to bottom, in a fresh kernel on the CPU (as
a reader would run it), and is stored without outputs."""

import importlib
import pathlib
import re

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_readme_links_every_notebook():
    readme = (NOTEBOOKS[0].parents[1] / "README.md").read_text()
    linked = set(re.findall(r"\(notebooks/([\w-]+\.ipynb)\)", readme))
    assert linked == {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    # Imported here, so that a run of other tests (e.g. -m gpu) collects without the extras.
    nbformat, nbclient = (_test_extra(name) for name in ("nbformat", "nbclient"))
    notebook = nbformat.read(path, as_version=4)
    stored = [i for i, cell in enumerate(notebook.cells)
              if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))]
    assert not stored, f"{path.name}: cells {stored} keep outputs; strip them before committing"
    # The kernel runs the venv's own Python (jupyter_client swaps "python" for sys.executable),
    # in a scratch directory: what a notebook writes stays out of the repository.
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()


def _test_extra(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} is not installed: pip install '.[test]' brings it")
