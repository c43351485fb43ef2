"""The notebooks in notebooks/ run top to bottom, so they never rot.

Each is executed by nbclient in a fresh ipykernel, from its own directory, with a timeout per
cell. The notebooks are already small (tiny models, short batches), so they run as committed,
with no special "test mode"; their own `assert` cells check what they claim (every layout
reproduces the one-device losses, masked tokens get zero advantage and zero gradient, ...)
and an assertion error fails the test. The kernel gets the test process's environment minus
XLA_FLAGS (conftest.py sets 8 simulated devices), so notebooks 01-03 see the one CPU device a
user has and notebook 04 must set the device-count flag itself, before importing JAX.

Committed notebooks carry no outputs (small diffs, no stale figures); a test checks that too.
"""
import os
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = ["01_quickstart.ipynb", "02_swap_losses.ipynb", "03_credit_assignment.ipynb", "04_scale_out.ipynb"]
CELL_TIMEOUT_S = 300


def _kernel_env() -> dict:
    # MPLBACKEND is dropped too: the kernel's own inline backend turns figures into image/png.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MPLBACKEND")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    return env


def _execute(name: str) -> tuple[nbformat.NotebookNode, float]:
    nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": NB_DIR}})
    t0 = time.perf_counter()
    client.execute(env=_kernel_env())  # raises CellExecutionError naming the failing cell
    return nb, time.perf_counter() - t0


def _outputs(nb, kind: str) -> list[str]:
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "stream" and out.get("output_type") == "stream":
                found.append(out["text"])
            elif kind in out.get("data", {}):
                found.append(out["data"][kind])
    return found


def test_every_notebook_is_listed_and_stored_without_outputs():
    on_disk = sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb"))
    assert on_disk == sorted(NOTEBOOKS), "add new notebooks to NOTEBOOKS so they are executed"
    for name in NOTEBOOKS:
        nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3", name
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name}: clear outputs before committing"


@pytest.mark.slow
def test_01_quickstart_colours_policy_and_observation_tokens():
    nb, seconds = _execute("01_quickstart.ipynb")
    html = "\n".join(_outputs(nb, "text/html"))
    # rich's styles from agent.evaluation.render_trajectory: bold green (policy), dim (masked)
    assert "#008000" in html and "font-weight: bold" in html and "#7f7f7f" in html
    text = "\n".join(_outputs(nb, "stream"))
    assert "reference fix" in text and "reward 1.0" in text
    print(f"01_quickstart: {seconds:.1f}s", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS[1:])
def test_notebook_runs(name):
    nb, seconds = _execute(name)
    assert _outputs(nb, "image/png") or name == "04_scale_out.ipynb", f"{name} drew no figure"
    print(f"{name}: {seconds:.1f}s", file=sys.stderr)
