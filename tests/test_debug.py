"""explain, debug.first_nonfinite, debug.underflow_report, the demo's extras guard."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import eqns_run

import amp_jax
from amp_jax import amp, debug, full_precision

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (toy shapes: lower every matmul, whatever its size)
# (and float32 matmul results on every backend: GPUs write bf16/f16 by default)
F16 = amp_jax.Policy(jnp.float16, min_low_contraction=0, min_low_flops=0, allow_outputs="float32")
BF16_F32OUT = amp_jax.Policy(jnp.bfloat16, allow_outputs="float32")
HERE = pathlib.Path(__file__).read_text().splitlines()
# how explain and first_nonfinite name this file: relative to the working directory
THIS = os.path.relpath(__file__) if __file__.startswith(os.getcwd() + os.sep) else __file__


def _line(marker):
    """1-based line number of the source line holding ``marker`` in this file."""
    (n,) = [i + 1 for i, t in enumerate(HERE) if marker in t and "_line(" not in t]
    return n


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


# -- explain ----------------------------------------------------------------------


def small(w, x):
    y = x @ w  # MARK-DOT
    z = jnp.exp(y)  # MARK-EXP
    return jnp.sum(full_precision(lambda a: a @ w)(z))  # MARK-FP


def test_explain_reasons_dtypes_and_casts():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    ex = amp_jax.explain(small, w, x, policy=BF16_F32OUT)
    by = {(int(r.where.split(":")[1]), r.primitive): r for r in ex.rows if r.where.startswith(THIS)}
    dot = by[(_line("MARK-DOT"), "dot_general")]
    assert (
        dot.dtype == "bfloat16"
        and dot.reason.startswith("allow class")
        and dot.flops == 2 * 4 * 8 * 8
    )
    exp = by[(_line("MARK-EXP"), "exp")]
    assert exp.dtype == "float32" and exp.reason.startswith("deny class")
    fp = by[(_line("MARK-FP"), "dot_general")]
    assert fp.dtype == "float32" and "full_precision" in fp.reason
    casts = by[(_line("MARK-DOT"), "convert_element_type")]
    assert (
        casts.dtype == "float32->bfloat16"
        and casts.reason == "cast inserted by amp"
        and casts.count == 2
    )
    s = ex.summary
    assert s.casts_inserted == 2 and s.matmul_flops_by_dtype == {"bfloat16": 512, "float32": 512}
    assert s.low_matmul_flop_share == 0.5
    text = str(ex)
    assert "allow: runs in bfloat16" in text and "50.0% of matmul/conv FLOPs" in text
    assert "allow class: runs in bfloat16" in ex.format(verbose=True)
    html = ex._repr_html_()
    assert "<table>" in html and "cast inserted by amp" in html
    ident = amp_jax.explain(small, w, x, policy="float32")
    assert ident.summary.casts_inserted == 0 and ident.summary.low_flop_share == 0.0
    assert ident.summary.bytes_saved == 0


def test_explain_scan_multiplies_and_grad_has_backward_rows():
    def f(w, xs):
        def body(c, x):
            with jax.named_scope("layer"):
                return jnp.tanh(c @ w) + x, None

        c, _ = jax.lax.scan(body, xs[0], xs)
        return jnp.sum(c)

    w = jnp.ones((8, 8))
    one = amp_jax.explain(f, w, jnp.ones((1, 4, 8)))
    five = amp_jax.explain(f, w, jnp.ones((5, 4, 8)))
    assert (
        five.summary.matmul_flops_by_dtype["bfloat16"]
        == 5 * one.summary.matmul_flops_by_dtype["bfloat16"]
    )
    g = amp_jax.explain(f, w, jnp.ones((5, 4, 8)), grad=True)
    dots = [r for r in g.rows if r.primitive == "dot_general"]
    assert {r.backward for r in dots} == {False, True}
    # (``c @ w`` computes the scan's carry: it writes float32, under amp's keep scope)
    assert all(r.scope.split("/")[0] == "layer" and r.dtype == "bfloat16" for r in dots)
    # each backward row gives its forward's reason (the same op, differentiated)
    forward = {r.reason for r in dots if not r.backward}
    assert {r.reason for r in dots if r.backward} == {f"backward of: {x}" for x in forward}
    with pytest.raises(TypeError, match="grad must be"):
        amp_jax.explain(f, w, jnp.ones((5, 4, 8)), grad="yes")


def _dense(w, x):
    return x @ w  # one source line for both layers, as a library layer's is


def test_explain_tells_one_source_line_apart_by_named_scope():
    """A layer called inside and outside a ``full_precision_scopes`` scope: the two
    dots share a source line and differ only by scope (a Flax Dense installed in a
    virtualenv, whose site-packages JAX does not hide from tracebacks)."""

    def f(w1, w2, x):
        h = jnp.tanh(_dense(w1, x))
        with jax.named_scope("head"):
            return jnp.sum(_dense(w2, h))

    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((8, 64))
    policy = amp_jax.Policy(full_precision_scopes=("head",), allow_outputs="float32")
    for grad in (False, True):
        ex = amp_jax.explain(f, w, w, x, policy=policy, grad=grad)
        dots = [r for r in ex.rows if r.primitive == "dot_general"]
        assert len({r.where for r in dots}) == 1, dots  # one line, told apart by scope
        head = [r for r in dots if r.scope.startswith("head")]
        body = [r for r in dots if not r.scope.startswith("head")]
        assert head and body, dots
        assert all(r.dtype == "float32" and "'head'" in r.reason for r in head), head
        assert all(r.dtype == "bfloat16" and "allow class" in r.reason for r in body), body


def _dot_flops_by_dtype(jaxpr):
    """An independent count: dot_general FLOPs per operand dtype, scan bodies x length."""
    acc = {}
    for e, _, times in eqns_run(jaxpr):
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            lhs, out = e.invars[0].aval, e.outvars[0].aval
            n = 2 * int(np.prod(out.shape)) * int(np.prod([lhs.shape[i] for i in lc]))
            d = str(lhs.dtype)
            acc[d] = acc.get(d, 0) + times * n
    return acc


def test_explain_demo_step_consistent_with_jaxpr_and_hlo():
    from amp_jax.demo import _model

    cfg = _model.Config(d_model=32, layers=1, heads=2, seq=16, batch=2)
    params = _model.init_params(jax.random.PRNGKey(0), cfg)
    x = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    ex = amp_jax.explain(_model.loss_fn, params, x, x, cfg.heads, policy="bfloat16", grad=True)
    loss = amp(_model.loss_fn, policy="bfloat16")
    grad_fn = jax.value_and_grad(lambda p: loss(p, x, x, cfg.heads))
    expected = _dot_flops_by_dtype(jax.make_jaxpr(grad_fn)(params).jaxpr)
    assert ex.summary.matmul_flops_by_dtype == expected
    assert ex.summary.matmul_flops_by_dtype.get("bfloat16", 0) > 0
    # dtype_report sees the same dot dtypes
    rows = amp_jax.dtype_report(grad_fn, params)
    report_dots = {r[1].split(",")[0] for r in rows if r[0] == "dot_general"}
    assert report_dots == set(expected)
    # the lowered StableHLO has as many bf16 dots as explain counts (one layer: scan length 1)
    hlo = jax.jit(grad_fn).lower(params).as_text()
    hlo_dots = re.findall(r"stablehlo\.dot_general.*?: \(tensor<[^>]*x(\w+)>", hlo)
    n_bf16 = sum(r.count for r in ex.rows if r.primitive == "dot_general" and r.dtype == "bfloat16")
    assert hlo_dots.count("bf16") == n_bf16 > 0


def test_explain_equinox_module():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.PRNGKey(0))
    ex = amp_jax.explain(lambda m, x: m(x), mlp, jnp.ones(8), grad=True)
    assert ex.summary.matmul_flops_by_dtype.get("bfloat16", 0) > 0
    assert ex.summary.casts_inserted > 0


@pytest.mark.parametrize("wrap", [False, True], ids=["module", "amp_module"])
def test_explain_an_equinox_module_as_the_function(wrap):
    # the module is the function: its arrays are arguments, as amp(model) traces them
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(64, 64, key=jax.random.PRNGKey(0))
    ex = amp_jax.explain(amp(model) if wrap else model, jnp.ones((64,)))
    dots = {(r.dtype, r.reason) for r in ex.rows if r.primitive == "dot_general"}
    assert [d for d, _ in dots] == ["bfloat16"], dots
    assert "no amp decision" not in next(iter(dots))[1]


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
        "amp_jax._src.diagnostics.debug",
    ):
        result = doctest.testmod(importlib.import_module(mod), optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, mod


def _aux_loss(params, x):
    h = x @ params["w"]
    return jnp.mean(h @ params["w"]), {"names": ["drop"], "mean": jnp.mean(h)}


_AUX_ARGS = ({"w": jnp.ones((32, 32))}, jnp.ones((16, 32)))


def test_explain_and_dtype_report_take_has_aux_and_the_same_options():
    ex = amp_jax.explain(_aux_loss, *_AUX_ARGS, policy="float16", grad=True, has_aux=True)
    dots = {(r.dtype, r.backward) for r in ex.rows if r.primitive == "dot_general"}
    assert dots == {("float16", False), ("float16", True)}
    rows = amp_jax.dtype_report(_aux_loss, *_AUX_ARGS, policy="float16", grad=True, has_aux=True)
    assert {r[1] for r in rows if r[0] == "dot_general"} == {"float16,float16"}
    assert sum(r[4] for r in rows if r[0] == "dot_general") >= 5  # 2 forward, the backward
    # an amp function and the raw function with policy= report the same
    f = lambda a, b: a @ b
    a = jnp.ones((64, 64))
    assert amp_jax.dtype_report(f, a, a, policy="bfloat16") == amp_jax.dtype_report(amp(f), a, a)


def test_first_nonfinite_takes_has_aux():
    params = {"w": jnp.full((16, 16), 50.0)}
    x = jnp.full((2, 16), 100.0)  # x @ w = 80000 > float16's 65504
    found = debug.first_nonfinite(_aux_loss, params, x, grad=True, has_aux=True)
    assert found is not None and found.dtype == "float32->float16"


def test_a_pair_without_has_aux_names_it():
    with pytest.raises(TypeError, match="has_aux=True"):
        amp_jax.explain(_aux_loss, *_AUX_ARGS, grad=True)


def test_explain_says_moved_more_not_negative_savings():
    f = lambda a, b: jnp.sum(a @ b)
    text = str(amp_jax.explain(f, jnp.ones((64, 8)), jnp.ones((8, 64)), policy="float16"))
    assert "saved -" not in text
    assert "more)" in text or "saved " in text
    ex = amp_jax.explain(f, jnp.ones((64, 8)), jnp.ones((8, 64)), policy="float16")
    if ex.summary.bytes_saved < 0:
        assert "B more)" in text


def test_explain_rows_fit_120_columns_with_short_paths():
    # a model from a package (Flax): its source lines live in site-packages
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(
        nnx.Linear(64, 256, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(256, 64, rngs=nnx.Rngs(1))
    )

    def loss(model, x):
        with jax.named_scope("a_rather_long_scope_name_for_the_model_body"):
            return jnp.mean(model(x) ** 2)

    ex = amp_jax.explain(loss, model, jnp.ones((8, 64)), grad=True)
    lines = str(ex).splitlines()
    table = lines[: lines.index("")]
    assert max(map(len, table)) <= 120, max(table, key=len)
    assert not any("site-packages" in l or l.startswith("/") for l in table)
    assert any(l.startswith("flax/") for l in table)  # a package's path from the package on
    assert not any("amp_" in l for l in table)  # amp's own scope names only with verbose
    full = ex.format(verbose=True).splitlines()
    assert any("site-packages" in l for l in full) and max(map(len, full)) > 120
    assert len(ex.format(width=None).splitlines()[0]) <= max(map(len, full))
