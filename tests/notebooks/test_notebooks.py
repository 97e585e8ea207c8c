"""The research notebooks in ``notebooks/`` execute without error and show their plots.

Each notebook runs top to bottom in a fresh kernel of *this* interpreter (a kernelspec written
to a temporary directory and put first on ``JUPYTER_PATH``, so no user-installed ``python3``
kernel pointing at another Python can be picked up), with ``notebooks/`` as the working
directory. A cell that raises fails the test with the cell's traceback. The notebooks are
committed without outputs; that is checked too (cheap, not slow).
"""

import json
import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))
KERNEL = "fmoe-notebooks-test"


def test_the_six_notebooks_exist():
    assert NOTEBOOKS == ["01_write_a_router.ipynb", "02_expert_parallel_layout.ipynb",
                         "03_compare_routers.ipynb", "04_transforms.ipynb", "05_load_balancing.ipynb",
                         "06_routing_research.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{name}: code cells {dirty} carry outputs; clear them before committing"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fmoe test kernel", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # a notebook's torch.compile runs Dynamo + AOTAutograd (aot_eager), not Inductor's code generation,
    # as the transform matrix's compile cells do (Inductor compiles an MoE model in test_compile.py)
    monkeypatch.setenv("TORCH_COMPILE_OVERRIDE_BACKENDS", ">=0:aot_eager")
    # 03 trains five routing schemes for 300 steps by default (its curves); 60 run every cell alike
    monkeypatch.setenv("FMOE_NB03_STEPS", "60")
    return KERNEL


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=900,
                            resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()                       # raises CellExecutionError with the cell's traceback
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{name} showed no plot"
