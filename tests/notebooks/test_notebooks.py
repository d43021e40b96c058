"""The notebooks under notebooks/: each jupytext .py runs top to bottom (its own assert cells pass)
in a python3 kernel on this venv's interpreter, and its paired .ipynb has the same cells and no outputs."""
import glob
import os
import sys

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

from tests.repo import REPO
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.py")))
IDS = [os.path.basename(p) for p in NOTEBOOKS]


def _cells(nb):
    return [(c.cell_type, c.source) for c in nb.cells]


def test_notebooks_exist():
    assert NOTEBOOKS, "no notebooks/*.py found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_pair_in_sync_and_outputs_stripped(path):
    ipynb = path[:-3] + ".ipynb"
    assert os.path.exists(ipynb), f"{ipynb} missing: run `jupytext --sync {os.path.relpath(path, REPO)}`"
    paired = nbformat.read(ipynb, as_version=4)
    assert _cells(paired) == _cells(jupytext.read(path)), f"{ipynb} and {path} differ: run jupytext --sync"
    for cell in paired.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{ipynb} has outputs: clear them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("K3JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = jupytext.read(path)
    probe = nbformat.v4.new_code_cell("import sys; print(sys.executable)")
    nb.cells.insert(0, probe)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()
    # jupyter_client swaps the kernelspec's bare "python" for sys.executable: the venv's interpreter.
    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable
