"""debug.first_nonfinite, debug.underflow_report, the demo's extras guard (explain:
tests/test_explain.py)."""

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import marked_line, shown_path

import amp_jax
from amp_jax import amp, debug, full_precision

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (toy shapes: lower every matmul, whatever its size)
# (and float32 matmul results on every backend: GPUs write bf16/f16 by default)
F16 = amp_jax.Policy(jnp.float16, min_low_contraction=0, min_low_flops=0, allow_outputs="float32")
# how explain and first_nonfinite name this file
THIS = shown_path(__file__)
_line = functools.partial(marked_line, __file__)


def overflowing(x, w):
    h = x @ w  # MARK-OVERFLOW
    g = jnp.tanh(h) * 2.0
    return jnp.sum(h @ w) + jnp.sum(g)


# -- first_nonfinite ----------------------------------------------------------


def test_first_overflow_located_exactly():
    x, w = jnp.full((2, 16), 100.0), jnp.full((16, 16), 50.0)  # x @ w = 80000
    found = debug.first_nonfinite(overflowing, x, w, policy=F16)
    assert found is not None
    assert found.where.startswith(f"{THIS}:{_line('MARK-OVERFLOW')}:")
    assert "overflowing" in found.where
    assert found.primitive == "convert_element_type" and found.dtype == "float32->float16"
    assert found.cast_of.startswith("dot_general at ")
    assert found.kind == "inf" and not found.backward
    assert found.input_max_abs == pytest.approx(80000.0)
    assert found.float32_finite and found.float32_max_abs == pytest.approx(80000.0)
    assert found.dtype_max == pytest.approx(65504.0)
    assert "full_precision" in found.fix and "bfloat16" in found.fix
    # the plan's decision for the matmul whose result the cast rounds
    assert found.decision.startswith(
        "a cast amp inserted: an op reads dot_general's result in float16"
    )
    assert "allow class: runs in float16" in found.decision
    assert str(found).startswith("first non-finite value (inf) at ")


def test_clean_programs_report_nothing():
    x, w = jnp.full((2, 4), 1.0), jnp.full((4, 4), 2.0)
    assert debug.first_nonfinite(overflowing, x, w, policy=F16) is None
    assert debug.first_nonfinite(overflowing, x, w, policy=F16, grad=True) is None
    # the same overflowing inputs are fine in bfloat16 (float32's range)
    x, w = jnp.full((2, 4), 100.0), jnp.full((4, 4), 200.0)
    assert debug.first_nonfinite(overflowing, x, w, policy="bfloat16") is None


def scanned(x, w):
    def body(c, _):
        return jnp.tanh(c @ w) * 3e4 + c, None  # MARK-SCAN

    c, _ = jax.lax.scan(body, x, None, length=5)
    return jnp.sum(c)


def test_overflow_inside_scan_and_full_precision_fixes_it():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
    found = debug.first_nonfinite(scanned, x, w, policy=F16)
    assert found.where.startswith(f"{THIS}:{_line('MARK-SCAN')}:")
    assert found.cast_of.startswith("add at ")
    assert found.float32_finite and found.float32_max_abs > 65504
    # an amp function's own policy is used
    assert debug.first_nonfinite(amp(scanned, policy=F16), x, w) == found
    assert debug.first_nonfinite(amp(full_precision(scanned), policy=F16), x, w) is None


def test_float32_program_non_finite_too():
    def f(x):
        return jnp.log(x - x)  # log(0) = -inf in float32 as well

    found = debug.first_nonfinite(f, jnp.ones(3), policy=F16)
    assert found.primitive == "log" and not found.float32_finite
    assert found.decision == "deny class: numerically sensitive, runs in float32"
    assert "amp's decision: deny class" in str(found)
    assert "not a precision problem" in found.fix


def test_backward_overflow_is_marked_backward():
    def f(w, x):
        return jnp.sum(x @ w) * 1e5

    # the forward is finite (the product with 1e5 is float32); the cotangent 1e5
    # of x @ w overflows when the backward matmul reads it in float16
    f16 = dict(policy=F16)
    assert debug.first_nonfinite(f, jnp.ones((4, 4)), jnp.ones((2, 4)), **f16) is None
    found = debug.first_nonfinite(f, jnp.ones((4, 4)), jnp.ones((2, 4)), grad=True, **f16)
    assert found is not None and found.backward
    assert "loss scale" in found.fix


# -- underflow_report -----------------------------------------------------------


def test_underflow_share_and_loss_scale():
    loss = lambda p, x: 1e-7 * jnp.sum(x @ p["w"]) + jnp.sum(p["b"])
    params = {"w": jnp.ones((4, 2)), "b": jnp.ones(2)}
    x = jnp.full((3, 4), 1e-2)
    rep = debug.underflow_report(loss, params, x)
    rows = {r.path: r for r in rep.rows}
    assert rows["['w']"].flushed == 1.0 and rows["['w']"].nonzero == 8
    assert rows["['b']"].flushed == 0.0
    assert rep.flushed == pytest.approx(8 / 10)
    scaled = debug.underflow_report(loss, params, x, loss_scale=2.0**12)
    assert scaled.flushed == 0.0 and {r.path: r for r in scaled.rows}["['w']"].subnormal == 1.0
    assert "suggested loss scale" in str(rep)
    with pytest.raises(ValueError, match="loss_scale"):
        debug.underflow_report(loss, params, x, loss_scale=0.0)


# -- the demo's extras guard --------------------------------------------------------


@pytest.mark.parametrize("missing", ["tqdm", "matplotlib"])
def test_demo_names_the_extra_when_a_dependency_is_missing(missing):
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from amp_jax.demo.__main__ import main\n"
        "main(['--steps', '1'])\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert 'pip install -e ".[demo]"' in proc.stderr and f"pip install {missing}" in proc.stderr
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr


def test_doctests_of_explain_and_debug():
    import doctest
    import importlib

    for mod in (
        "amp_jax._src.diagnostics.explain",
        "amp_jax._src.diagnostics.report",
        "amp_jax._src.diagnostics.nonfinite",
        "amp_jax._src.diagnostics.underflow",
    ):
        result = doctest.testmod(importlib.import_module(mod), optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, mod


def _aux_loss(params, x):
    h = x @ params["w"]
    return jnp.mean(h @ params["w"]), {"names": ["drop"], "mean": jnp.mean(h)}


_AUX_ARGS = ({"w": jnp.ones((32, 32))}, jnp.ones((16, 32)))


def test_first_nonfinite_takes_has_aux():
    params = {"w": jnp.full((16, 16), 50.0)}
    x = jnp.full((2, 16), 100.0)  # x @ w = 80000 > float16's 65504
    found = debug.first_nonfinite(_aux_loss, params, x, grad=True, has_aux=True)
    assert found is not None and found.dtype == "float32->float16"


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_first_nonfinite_names_a_nonfinite_input(bad, grad):
    # NaN in the data: no op makes it, and it is no precision problem
    w = jnp.ones((8, 4))
    x = jnp.ones((16, 8)).at[3, 2].set(bad)
    f = lambda w, x: jnp.mean((x @ w) ** 2)
    assert not np.isfinite(amp(f, policy="float16")(w, x))
    found = debug.first_nonfinite(f, w, x, policy="float16", grad=grad)
    assert found is not None
    assert found.primitive == "input" and found.where == "argument `x[3, 2]`"
    assert found.kind == ("nan" if np.isnan(bad) else "inf")
    assert not found.float32_finite
    assert "not a precision problem" in found.fix and "not a precision problem" in str(found)


def test_first_nonfinite_names_a_nonfinite_input_inside_a_pytree():
    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4).at[1].set(jnp.inf)}
    f = lambda p, x: jnp.mean(x @ p["w"] + p["b"])
    found = debug.first_nonfinite(f, params, jnp.ones((2, 8)))
    assert found is not None and found.where == "argument `p['b'][1]`"
