"""Every notebook in notebooks/ is committed executed, with its outputs, and
runs top to bottom again here (with small sizes)."""

import os
import pathlib
import re

import pytest

# Not installed on the accelerator machine; CI installs both (the test extra).
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_found():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "flax_nnx", "pure_bf16_optimizers"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_stored_executed_with_outputs(path):
    """Committed as a reader sees them (docs/notebooks.md): every code cell run
    once, top to bottom, at the notebook's full size, its outputs kept."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{path.name}: run it top to bottom and save it with its outputs"
    )
    text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    for needle in EXPECTED[path.stem]:
        assert re.search(needle, text), f"{path.name}: no stored output matching {needle!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    env = {
        **os.environ,
        "AMP_JAX_NB_STEPS": "12",
        "JUPYTER_PLATFORM_DIRS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("XLA_FLAGS", None)  # the conftest's forced host devices are not for notebooks
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for needle in EXPECTED[path.stem]:
        assert re.search(needle, text), f"{path.name}: no output matching {needle!r}"


#: what each notebook must show it did (its printed dtype reports and results)
EXPECTED = {
    "quickstart": [r"dot_general\s.*bfloat16,bfloat16", r"'w1': 'float32'"],
    "flax_nnx": [
        r"dot_general\s.*float16,float16",
        r"train accuracy: float32 [\d.]+, amp float16 [\d.]+",
    ],
    "pure_bf16_optimizers": [r"[Kk]ahan", r"[Ss]tochastic", r"state bytes/param"],
}
