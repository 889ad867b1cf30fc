"""``explain`` on whole models and on third-party modules (Flax, Equinox): its
counts agree with the jaxpr and the HLO, its rows fit the terminal. The units
of explain are tested in tests/test_explain.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import eqns_run

import amp_jax
from amp_jax import amp


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


@pytest.mark.parametrize("wrap", [False, True], ids=["module", "amp_module"])
def test_explain_an_equinox_module_as_the_function(wrap):
    # the module is the function: its arrays are arguments, as amp(model) traces them
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(64, 64, key=jax.random.PRNGKey(0))
    ex = amp_jax.explain(amp(model) if wrap else model, jnp.ones((64,)))
    dots = {(r.dtype, r.reason) for r in ex.rows if r.primitive == "dot_general"}
    assert [d for d, _ in dots] == ["bfloat16"], dots
    assert "no amp decision" not in next(iter(dots))[1]
