"""The dot_general cotangents (``lowdot.dot_transpose``) and the rule table.

``dot_transpose`` is checked against JAX's own transpose rule (``jax.vjp`` of
``lax.dot_general``) for many dimension-number layouts, on both operands, in
float32 and with bfloat16 operands (where, on CPU, ``backends.cpu.dot`` rewrites the
operand layouts with materialized transposes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import eqns
from jax import lax

from amp_jax._src import backends
from amp_jax._src.rules.dots import lowdot

# name: (x shape, y shape, ((xc, yc), (xb, yb)))
LAYOUTS = {
    "matmul": ((3, 4), (4, 5), (((1,), (0,)), ((), ()))),
    "xT_y": ((4, 3), (4, 5), (((0,), (0,)), ((), ()))),
    "x_yT": ((3, 4), (5, 4), (((1,), (1,)), ((), ()))),
    "xT_yT": ((4, 3), (5, 4), (((0,), (1,)), ((), ()))),
    "two_contracting": ((2, 3, 4), (3, 4, 5), (((1, 2), (0, 1)), ((), ()))),
    "two_contracting_crossed": ((2, 3, 4), (4, 5, 3), (((1, 2), (2, 0)), ((), ()))),
    "contract_leading_two": ((3, 4, 6), (5, 4, 3), (((0, 1), (2, 1)), ((), ()))),
    "batch_leading": ((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),
    "batch_not_leading": ((3, 2, 4), (4, 5, 2), (((2,), (0,)), ((1,), (2,)))),
    "two_batch_mixed": ((3, 2, 4, 6), (6, 4, 2, 5), (((2,), (1,)), ((3, 1), (0, 2)))),
    "vector_matrix": ((4,), (4, 5), (((0,), (0,)), ((), ()))),
    "matrix_vector": ((3, 4), (4,), (((1,), (0,)), ((), ()))),
    "outer": ((3,), (5,), (((), ()), ((), ()))),
}


def _inputs(xs, ys, dims, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(xs, np.float32)).astype(dtype)
    y = jnp.asarray(rng.standard_normal(ys, np.float32)).astype(dtype)
    ct_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), x, y).shape
    ct = jnp.asarray(rng.standard_normal(ct_shape, np.float32)).astype(dtype)
    return x, y, ct


def _ours(ct, x, y, dims, acc=jnp.float32):
    """Both cotangents, as the dot rule computes them on this backend."""
    dot = backends.current().dot
    d = lowdot.DotDims(dims, x.ndim, y.ndim)
    dx = lowdot.dot_transpose(ct, y, d, True, None, acc, None, dot)
    dy = lowdot.dot_transpose(ct, x, d, False, None, acc, None, dot)
    return dx, dy


def _both(ct, x, y, dims):
    """(ours, JAX's) cotangents; JAX's of float32 copies of the (rounded) inputs."""

    def run(ct, x, y):
        f32 = lambda v: v.astype(jnp.float32)
        _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), f32(x), f32(y))
        return _ours(ct, x, y, dims), vjp(f32(ct))

    return jax.jit(run)(ct, x, y)


def _check(name, dtype, tol):
    xs, ys, dims = LAYOUTS[name]
    x, y, ct = _inputs(xs, ys, dims, dtype)
    (dx, dy), (rdx, rdy) = _both(ct, x, y, dims)
    assert dx.shape == x.shape and dy.shape == y.shape
    assert dx.dtype == jnp.float32 and dy.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(dy), np.asarray(rdy), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dot_transpose_matches_jax_float32(name):
    _check(name, jnp.float32, 1e-5)


def _batched(dims):
    return bool(dims[1][0])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dot_transpose_matches_jax_bfloat16_operands(name):
    if _batched(LAYOUTS[name][2]) and jax.default_backend() == "cpu":
        pytest.skip(
            "XLA:CPU has no batched bf16 x bf16 -> f32 dot kernel; "
            "the plan keeps such dots in float32 there (Variant.FLOAT32)"
        )
    # bf16 operands, float32 accumulation: only the summation order differs
    _check(name, jnp.bfloat16, 1e-2)


def _dots(closed):
    return [e for e, _ in eqns(closed) if e.primitive.name == "dot_general"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU layout rewrite")
@pytest.mark.parametrize("name", [n for n, v in LAYOUTS.items() if not _batched(v[2])])
def test_bfloat16_backward_dots_use_cpu_fast_layouts(name):
    """On CPU every unbatched bf16 cotangent dot contracts the lhs over its
    trailing dims and the rhs over its leading or trailing dims."""
    xs, ys, dims = LAYOUTS[name]
    x, y, ct = _inputs(xs, ys, dims, jnp.bfloat16)
    closed = jax.make_jaxpr(lambda c, a, b: _ours(c, a, b, dims))(ct, x, y)
    dots = _dots(closed)
    assert len(dots) == 2
    for e in dots:
        (ca, cb), _ = e.params["dimension_numbers"]
        na, nb, k = e.invars[0].aval.ndim, e.invars[1].aval.ndim, len(ca)
        assert tuple(ca) == tuple(range(na - k, na)), e
        assert tuple(cb) in (tuple(range(k)), tuple(range(nb - k, nb))), e
        assert e.params["preferred_element_type"] == jnp.float32
        assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars)
