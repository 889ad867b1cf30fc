"""Property tests on random programs built from a vocabulary of layers.

Hypothesis draws a chain of steps (dots, activations, normalisations,
residuals, control flow: cond, scan, remat, custom_jvp, while, and numerical
machinery: loop-carried accumulations and elementwise state (an EMA, an
Euler step), loops in which a float
decides whether to step, tiny solver-like contractions, multi-head einsums in
a cond, selection ops: a keepdims max, overlapping max pooling, cummax,
gathers with repeated indices, sort, top_k) on an [8, 16] float32 state. For every program:

* under ``"float32"`` the outputs and gradients are bitwise those of the
  program without amp;
* under ``"bfloat16"`` the output dtype is unchanged, every non-batched dot of
  the forward *and* of the backward has bf16 operands (but tiny contractions,
  which stay float32), and values and
  gradients are as close to float32 as those of the same program with its
  matmul operands cast to bf16 by hand (within a bf16 margin), also with the
  matmuls writing bf16 (``allow_outputs="compute"``, as on a GPU);
* every float loop carry is computed in its own dtype: walking back from it
  in the rewritten loop body reaches no bf16 value before a matmul;
* no sum of the backward pass (``reduce_sum``, scatter-add,
  ``select_and_scatter_add``, ``cumsum``, windowed sums) adds bf16 values.

Under an outer ``vmap`` (around amp, inside ``grad``) every program runs,
``"float32"`` stays bitwise, bf16 stays as close as the hand-cast program and
no sum of the backward pass adds bf16 values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _util import (
    _tiny,
    carries_are_computed_in_their_dtype,
    check_dots_low,
    eqns,
    hand_bf16_matmul,
    low_sums,
)
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from jax import lax

from amp_jax import Policy, amp

N_W = 4
PARAMS = {
    "w": jax.random.normal(jax.random.PRNGKey(1), (N_W, 16, 16)) / 4.0,
    "b": jax.random.normal(jax.random.PRNGKey(2), (N_W, 16)) * 0.1,
}
X = jax.random.normal(jax.random.PRNGKey(3), (8, 16))


def _ln(h):
    return (h - h.mean(-1, keepdims=True)) * lax.rsqrt(h.var(-1, keepdims=True) + 1e-3)


def _f32_mm(a, b):
    return a @ b


def hand_bf16_matmul_out(a, b):
    """A matmul with its operands cast by hand and its result rounded to bf16,
    as a GPU matmul writing bf16 does (the oracle for ``allow_outputs="compute"``)."""
    return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).astype(a.dtype)


def _step(kind, k, p, h, saved, mm):
    w, b = p["w"][k], p["b"][k]
    if kind == "dot":
        return mm(h, w)
    if kind == "bias":
        return h + b
    if kind == "tanh":
        return jnp.tanh(h)
    if kind == "relu":
        return jax.nn.relu(h)  # custom_jvp
    if kind == "gelu":
        return jax.nn.gelu(h)
    if kind == "softmax":
        return jax.nn.softmax(h) * 4.0
    if kind == "ln":
        return _ln(h)
    if kind == "residual":
        return h + saved
    if kind == "gate":
        return h * jax.nn.sigmoid(mm(h, w))
    if kind == "center":
        return h - jnp.mean(h, 0)
    if kind == "cond":
        return lax.cond(
            jnp.mean(h * h) > 1e-3, lambda h: jnp.tanh(mm(h, w)), lambda h: mm(jnp.sin(h), w), h
        )
    if kind == "scan":
        return lax.scan(lambda c, wi: (jnp.tanh(mm(c, wi)), None), h, p["w"][:2])[0]
    if kind == "remat":
        return jax.checkpoint(lambda h: jax.nn.relu(mm(h, w)) + b)(h)
    if kind == "while":
        return lax.fori_loop(0, 2, lambda i, c: jnp.tanh(mm(c, w)), h)
    if kind == "accumulate":  # a loop-carried running sum over the stacked weights
        return lax.scan(lambda acc, wi: (acc + 0.5 * jnp.tanh(mm(h, wi)), None), h, p["w"])[0]
    if kind == "ema":  # loop-carried elementwise state, also read by a matmul
        return lax.fori_loop(0, 3, lambda i, m: 0.9 * m + 0.1 * jnp.tanh(mm(m, w)), h)
    if kind == "euler":  # an explicit Euler state h + dt * f(h)
        return lax.fori_loop(0, 3, lambda i, h: h + 0.25 * jnp.tanh(mm(h, w) + b), h)
    if kind == "adaptive":  # a float decides, per iteration, whether the loop steps
        step = lambda c: jnp.tanh(mm(c, w)) * 2.0
        go = lambda c, _: (lax.cond(jnp.mean(c * c) > 0.3, step, lambda c: c, c), None)
        return lax.scan(go, h, None, length=3)[0]
    if kind == "tiny":  # a solver-like combination: contraction size 4, never worth bf16
        stages = jnp.stack([h, jnp.sin(h), jnp.cos(h), h * h / 4.0])
        return h + jnp.einsum("s,sij->ij", b[:4], stages)
    if kind == "attention":
        s = jax.nn.softmax(mm(mm(h, w), h.T) / 4.0)
        return mm(s, h)
    if kind == "heads":  # a multi-head projection, in a cond
        heads = lambda h: jnp.einsum("bi,ihd->bhd", h, w.reshape(16, 2, 8)).reshape(h.shape)
        return lax.cond(jnp.mean(h) > 0, lambda h: jnp.tanh(heads(h)), lambda h: h * 0.5, h)
    return _selection(kind, h)


def _selection(kind, h):
    """Selection ops, whose derivatives add cotangents (or count ties)."""
    if kind == "max_center":
        return h - jnp.max(h, 1, keepdims=True)
    if kind == "pool":  # overlapping windows
        return lax.reduce_window(h, -jnp.inf, lax.max, (1, 3), (1, 1), "SAME")
    if kind == "cummax":
        return lax.cummax(h, axis=0)
    if kind == "gather":  # repeated indices
        return h[jnp.arange(h.shape[0]) // 2]
    if kind == "sort":
        return jnp.sort(h, axis=1)
    if kind == "top_k":
        return lax.top_k(h, 16)[0]
    raise AssertionError(kind)


KINDS = [
    "dot",
    "bias",
    "tanh",
    "relu",
    "gelu",
    "softmax",
    "ln",
    "residual",
    "gate",
    "center",
    "cond",
    "scan",
    "remat",
    "while",
    "attention",
    "accumulate",
    "ema",
    "euler",
    "adaptive",
    "tiny",
]
#: multi-head einsums in a cond and selection ops (whose derivatives add values)
SELECTIONS = ["heads", "max_center", "pool", "cummax", "gather", "sort", "top_k"]
programs = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, N_W - 1)), min_size=1, max_size=6
)
with_selections = st.lists(
    st.tuples(st.sampled_from(KINDS + SELECTIONS), st.integers(0, N_W - 1)),
    min_size=1,
    max_size=6,
)


def make(program, mm=_f32_mm):
    def f(p, x):
        h = mm(x, p["w"][0])
        saved = h
        for kind, k in program:
            h = _step(kind, k, p, h, saved, mm)
            saved = h if kind in ("dot", "ln") else saved
        return jnp.sum(jnp.tanh(h) * jnp.cos(jnp.arange(h.size).reshape(h.shape)))

    return f


def _n_dots(jaxpr):
    return sum(e.primitive.name == "dot_general" and not _tiny(e) for e, _ in eqns(jaxpr))


@settings(
    max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate]
)  # (shrinking can take minutes on CI)
@given(programs)
@example([("ln", 0), ("while", 0)])  # (failed on an H100: the while carry rounded to bf16)
@example([("dot", 1), ("ema", 0), ("euler", 2)])
def test_random_program(program):
    _check_program(program)


@settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(with_selections)
@example([("pool", 0), ("cummax", 1), ("sort", 2)])
def test_random_program_with_selections(program):
    _check_program(program)


def _check_program(program):
    f = make(program)
    vg = {
        name: jax.value_and_grad(g)
        for name, g in (
            ("f32", f),
            ("bf16", amp(f)),
            ("id", amp(f, policy="float32")),
            # (matmuls writing bf16, as on a GPU)
            ("bf16_out", amp(f, policy=Policy(allow_outputs="compute"))),
            ("hand", make(program, hand_bf16_matmul)),
            ("hand_out", make(program, hand_bf16_matmul_out)),
        )
    }
    r = jax.jit(lambda p, x: {k: v(p, x) for k, v in vg.items()})(PARAMS, X)

    jax.tree.map(np.testing.assert_array_equal, r["id"], r["f32"])
    # The oracle for bf16: no worse than the same program with its matmul
    # operands cast by hand (random programs can be ill-conditioned: a relu
    # kink or a softmax cancellation magnifies any bf16 rounding), plus the
    # rounding of the followers amp also runs in bf16. With matmuls writing
    # bf16, the oracle rounds the hand-cast matmuls' results too (JAX 0.12's
    # XLA:CPU writes them in bf16, as a GPU does; 0.10's computed float32).
    ref = jax.tree.leaves(r["f32"])
    for variant, oracle in (("bf16", "hand"), ("bf16_out", "hand_out")):
        got_ = jax.tree.leaves(r[variant])
        for got, hand, want in zip(got_, jax.tree.leaves(r[oracle]), ref):
            assert got.dtype == want.dtype
            scale = max(1e-3, float(jnp.max(jnp.abs(want))))
            err = float(jnp.max(jnp.abs(got - want)))
            err_hand = float(jnp.max(jnp.abs(hand - want)))
            assert err <= 2 * err_hand + 0.05 * scale, (variant, program, err, err_hand, scale)

    fwd = jax.make_jaxpr(amp(f))(PARAMS, X)
    check_dots_low(fwd, min_low=1)
    bwd = jax.make_jaxpr(jax.grad(amp(f)))(PARAMS, X)
    check_dots_low(bwd, min_low=_n_dots(fwd))
    # No sum of the backward pass adds compute-dtype values.
    assert low_sums(bwd) == [], program
    # Loop carries keep their dtype through the ops that compute them, with
    # matmuls writing bf16 too.
    fwd_out = jax.make_jaxpr(amp(f, policy=Policy(allow_outputs="compute")))(PARAMS, X)
    assert carries_are_computed_in_their_dtype(fwd_out) == [], program


XS = jax.random.normal(jax.random.PRNGKey(4), (3, 8, 16))


@settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(with_selections)
@example([("heads", 0)])  # (crashed: a dot batched after amp planned it, on XLA:CPU)
@example([("tanh", 0), ("bias", 1), ("dot", 2)])  # (the bias gradient summed in bf16)
def test_random_program_under_an_outer_vmap(program):
    """``vmap`` outside amp, under ``grad``: it runs, float32 is bitwise the
    identity, bf16 is as close as the hand-cast program, and no sum of the
    backward pass adds bf16 values."""
    f = make(program)

    def vg(g):
        return jax.value_and_grad(lambda p, xs: jnp.sum(jax.vmap(g, (None, 0))(p, xs)))

    fns = {
        "f32": f,
        "bf16": amp(f),
        "id": amp(f, policy="float32"),
        "hand": make(program, hand_bf16_matmul),
    }
    r = jax.jit(lambda p, xs: {k: vg(g)(p, xs) for k, g in fns.items()})(PARAMS, XS)
    jax.tree.map(np.testing.assert_array_equal, r["id"], r["f32"])
    for got, hand, want in zip(*(jax.tree.leaves(r[k]) for k in ("bf16", "hand", "f32"))):
        scale = max(1e-3, float(jnp.max(jnp.abs(want))))
        err = float(jnp.max(jnp.abs(got - want)))
        err_hand = float(jnp.max(jnp.abs(hand - want)))
        assert err <= 2 * err_hand + 0.05 * scale, (program, err, err_hand, scale)
    # No sum of the backward pass adds compute-dtype values, also those the
    # outer vmap adds (the transposes of its broadcasts of the parameters).
    bwd = jax.make_jaxpr(vg(amp(f)))(PARAMS, XS)
    assert low_sums(bwd) == [], program


# -- float16 range: activations of magnitude 10-1000 between matmuls ----------------

#: ops whose result can leave float16's range although their operands are in it
#: (``a`` has magnitude about ``s``; each result is scaled back to about ``s``)
RANGE_OPS = {
    "square": lambda a, s: jnp.square(a) / s,
    "pow2": lambda a, s: a**2 / s,
    "pow3": lambda a, s: a**3 / (s * s),
    "mse": lambda a, s: (a - jnp.roll(a, 1, 0)) ** 2 / s,  # an unreduced squared error
    "product": lambda a, s: a * jnp.flip(a, 1) / s,
    "divide": lambda a, s: (s * s) / (jnp.abs(a) + s),
}


def make_range(ops, s, mm=_f32_mm):
    """Matmuls with ``ops`` between them on activations of magnitude about ``s``."""

    def f(p, x):
        h = x
        for k, op in enumerate(ops):
            a = mm(h, p["w"][k % N_W]) * s
            h = jnp.tanh(RANGE_OPS[op](a, s) / s)
        return jnp.mean(jnp.tanh(mm(h, p["w"][-1])))

    return f


def _f16_mm(a, b):
    """A matmul with its operands cast to float16 by hand."""
    return jnp.matmul(
        a.astype(jnp.float16), b.astype(jnp.float16), preferred_element_type=jnp.float32
    )


@settings(max_examples=6, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(
    st.lists(st.sampled_from(sorted(RANGE_OPS)), min_size=1, max_size=3),
    st.sampled_from([10.0, 100.0, 300.0, 1000.0]),
)
@example(["square"], 300.0)
@example(["mse", "pow3"], 1000.0)
def test_random_float16_range(ops, s):
    """Under ``policy="float16"``: finite, and as close to float32 as the
    program with its matmul operands cast to float16 by hand."""
    f = make_range(ops, s)
    fns = {"f32": f, "f16": amp(f, policy="float16"), "hand": make_range(ops, s, _f16_mm)}
    r = jax.jit(lambda p, x: {k: jax.value_and_grad(g)(p, x) for k, g in fns.items()})(PARAMS, X)
    for got, hand, want in zip(*(jax.tree.leaves(r[k]) for k in ("f16", "hand", "f32"))):
        assert bool(jnp.all(jnp.isfinite(got))), (ops, s)
        scale = max(1e-3, float(jnp.max(jnp.abs(want))))
        err = float(jnp.max(jnp.abs(got - want)))
        err_hand = float(jnp.max(jnp.abs(hand - want)))
        assert err <= 2 * err_hand + 0.01 * scale, (ops, s, err, err_hand, scale)


# -- solver loops whose exit test reads an error carried from the body ---------------


def make_solver(prefix, tol):
    """A fixed-point iteration ``z <- tanh(z @ W + h)`` after ``prefix``: its
    relative step size is carried out of the body and read by the exit test."""
    w = PARAMS["w"][1] * 0.5

    def f(p, x):
        h = _prefix(prefix, p, x)

        def body(c):
            z, err, i = c
            zn = jnp.tanh(z @ w + h)
            return zn, jnp.max(jnp.abs(zn - z)) / (jnp.max(jnp.abs(zn)) + 1e-8), i + 1

        init = (jnp.zeros_like(h), jnp.float32(1.0), 0)
        z, _, n = lax.while_loop(lambda c: (c[1] > tol) & (c[2] < 300), body, init)
        return z, n

    return f


def _prefix(program, p, x):
    h = x @ p["w"][0]
    saved = h
    for kind, k in program:
        h = _step(kind, k, p, h, saved, _f32_mm)
        saved = h if kind in ("dot", "ln") else saved
    return jnp.tanh(h)


@settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(
    st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, N_W - 1)), max_size=3),
    st.sampled_from([1e-4, 1e-5, 1e-6]),
    st.sampled_from(["bfloat16", "float16"]),
)
@example([], 1e-5, "bfloat16")
def test_random_solver_loop_exits_as_float32(prefix, tol, policy):
    """The loop stops after as many iterations as in float32 (a bf16 step
    size never falls below the tolerance) and finds float32's fixed point."""
    f = make_solver(prefix, tol)
    (z32, n32), (z, n) = jax.jit(lambda p, x: (f(p, x), amp(f, policy=policy)(p, x)))(PARAMS, X)
    assert int(n32) < 300
    assert abs(int(n) - int(n32)) <= 1, (prefix, tol, policy, int(n), int(n32))
    # (the prefix's matmuls run in the compute dtype: h, and so the fixed point, moves)
    np.testing.assert_allclose(z, z32, atol={"bfloat16": 3e-2, "float16": 4e-3}[policy])
