"""Painting as a pure function (graph in, colors out), and what decides control flow.

A ``while`` predicate, a ``cond``/``switch`` index and the loop-carried values
feeding them are computed from inputs that were not needlessly rounded: the
eqns on the way keep their original precision, and the matmuls where the
slice stops keep low operands but write float32.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F32, prim_dtypes

import amp_jax
from amp_jax import Policy, amp, dtype_report
from amp_jax._src import backends, context, control, painting
from amp_jax._src.decision import Kind, OpClass
from amp_jax._src.painting import HIGH, LOW, ORIG

X = jnp.ones((16, 32))
W = jnp.ones((32, 32))


def _colors(fn, classes_by_name, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    classes = [OpClass(classes_by_name.get(e.primitive.name, "follow")) for e in jaxpr.eqns]
    return [e.primitive.name for e in jaxpr.eqns], painting.paint(classes, jaxpr)


CLASSES = {
    "dot_general": "allow",
    "exp": "deny",
    "log": "deny",
    "reduce_sum": "deny",
    "transpose": "clear",
    "reshape": "clear",
}

PAINT_TABLE = [
    # (name, function of (x, w), expected (primitive, color) per eqn)
    (
        "follow between two matmuls is low",
        lambda x, w: jnp.tanh(x @ w) @ w,
        [("dot_general", LOW), ("tanh", LOW), ("dot_general", LOW)],
    ),
    (
        "follow after the last matmul stays as written",
        lambda x, w: jnp.tanh(x @ w),
        [("dot_general", LOW), ("tanh", ORIG)],
    ),
    (
        "deny propagates forward through follow (which reads float32)",
        lambda x, w: jnp.tanh(jnp.exp(x)) @ w,
        [("exp", HIGH), ("tanh", ORIG), ("dot_general", LOW)],
    ),
    (
        "a clear op after a float32-accumulating matmul stays as written",
        lambda x, w: (x @ w).reshape(-1),
        [("dot_general", LOW), ("reshape", ORIG)],
    ),
    (
        "a clear op feeding a matmul and a deny op stays as written",
        lambda x, w: (lambda t: (t @ x, jnp.log(t)))(x.T),
        [("transpose", ORIG), ("dot_general", LOW), ("log", HIGH)],
    ),
    (
        "a clear op feeding only a matmul is low",
        lambda x, w: x.T @ x,
        [("transpose", LOW), ("dot_general", LOW)],
    ),
]


@pytest.mark.parametrize("name,fn,expected", PAINT_TABLE, ids=[t[0] for t in PAINT_TABLE])
def test_paint_table(name, fn, expected):
    prims, colors = _colors(fn, CLASSES, X, W)
    assert list(zip(prims, colors)) == expected


def test_decision_slice_stops_at_matmuls():
    def fn(x, w):
        h = jnp.tanh(x @ w)
        return jax.lax.cond(jnp.max(h) > 0.5, lambda: h @ w, lambda: -h @ w)

    jaxpr = jax.make_jaxpr(fn)(X, W).jaxpr
    nested = [e.primitive.name == "cond" for e in jaxpr.eqns]
    kinds = [Kind.NESTED if n else Kind.OP for n in nested]
    classes = [
        None if n else OpClass(CLASSES.get(e.primitive.name, "follow"))
        for e, n in zip(jaxpr.eqns, nested)
    ]
    colors = painting.paint(classes, jaxpr)
    ctx = context.Context(amp_jax.get_policy("bfloat16"), backends.current())
    seeds = control.decision_seeds(ctx, jaxpr, ())
    kept, f32_out, reached = control.decision_slice(jaxpr, kinds, classes, colors, seeds)
    names = {jaxpr.eqns[i].primitive.name for i in kept}
    assert {"tanh", "reduce_max", "gt"} <= names and "dot_general" not in names
    assert [jaxpr.eqns[i].primitive.name for i in f32_out] == ["dot_general"]
    assert reached == set()  # stopped at the matmul, before the inputs


# -- under amp ------------------------------------------------------------------

COMPUTE_OUT = Policy(allow_outputs="compute")  # bf16 results, as on GPU


def fixed_point(w1, w2, x, tol=0.05):
    """Iterate until the residual, computed between two matmuls, is small."""

    def cond(c):
        k, _, r = c
        return (r > tol) & (k < 100)

    def body(c):
        k, x, _ = c
        d = jnp.tanh(x @ w1) - x  # between two matmuls: low, unless it decides
        return k + 1, x + 0.5 * (d @ w2), jnp.max(jnp.abs(d))

    k, x, r = jax.lax.while_loop(cond, body, (0, x, jnp.float32(jnp.inf)))
    return k, x, r


def _fixed_point_args():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    n = 64
    w1 = jax.random.normal(k1, (n, n)) / np.sqrt(n) * 0.5
    w2 = jnp.eye(n) + 0.01 * jax.random.normal(k2, (n, n))
    x = jax.random.normal(k3, (8, n))
    return w1, w2, x


def test_the_loop_decision_fixed_point_paints_each_body_once(monkeypatch):
    # (the fixed point widens the carried decisions r -> x over several
    # rounds; each round reuses the body's painting, and the plan reuses it too)
    painted = collections.Counter()
    paint = painting.paint

    def counting(classes, jaxpr, **kw):
        painted[id(jaxpr)] += 1
        return paint(classes, jaxpr, **kw)

    monkeypatch.setattr(painting, "paint", counting)
    jaxpr = jax.make_jaxpr(amp(fixed_point, policy=COMPUTE_OUT))(*_fixed_point_args())
    assert len(painted) >= 3  # the outer jaxpr, the while's cond and body
    assert set(painted.values()) == {1}
    # and the decisions are those of test_while_residual_is_computed_in_float32
    assert [outs for _, outs, _ in prim_dtypes(jaxpr, "dot_general")] == [(F32,), (F32,)]


def test_while_residual_is_computed_in_float32():
    args = _fixed_point_args()
    jaxpr = jax.make_jaxpr(amp(fixed_point, policy=COMPUTE_OUT))(*args)
    dots = prim_dtypes(jaxpr, "dot_general")
    assert len(dots) == 2
    # x @ w1 feeds the residual, and d @ w2 the carried x that the next
    # residual reads: both decide when the loop stops, and run in float32,
    # operands included (bf16 operands would put a floor under the residual)
    assert all(ins == (F32, F32) for ins, _, _ in dots)
    assert [outs for _, outs, _ in dots] == [(F32,), (F32,)]
    assert [ins for ins, _, _ in prim_dtypes(jaxpr, "tanh")] == [(F32,)]
    assert all(ins == (F32,) for ins, _, _ in prim_dtypes(jaxpr, "abs"))


def test_while_iterations_match_float32():
    args = _fixed_point_args()
    k32, x32, _ = jax.jit(fixed_point)(*args)
    k_amp, x_amp, r_amp = jax.jit(amp(fixed_point, policy=COMPUTE_OUT))(*args)
    assert int(k32) > 3
    assert abs(int(k_amp) - int(k32)) <= 1
    assert float(r_amp) <= 0.05
    np.testing.assert_allclose(x_amp, x32, atol=0.05)


def test_cond_index_from_a_float_between_matmuls():
    def f(w, x):
        h = jnp.sin(x @ w)  # between two matmuls
        idx = jnp.clip(jnp.floor(jnp.sum(h) * 7.0), 0, 2).astype(jnp.int32)
        y = jax.lax.switch(idx, [lambda: h, lambda: 2 * h, lambda: -h])
        return y @ w

    w = jax.random.normal(jax.random.PRNGKey(1), (32, 32)) / 6
    jaxpr = jax.make_jaxpr(amp(f, policy=COMPUTE_OUT))(w, X)
    assert [ins for ins, _, _ in prim_dtypes(jaxpr, "sin")] == [(F32,)]
    assert [ins for ins, _, _ in prim_dtypes(jaxpr, "reduce_sum")] == [(F32,)]
    dots = prim_dtypes(jaxpr, "dot_general")
    assert [outs for _, outs, _ in dots] == [(F32,), (BF16,)]  # the last one decides nothing


def test_dtype_report_says_decides_control_flow():
    rows = dtype_report(amp(fixed_point, policy=COMPUTE_OUT), *_fixed_point_args())
    why = {r[0]: r[5] for r in rows if r[5]}
    assert "decides when a while loop stops" in why.get("tanh", ""), rows


def test_plain_elementwise_masks_are_not_decisions():
    # a comparison feeding a select (leaky relu) is data, not control flow
    def f(w, x):
        h = x @ w
        return jnp.where(h > 0, h, 0.1 * h) @ w

    jaxpr = jax.make_jaxpr(amp(f, policy=COMPUTE_OUT))(W, X)
    assert all(outs == (BF16,) for _, outs, _ in prim_dtypes(jaxpr, "dot_general"))


def test_scan_with_a_carried_decision():
    """A decision inside a scan body (cond on a carried float) reaches back
    through the carry to the previous iteration's ops."""

    def f(w, x):
        def step(c, _):
            x, r = c
            x = jax.lax.cond(r > 1.0, lambda: x * 0.5, lambda: x)
            d = jnp.tanh(x @ w)
            return (d @ w, jnp.max(jnp.abs(d))), None

        (x, r), _ = jax.lax.scan(step, (x, jnp.float32(0)), None, length=3)
        return x

    w = jax.random.normal(jax.random.PRNGKey(2), (32, 32)) / 6
    jaxpr = jax.make_jaxpr(amp(f, policy=COMPUTE_OUT))(w, X)
    assert [ins for ins, _, _ in prim_dtypes(jaxpr, "tanh")] == [(F32,)]
    # (tanh's dot writes float32 for the decision, ``d @ w`` because it is
    # the float32 carry: loop-carried values are not rounded to bf16)
    outs = sorted(o[0].name for _, o, _ in prim_dtypes(jaxpr, "dot_general"))
    assert outs == ["float32", "float32"]


def test_a_token_operand_is_not_a_float_to_paint():
    # a primitive that reads a token beside its array (JAX's api_test
    # test_grad_of_token_consuming_primitive, found by benchmarks/jax_suite.py):
    # painting asked every operand's aval for its dtype, a token's too
    from jax.extend.core import Primitive
    from jax.interpreters import ad

    from amp_jax._src.testing import interpreted_float32

    reads_token = Primitive("amp_test_reads_token")
    reads_token.def_impl(lambda x, token: x)
    reads_token.def_abstract_eval(lambda x, token: x)
    ad.defjvp(reads_token, lambda g, x, token: g, None)
    token = jax.lax.create_token()
    x = jnp.linspace(0.0, 1.0, 6).reshape(3, 2)
    for wrap in (amp, interpreted_float32):
        out, pullback = jax.vjp(wrap(lambda x: jnp.tanh(reads_token.bind(x, token))), x)
        (g,) = pullback(jnp.ones_like(out))
        np.testing.assert_allclose(g, 1 - jnp.tanh(x) ** 2, rtol=1e-2)
