"""Table-driven sweep over lax / jnp / jax.nn ops under amp.

Every case is a function of ``h = x @ w`` (a float32 value that a dot made)
and of a second weight ``w2``. Elementwise and data-movement cases sit between
two dots (``op(x @ w) @ w2``), so the painting can run them in bf16; the rest
consume ``h`` directly. For each case, under the ``"bfloat16"`` policy:

* it runs, jitted and eagerly, and the output pytree has the same shapes and
  dtypes as without amp;
* values and gradients agree with float32 within a tolerance fit for bf16
  (relative to the magnitude of the float32 result; discrete outputs --
  argmax, sort indices, floor -- are compared structurally only);
and under the ``"float32"`` policy outputs and gradients are bitwise equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F32, check_dots_low, prim_dtypes
from jax import lax

from amp_jax import Policy, amp

# The sweep checks how each op is classified between two dots, on toy shapes:
# no size thresholds, and no attention fusion (tests/test_attention.py has it).
SWEEP_KW = dict(attention="off", min_low_contraction=0, min_low_flops=0)
SWEEP = Policy(jnp.bfloat16, **SWEEP_KW)

KEY = jax.random.PRNGKey(0)
k1, k2, k3, k4 = jax.random.split(KEY, 4)
X = jax.random.normal(k1, (8, 16))
W = jax.random.normal(k2, (16, 16)) / 4.0
W2 = jax.random.normal(k3, (16, 16)) / 4.0
IDX = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
TOL = 5e-2  # bf16 has 8 significand bits; two dots + one op stay well inside 5%


def _pos(h):
    return jnp.abs(h) + 1.0


# Elementwise / shape-preserving: op(h) is followed by a second dot.
EW = {
    "neg": lambda h: -h,
    "abs": jnp.abs,
    "add": lambda h: h + 1.5,
    "sub": lambda h: 2.0 - h,
    "mul": lambda h: h * h,
    "div": lambda h: h / (1.0 + h * h),
    "maximum": lambda h: jnp.maximum(h, 0.1),
    "minimum": lambda h: jnp.minimum(h, -0.1),
    "exp": lambda h: jnp.exp(h / 4),
    "log": lambda h: jnp.log(_pos(h)),
    "log1p": lambda h: jnp.log1p(jnp.abs(h)),
    "expm1": lambda h: jnp.expm1(h / 4),
    "exp2": lambda h: jnp.exp2(h / 4),
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tan": lambda h: jnp.tan(h / 4),
    "arctan": jnp.arctan,
    "arctan2": lambda h: jnp.arctan2(h, 1.0 + h * h),
    "sinh": lambda h: jnp.sinh(h / 2),
    "cosh": lambda h: jnp.cosh(h / 2),
    "arcsinh": jnp.arcsinh,
    "sqrt": lambda h: jnp.sqrt(_pos(h)),
    "rsqrt": lambda h: lax.rsqrt(_pos(h)),
    "cbrt": lambda h: jnp.cbrt(_pos(h)),  # (cbrt's slope is infinite at 0)
    "pow": lambda h: _pos(h) ** 1.5,
    "integer_pow": lambda h: h**3,
    "square": jnp.square,
    "reciprocal": lambda h: 1.0 / _pos(h),
    "erf": lax.erf,
    "erfc": lax.erfc,
    "clip": lambda h: jnp.clip(h, -0.5, 0.5),
    "where": lambda h: jnp.where(h > 0, h, 0.3 * h),
    "rem": lambda h: lax.rem(h, 0.7),
    "copysign": lambda h: jnp.copysign(1.0 + h * h, h),
    "nan_to_num": jnp.nan_to_num,
    "stop_gradient": lambda h: h + lax.stop_gradient(h * h),
    "reduce_precision": lambda h: lax.reduce_precision(h, exponent_bits=8, mantissa_bits=10),
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "gelu_tanh": jax.nn.gelu,
    "gelu_erf": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus,
    "elu": jax.nn.elu,
    "celu": jax.nn.celu,
    "selu": jax.nn.selu,
    "leaky_relu": jax.nn.leaky_relu,
    "hard_tanh": jax.nn.hard_tanh,
    "mish": jax.nn.mish,
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "standardize": jax.nn.standardize,
    "layer_norm": lambda h: (
        (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    ),
    "rms_norm": lambda h: h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6),
    "center": lambda h: h - jnp.max(h, -1, keepdims=True),
    "cumsum": lambda h: jnp.cumsum(h, -1),
    "cumprod": lambda h: jnp.cumprod(1.0 + h / 16, -1),
    "cummax": lambda h: lax.cummax(h, axis=1),
    "cumlogsumexp": lambda h: lax.cumlogsumexp(h, axis=1),
    "sort": lambda h: jnp.sort(h, -1),
    "flip": lambda h: jnp.flip(h, -1),
    "roll": lambda h: jnp.roll(h, 3, -1),
    "transpose": lambda h: h.T.reshape(16, 8).T.reshape(8, 16),
    "reshape": lambda h: h.reshape(4, 32).reshape(8, 16),
    "pad_slice": lambda h: jnp.pad(h, ((1, 1), (2, 2)))[1:-1, 2:-2],
    "concatenate": lambda h: jnp.concatenate([h[:, 8:], h[:, :8]], -1),
    "dynamic_slice": lambda h: lax.dynamic_slice(jnp.tile(h, (1, 2)), (0, 5), (8, 16)),
    "dynamic_update_slice": lambda h: lax.dynamic_update_slice(h, h[:2, :4] * 2, (3, 5)),
    "gather": lambda h: h[:, IDX].repeat(2, -1),
    "scatter_set": lambda h: h.at[:, 0].set(1.0),
    "scatter_add": lambda h: h.at[IDX].add(h),
    "scatter_mul": lambda h: h.at[:, 1].multiply(2.0),
    "top_k_values": lambda h: lax.top_k(h, 16)[0],
    "broadcast_mean": lambda h: h - h.mean(0),
    "max_pool": lambda h: lax.reduce_window(
        h[None, :, :, None], -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME"
    )[0, :, :, 0],
    "avg_pool": lambda h: lax.reduce_window(h, 0.0, lax.add, (1, 3), (1, 1), "SAME") / 3,
    "select_n": lambda h: lax.select_n(h > 0.2, h, -h),
    "remat": jax.checkpoint(lambda h: jnp.tanh(h) * h),
    "custom_jvp": jax.nn.relu,  # a custom_jvp_call
    "cond": lambda h: lax.cond(h.sum() > 0, jnp.tanh, jnp.sin, h),
    "while": lambda h: lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.sin(c), h),
    "scan": lambda h: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(16), h)[1],
    "linalg_solve": lambda h: jnp.linalg.solve(h @ h.T + 8 * jnp.eye(8), h),
    "cholesky": lambda h: jnp.linalg.cholesky(h @ h.T + 8 * jnp.eye(8)) @ h,
    "qr": lambda h: jnp.linalg.qr(h.T)[0].T,
}

# Any output (reductions, indices, other shapes): op(h) is the result.
ANY = {
    "sum": lambda h: jnp.sum(h, -1),
    "mean": jnp.mean,
    "var": lambda h: jnp.var(h, 0),
    "std": jnp.std,
    "max": lambda h: jnp.max(h, 0),
    "min": jnp.min,
    "prod": lambda h: jnp.prod(1.0 + h / 16, -1),
    "logsumexp": lambda h: jax.nn.logsumexp(h, -1),
    "norm": lambda h: jnp.linalg.norm(h, axis=-1),
    "einsum": lambda h: jnp.einsum("ij,kj->ik", h, h),
    "batched_matmul": lambda h: jnp.matmul(h.reshape(2, 4, 16), h.reshape(2, 16, 4)),
    "tensordot": lambda h: jnp.tensordot(h, h, axes=([0], [0])),
    "vector_dot": lambda h: h @ jnp.arange(16.0),
    "outer": lambda h: jnp.outer(h[0], h[1]),
    "conv": lambda h: lax.conv_general_dilated(
        h[None, :, :, None],
        jnp.ones((3, 3, 1, 2)) / 9,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ),
    "cross_entropy": lambda h: -jnp.mean(jax.nn.log_softmax(h)[jnp.arange(8), IDX]),
    "mse": lambda h: jnp.mean((h - 1.0) ** 2),
    "top_k": lambda h: lax.top_k(h, 3),
    "argmax": lambda h: (jnp.argmax(h, -1), h.max(-1)),
    "argmin": lambda h: jnp.argmin(h, 0),
    "argsort": lambda h: jnp.argsort(h, -1),
    "one_hot": lambda h: jax.nn.one_hot(jnp.argmax(h, -1), 5),
    "sign": jnp.sign,
    "floor": jnp.floor,
    "ceil": jnp.ceil,
    "round": jnp.round,
    "compare": lambda h: (h > 0, jnp.isfinite(h)),
    "astype_int": lambda h: (h * 4).astype(jnp.int32),
    "astype_f16": lambda h: h.astype(jnp.float16),
    "astype_f64_free": lambda h: h.astype(jnp.float32) * 2,
    "bitcast": lambda h: lax.bitcast_convert_type(h, jnp.int32),
    "random": lambda h: h + jax.random.normal(jax.random.fold_in(KEY, 1), h.shape),
}

# Outputs that are discrete, or jump where bf16 rounding moves the input.
DISCRETE = {
    "argmax",
    "argmin",
    "argsort",
    "one_hot",
    "sign",
    "floor",
    "ceil",
    "round",
    "compare",
    "astype_int",
    "bitcast",
    "top_k",
    "rem",
    "where",
    "select_n",
    "cond",
}
NO_GRAD = DISCRETE | {
    "sort",
    "cummax",
    "max_pool",
    "top_k_values",
    "max",
    "min",
    "astype_f16",
    "center",
    "clip",
    "hard_tanh",
    "relu6",
    "reduce_precision",
}

CASES = {
    **{f"ew:{k}": (lambda op: lambda x, w, w2: op(x @ w) @ w2)(v) for k, v in EW.items()},
    **{f"any:{k}": (lambda op: lambda x, w, w2: op(x @ w))(v) for k, v in ANY.items()},
}


def _shape_dtypes(tree):
    return jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), tree)


def _close(got, want, name):
    def check(g, w):
        w = np.asarray(w, dtype=np.float64) if jnp.issubdtype(w.dtype, jnp.floating) else None
        if w is None:
            return
        scale = max(1.0, float(np.max(np.abs(w))))
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, rtol=TOL, atol=TOL * scale, err_msg=name
        )

    jax.tree.map(check, got, want)


def _loss(fn):
    """A scalar from every float output, with fixed random weights (for grads)."""

    def loss(x, w, w2):
        outs = [o for o in jax.tree.leaves(fn(x, w, w2)) if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(
            jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
            for o in outs
        )

    return loss


def _run_all(fn, with_grad):
    """One jitted program: float32, amp bf16 and amp float32, and their grads."""
    variants = {"f32": fn, "bf16": amp(fn, policy=SWEEP), "id": amp(fn, policy="float32")}

    def run(x, w, w2):
        out = {k: f(x, w, w2) for k, f in variants.items()}
        if with_grad:
            out.update(
                {f"d{k}": jax.grad(_loss(f), argnums=(1, 2))(x, w, w2) for k, f in variants.items()}
            )
        return out

    return jax.jit(run)(X, W, W2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_op(name):
    fn, op = CASES[name], name.split(":")[1]
    r = _run_all(fn, op not in NO_GRAD)
    for k in ("", "d") if op not in NO_GRAD else ("",):
        # The "float32" policy is the identity, bitwise.
        jax.tree.map(
            lambda g, w: np.testing.assert_array_equal(g, w, err_msg=name),
            r[k + "id"],
            r[k + "f32"],
        )
        assert _shape_dtypes(r[k + "bf16"]) == _shape_dtypes(r[k + "f32"])
    if op not in DISCRETE:
        _close(r["bf16"], r["f32"], name)
    if op not in NO_GRAD:
        # Gradients are sums over 128 products of bf16-rounded factors.
        scale = max(float(jnp.max(jnp.abs(g))) for g in r["df32"])
        for g, w in zip(r["dbf16"], r["df32"]):
            np.testing.assert_allclose(g, w, rtol=0, atol=2 * TOL * scale, err_msg=name)
    # the matmul runs low (both matmuls, and any inside the op, for the ew: cases)
    jaxpr = jax.make_jaxpr(amp(fn, policy=SWEEP))(X, W, W2)
    if name in SOLVE_CASES:  # the matmuls next to a solve stay float32
        dots = [d for d in prim_dtypes(jaxpr, "dot_general") if not d[2]]
        assert len(dots) >= 2 and all(d[0] == (F32, F32) for d in dots), dots
        return
    check_dots_low(jaxpr, min_low=2 if name.startswith("ew:") else 1)


#: a factorization or solve reads the first matmul's result, and the second
#: matmul reads its result: both stay float32 (tests/behaviour/test_sensitive_consumers.py)
SOLVE_CASES = frozenset({"ew:cholesky", "ew:linalg_solve", "ew:qr"})


@pytest.mark.parametrize("name", ["ew:relu", "ew:tanh", "ew:softmax", "any:sum", "ew:scan"])
def test_op_eager_matches_jit(name):
    """Eager evaluation of an amp function binds the same ops as under jit.

    Compiled without excess precision: with it (XLA's default on GPU) a
    fused jit keeps bf16 intermediates such as tanh's output in float32,
    which op-by-op eager evaluation cannot do.
    """
    fn = amp(CASES[name], policy=SWEEP)
    check_dots_low(jax.make_jaxpr(fn)(X, W, W2))  # (what is compared was lowered)
    strict = jax.jit(fn).lower(X, W, W2).compile({"xla_allow_excess_precision": False})
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
        fn(X, W, W2),
        strict(X, W, W2),
    )


# -- what runs low, what stays float32 ---------------------------------------


def _dtype_of(fn, prim):
    return {o[0] for _, o, _ in prim_dtypes(jax.make_jaxpr(amp(fn, policy=SWEEP))(X, W, W2), prim)}


@pytest.mark.parametrize(
    "name,prim",
    [
        ("ew:relu", "max"),
        ("ew:tanh", "tanh"),
        ("ew:gelu_tanh", "tanh"),
        ("ew:transpose", "transpose"),
        ("ew:custom_jvp", "max"),
    ],
)
@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_followers_between_dots_run_bf16(name, prim):
    assert _dtype_of(CASES[name], prim) == {BF16}


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_a_follower_reading_a_float32_value_computes_in_float32_and_writes_bf16():
    """``h * h`` between two dots, ``h`` a matmul's float32 result (on CPU):
    the mul computes in float32 (its widest input) and the next dot reads its
    result in bf16."""
    fn = amp(CASES["ew:mul"], policy=SWEEP)
    jaxpr = jax.make_jaxpr(fn)(X, W, W2)
    assert {i for i, _, _ in prim_dtypes(jaxpr, "mul")} == {(F32, F32)}
    check_dots_low(jaxpr, min_low=2)
    low_out = amp(CASES["ew:mul"], policy=Policy(allow_outputs="compute", **SWEEP_KW))
    assert {o[0] for _, o, _ in prim_dtypes(jax.make_jaxpr(low_out)(X, W, W2), "mul")} == {BF16}


@pytest.mark.parametrize(
    "name,prim",
    [
        ("ew:exp", "exp"),
        ("ew:log", "log"),
        ("ew:softmax", "exp"),
        ("ew:layer_norm", "rsqrt"),
        ("ew:cumsum", "cumsum"),
        ("any:sum", "reduce_sum"),
        ("ew:cholesky", "cholesky"),
        ("ew:softmax", "div"),
        ("ew:pow", "pow"),
    ],
)
def test_sensitive_ops_run_float32(name, prim):
    """Deny ops, and follow ops downstream of one (softmax's division), are float32,
    and the matmuls beside them run low."""
    assert _dtype_of(CASES[name], prim) == {F32}
    jaxpr = jax.make_jaxpr(amp(CASES[name], policy=SWEEP))(X, W, W2)
    assert (BF16, BF16) in [i for i, _, _ in prim_dtypes(jaxpr, "dot_general")]
