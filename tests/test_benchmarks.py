"""Every maintained benchmark runs at its ``--smoke`` size and prints its tables.

Not timings: each benchmark's ``main(argv)`` runs in this process at a tiny
size (no results file written) and its Markdown report must hold the table
it exists for, with the expected columns and a row per model and variant.
Marked ``heavy``: only the newest-JAX leg runs them (noxfile.py). The one-off
studies (benchmarks/studies/) only have to import.
"""

from __future__ import annotations

import importlib
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU = jax.default_backend() == "cpu"


def tables(text: str) -> list[list[list[str]]]:
    """The Markdown tables of ``text``: rows of cells, header first, rule dropped."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-:") for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def table_with(text: str, *columns: str) -> list[list[str]]:
    """The first table whose header starts with ``columns``."""
    for t in tables(text):
        if tuple(t[0][: len(columns)]) == columns:
            return t
    raise AssertionError(f"no table with columns {columns} in:\n{text}")


def run(name: str, *argv: str) -> str:
    text = importlib.import_module(f"benchmarks.{name}").main(["--smoke", *argv])
    assert isinstance(text, str) and text.strip(), name
    return text


def first_column(table: list[list[str]]) -> list[str]:
    return [row[0] for row in table[1:]]


def run_plain(name: str) -> str:
    return importlib.import_module(f"benchmarks.{name}").main([])


heavy = pytest.mark.heavy


@heavy
def test_run():
    text = run("run")
    speed = [t for t in tables(text) if t[0][:3] == ["variant", "step ms", "vs f32"]]
    assert len(speed) == 3  # mlp, gpt, cnn
    assert all(first_column(t) == ["f32", "amp"] for t in speed)
    assert {"### mlp", "### gpt", "### cnn"} <= {ln.split(":")[0] for ln in text.splitlines()}
    assert table_with(text, "target", "measured", "met")


@heavy
def test_trace_cost():
    t = table_with(run("trace_cost"), "depth", "f32 eqns", "f32 s", "amp s", "amp / f32")
    assert first_column(t) == ["1", "2"]
    assert t[0][-2:] == ["explain s", "explain / amp"]
    assert int(t[2][1]) > int(t[1][1]) > 0  # the program grows with the depth


@heavy
def test_compile_time():
    text = run("compile_time")
    t = table_with(text, "variant", "trace s", "lower s", "compile s (CPU s)")
    assert first_column(t) == ["f32", "amp"]
    assert first_column(table_with(text, "depth", "f32 eqns", "amp eqns")) == ["2"]


@heavy
def test_peers():
    pytest.importorskip("equinox")
    t = table_with(run("peers"), "variant", "step ms", "step vs f32")
    assert first_column(t) == ["f32", "amp", "hand"]
    assert all(row[1][0].isdigit() for row in t[1:]), t  # no variant raised


@heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="8 devices (conftest forces 8 host ones)")
def test_collectives():
    t = table_with(run("collectives"), "layout", "mode", "float32 program")
    assert [row[1] for row in t[1:]] == ["auto", "explicit"]


@heavy
@pytest.mark.skipif(not CPU, reason="memory_analysis of the host compiler")
def test_eager_memory():
    text = run("eager_memory")
    t = table_with(text, "optimizer", "variant", "params MiB")
    assert {row[0] for row in t[1:]} == {"sgd(momentum=0.9)", "adam", "kahan(adam)", "adamw 8bit"}
    assert table_with(text, "optimizer", "variant", "temp MiB", "peak MiB", "bound MiB")


@heavy
def test_dot_thresholds():
    t = table_with(run("dot_thresholds"), "m x k x n", "FLOPs", "f32 us")
    assert len(t) == 3


@heavy
def test_float8_numerics():
    t = table_with(run("float8_numerics"), "model", "policy", "loss rel err", "grad rel err")
    assert [row[1] for row in t[1:]] == ["bfloat16", "float8", "float8_rowwise"]


@heavy
def test_quantized_states(tmp_path):
    t = table_with(run("quantized_states", "--out", str(tmp_path)), "seed", "states")
    assert first_column(t) == ["0", "0"] and t[1][1] == "float32 AdamW"
    assert (tmp_path / "QUANTIZED_STATES.md").exists()


def test_optim_bytes():  # no sizes to shrink: the table of docs/optim.md, from eval_shape
    text = run_plain("optim_bytes")
    assert "float32 AdamW" in first_column(table_with(text, "scheme", "weights", "gradients"))


STUDIES = sorted(p.stem for p in (ROOT / "benchmarks" / "studies").glob("[!_]*.py"))


@pytest.mark.parametrize("name", STUDIES)
def test_studies_import_and_name_their_results(name):
    module = importlib.import_module(f"benchmarks.studies.{name}")
    first = module.__doc__.splitlines()[0]
    assert first.startswith("Frozen study; its results: benchmarks/"), first
    assert callable(module.main)


def test_every_benchmark_is_smoke_tested_and_in_the_readme():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    here = pathlib.Path(__file__).read_text()
    for path in (ROOT / "benchmarks").glob("[!_]*.py"):
        if path.stem == "torch_peer":  # imported by run.py on a GPU with PyTorch
            continue
        assert f"python -m benchmarks.{path.stem}" in readme, path.stem
        assert f'"{path.stem}"' in here, f"{path.stem} has no smoke test"
    for name in STUDIES:
        assert f"benchmarks/studies/{name}.py" in readme, name
