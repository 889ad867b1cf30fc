"""What amp keeps in float32 because of what reads it, or of float16's range.

- a while loop's exit test (a convergence test) and what it reads through
  the carry: float32, matmuls included;
- a contraction whose result (or gradient) a factorization or solve reads:
  float32;
- under float16, ops whose result can leave the range of their operands
  (powers, reciprocals, products of two activations): float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import BF16, F16, F32, prim_dtypes, rel
from jax import lax

import amp_jax
from amp_jax import amp, dtype_report, explain, optim

# -- a while loop whose exit test reads the carry ------------------------------------------

W = jax.random.normal(jax.random.PRNGKey(1), (128, 128)) * 0.5 / np.sqrt(128)
X = jax.random.normal(jax.random.PRNGKey(2), (8, 128))


def deq(x, w):
    """A fixed-point iteration whose body computes the error into the carry."""

    def body(c):
        z, err, i = c
        zn = jnp.tanh(z @ w + x)
        return zn, jnp.max(jnp.abs(zn - z)) / (jnp.max(jnp.abs(zn)) + 1e-8), i + 1

    init = (jnp.zeros_like(x), jnp.float32(1.0), 0)
    return lax.while_loop(lambda c: (c[1] > 1e-5) & (c[2] < 500), body, init)


def test_a_loop_whose_exit_test_reads_the_carry_converges_as_in_float32():
    z32, _, n32 = jax.jit(deq)(X, W)
    z, err, n = jax.jit(amp(deq))(X, W)
    assert 5 < int(n32) < 50
    assert abs(int(n) - int(n32)) <= 1 and float(err) <= 1e-5
    assert rel(z, z32) < 1e-5
    jaxpr = jax.make_jaxpr(amp(deq))(X, W)
    ((ins, outs, path),) = prim_dtypes(jaxpr, "dot_general")
    assert path == ("while",) and ins == (F32, F32) and outs == (F32,)
    rows = [r for r in dtype_report(amp(deq), X, W) if r[0] == "dot_general"]
    assert ["decides when a while loop stops" in r[5] for r in rows] == [True]
    assert "decides when a while loop stops" in str(explain(amp(deq), X, W))


def test_a_matmul_outside_the_exit_test_stays_low():
    # the loop's output feeds a matmul after the loop: that one is not decided by it
    def f(x, w):
        z, _, _ = deq(x, w)
        return z @ w

    dots = prim_dtypes(jax.make_jaxpr(amp(f))(X, W), "dot_general")
    assert [d[0] for d in dots if "while" not in d[2]] == [(BF16, BF16)]


def test_optimistix_fixed_point_converges_under_amp():
    optx = pytest.importorskip("optimistix")

    def layer(x, w):
        sol = optx.fixed_point(
            lambda z, a: jnp.tanh(z @ a[0] + a[1]),
            optx.FixedPointIteration(rtol=1e-5, atol=1e-5),
            jnp.zeros_like(x),
            args=(w, x),
            throw=False,
        )
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    z32, n32, ok32 = jax.jit(layer)(X, W)
    z, n, ok = jax.jit(amp(layer))(X, W)
    assert bool(ok32) and bool(ok)
    assert abs(int(n) - int(n32)) <= 1
    assert rel(z, z32) < 1e-5


# -- a contraction whose result is factorized or solved ---------------------------------


def _ridge_data():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    z = jax.random.normal(k1, (512, 32))
    m = jax.random.normal(k2, (32, 32)) @ jnp.diag(jnp.logspace(0, -1.5, 32))
    x = z @ m
    y = x @ jax.random.normal(k3, (32,)) + jax.random.normal(k1, (512,))
    return x, y


def _ridge_solve_jnp(a, b):
    return jnp.linalg.solve(a, b)


def _ridge_solve_cholesky(a, b):
    c = jax.scipy.linalg.cho_factor(a)
    return jax.scipy.linalg.cho_solve(c, b)


def _ridge_solve_lineax(a, b):
    lx = pytest.importorskip("lineax")
    op = lx.MatrixLinearOperator(a, lx.positive_semidefinite_tag)
    return lx.linear_solve(op, b, lx.Cholesky()).value


@pytest.mark.parametrize("solve", [_ridge_solve_jnp, _ridge_solve_cholesky, _ridge_solve_lineax])
def test_ridge_regression_keeps_the_gram_matmul_float32(solve):
    def loss(x, y, lam=1e-2):
        a = x.T @ x + lam * jnp.eye(x.shape[1])
        w = solve(a, x.T @ y)
        return jnp.mean((x @ w - y) ** 2)

    x, y = _ridge_data()
    g32 = jax.jit(jax.grad(loss))(x, y)
    g = jax.jit(jax.grad(amp(loss)))(x, y)
    assert rel(g, g32) < 1e-4  # (all three products lowered: 0.2-2.7)
    dots = prim_dtypes(jax.make_jaxpr(amp(loss))(x, y), "dot_general")
    gram = [d for d in dots if d[1] == ((F32,)) and d[2] == ()]
    assert gram and all(d[0] == (F32, F32) for d in dots if d[2] == ())
    why = {r[5] for r in dtype_report(amp(loss), x, y) if r[0] == "dot_general" and r[3] == "-"}
    assert any("a factorization or solve" in w for w in why), why
    assert "a factorization or solve" in str(explain(amp(loss), x, y))


def test_matmuls_far_from_a_solve_stay_low():
    # a network before the ridge head: its first matmul is not read by the solve
    def loss(w0, x, y):
        h = jnp.tanh(x @ w0)
        a = h.T @ h + 1e-2 * jnp.eye(h.shape[1])
        return jnp.sum(jnp.linalg.solve(a, h.T @ y))

    x, y = _ridge_data()
    w0 = jax.random.normal(jax.random.PRNGKey(5), (32, 32)) / 6
    dots = prim_dtypes(jax.make_jaxpr(amp(loss))(w0, x, y), "dot_general")
    assert dots[0][0] == (BF16, BF16)  # x @ w0: low, writes float32 for the kept tanh
    assert all(d[0] == (F32, F32) for d in dots[1:3])


# -- float16's range ------------------------------------------------------------------------


def _range_args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (64, 256))
    w1 = jax.random.normal(k2, (256, 1024)) * 300 / 16
    w2 = jax.random.normal(k3, (1024, 128)) / 32
    return x, w1, w2


RANGE_PROGRAMS = {
    "x ** 2": lambda x, w1, w2: ((x @ w1) ** 2 * 1e-2) @ w2,
    "square": lambda x, w1, w2: (jnp.square(x @ w1) * 1e-2) @ w2,
    "x ** 3": lambda x, w1, w2: ((x @ w1 / 30) ** 3 * 1e-2) @ w2,
    "(a - b) ** 2": lambda x, w1, w2: ((x @ w1 - x @ w1[:, ::-1]) ** 2 * 1e-2) @ w2,
    "a * b": lambda x, w1, w2: ((x @ w1) * (x @ w1[:, ::-1]) * 1e-2) @ w2,
    "a / b": lambda x, w1, w2: ((x @ w1) / (jnp.abs(x @ w1[:, ::-1]) + 100.0)) @ w2,
}


@pytest.mark.parametrize("name", list(RANGE_PROGRAMS))
def test_float16_range_ops_run_in_float32(name):
    f = RANGE_PROGRAMS[name]
    args = _range_args()
    ref = jax.jit(f)(*args)
    assert bool(jnp.isfinite(ref).all())
    out = jax.jit(amp(f, policy="float16"))(*args)
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(out, ref, rtol=0.05, atol=0.02 * float(jnp.max(jnp.abs(ref))))
    rows = dtype_report(amp(f, policy="float16"), *args)
    kept = [r for r in rows if "float16's range" in r[5]]
    assert kept and all(set(r[1].split(",")) == {"float32"} for r in kept), rows


def test_bfloat16_keeps_range_ops_low_between_matmuls(low_elementwise):
    f = RANGE_PROGRAMS["x ** 2"]
    args = _range_args()
    pow16 = prim_dtypes(jax.make_jaxpr(amp(f, policy="float16"))(*args), "integer_pow")
    powbf = prim_dtypes(jax.make_jaxpr(amp(f, policy="bfloat16"))(*args), "integer_pow")
    assert [d[0] for d in pow16] == [(F32,)]
    assert [d[0] for d in powbf] == [(BF16,)]
    # the matmuls still run in float16
    dots = prim_dtypes(jax.make_jaxpr(amp(f, policy="float16"))(*args), "dot_general")
    assert [d[0] for d in dots] == [(F16, F16), (F16, F16)]


def test_a_product_with_a_constant_follows_its_operand_under_float16(low_elementwise):
    def f(x, w):
        return ((x @ w) * 0.5) @ w

    w = jnp.ones((64, 64)) / 64
    # (dots writing float16, as on a GPU: a mul reading a float32 dot result
    # computes in float32 whatever its class, by the widest-input rule)
    policy = amp_jax.Policy(compute_dtype=jnp.float16, allow_outputs="compute")
    muls = prim_dtypes(jax.make_jaxpr(amp(f, policy=policy))(jnp.ones((8, 64)), w), "mul")
    assert [d[0] for d in muls] == [(F16, F16)]


def test_dynamic_loss_scale_does_not_collapse_on_a_squared_activation():
    x, w1, w2 = _range_args()
    y = jnp.arange(64) % 4

    def loss(params, x, y):
        h = (x @ params["w1"]) ** 2 * 1e-2
        logits = (h @ params["w2"])[:, :4] * 1e-3
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params = {"w1": w1, "w2": w2}
    tx = optim.dynamic_loss_scale(optax.sgd(1e-6))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        _, grads = optim.scaled_value_and_grad(amp(loss, policy="float16"), state)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(8):
        params, state = step(params, state)
    assert int(state.skipped_steps) <= 2
    assert float(optim.loss_scale(state)) >= 2.0**13
