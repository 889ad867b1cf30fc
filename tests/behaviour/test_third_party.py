"""Real third-party code under amp, on CPU, a few training steps each:
Equinox's MLP (default activation) and MultiheadAttention, a Flax NNX
attention stack, and optax wrappers around ``amp_jax.optim``. Each is
compared with float32 and, where precision is involved, with the same model
cast to bf16 by hand (amp's error within 2x the hand-cast one)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import BF16, eqns
from flax import nnx

from amp_jax import amp, dtype_report, optim

STEPS = 5


def _hand_bf16(fn):
    """``fn`` with every float32 array argument cast to bf16 and the result cast back."""

    def cast(t):
        return jax.tree.map(
            lambda a: (
                a.astype(jnp.bfloat16) if isinstance(a, jax.Array) and a.dtype == jnp.float32 else a
            ),
            t,
        )

    def run(*args):
        return jax.tree.map(lambda o: o.astype(jnp.float32), fn(*cast(args)))

    return run


def _train(model_fn, params, x, y, wrap, tx=None):
    """Losses of STEPS optimizer steps (default SGD) of ``wrap(model_fn)`` on (x, y)."""
    tx = tx or optax.sgd(0.1)
    run = wrap(model_fn)

    def loss(p, x, y):
        return jnp.mean((run(p, x) - y) ** 2)

    @jax.jit
    def step(p, s, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state, losses = tx.init(params), []
    for _ in range(STEPS):
        params, state, value = step(params, state, x, y)
        losses.append(float(value))
    return np.array(losses), params


def _compare(model_fn, params, x, y):
    """amp against float32 and hand-cast bf16: the loss curve and the weights."""
    ref, p32 = _train(model_fn, params, x, y, lambda f: f)
    got, pamp = _train(model_fn, params, x, y, amp)
    hand, phand = _train(model_fn, params, x, y, _hand_bf16)
    assert got[-1] < got[0], got  # it trains
    err_amp = np.max(np.abs(got - ref) / np.abs(ref))
    err_hand = np.max(np.abs(hand - ref) / np.abs(ref))
    assert err_amp <= 2 * err_hand + 1e-4, (err_amp, err_hand)
    assert jax.tree.map(lambda a: a.dtype, pamp) == jax.tree.map(lambda a: a.dtype, p32)
    assert _dist(pamp, p32) <= 2 * _dist(phand, p32) + 1e-6


def _dist(a, b):
    return float(optax.tree_utils.tree_norm(jax.tree.map(jnp.subtract, a, b)))


def _assert_runs_low(fn, *args):
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(amp(fn)(*a))))(*args)
    dots = [e for e, _ in eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert any(np.dtype(e.invars[0].aval.dtype) == BF16 for e in dots)


def test_equinox_mlp_with_its_default_activation():
    """``eqx.nn.MLP``'s default ``relu`` crashed XLA:CPU under ``grad`` (issue 25)."""
    mlp = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jnp.sin(x[:, :4])

    def model(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    _compare(model, params, x, y)
    _assert_runs_low(model, params, x)


def test_equinox_multihead_attention_stack():
    keys = jax.random.split(jax.random.key(2), 3)
    layers = (
        eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=keys[0]),
        eqx.nn.Linear(16, 16, key=keys[1]),
        eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=keys[2]),
    )
    params, static = eqx.partition(layers, eqx.is_array)
    x = jax.random.normal(jax.random.key(3), (4, 8, 16))
    y = jnp.tanh(x[..., ::-1])

    def model(p, x):
        att1, lin, att2 = eqx.combine(p, static)

        def one(s):
            h = s + att1(s, s, s)
            h = h + jax.vmap(lambda t: jax.nn.gelu(lin(t)))(h)
            return h + att2(h, h, h)

        return jax.vmap(one)(x)

    _compare(model, params, x, y)
    _assert_runs_low(model, params, x)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.att = nnx.MultiHeadAttention(
            num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.mlp = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h = x + self.att(self.norm(x))
        return h + self.mlp(jax.nn.gelu(h))


def test_flax_nnx_attention_stack():
    blocks = nnx.Sequential(_NnxBlock(nnx.Rngs(0)), _NnxBlock(nnx.Rngs(1)))
    graphdef, params = nnx.split(blocks)
    x = jax.random.normal(jax.random.key(4), (4, 8, 16))
    y = jnp.tanh(x[..., ::-1])

    def model(p, x):
        return nnx.merge(graphdef, p)(x)

    _compare(model, params, x, y)
    _assert_runs_low(model, params, x)


# -- optax wrappers around amp_jax.optim -----------------------------------------

WRAPPERS = {
    "apply_if_finite": lambda make: optax.apply_if_finite(make(1e-2), 3),
    "MultiSteps": lambda make: optax.MultiSteps(make(1e-2), 2),
    "inject_hyperparams": lambda make: optax.inject_hyperparams(make)(learning_rate=1e-2),
    "masked": lambda make: optax.chain(
        optax.masked(make(1e-2), {"w1": True, "w2": False}),
        optax.masked(optax.sgd(1e-2), {"w1": False, "w2": True}),
    ),
}


def _mlp(p, x):
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_optax_wrappers_around_amp_optim(name):
    """With float32 parameters ``optim.adamw`` computes optax's AdamW, so the
    wrapped amp optimizer follows the wrapped optax one's trajectory; the
    model runs under amp and stays close to float32."""
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    params = {
        "w1": jax.random.normal(k1, (16, 32)) / 4,
        "w2": jax.random.normal(k2, (32, 4)) / 4,
    }
    x = jax.random.normal(k3, (64, 16))
    y = jnp.sin(x[:, :4])
    got, p_amp = _train(_mlp, params, x, y, amp, WRAPPERS[name](optim.adamw))
    same, p_optax = _train(_mlp, params, x, y, amp, WRAPPERS[name](optax.adamw))
    np.testing.assert_allclose(got, same, rtol=1e-3)
    assert _dist(p_amp, p_optax) < 1e-3 * float(optax.tree_utils.tree_norm(p_optax))
    ref, _ = _train(_mlp, params, x, y, lambda f: f, WRAPPERS[name](optax.adamw))
    np.testing.assert_allclose(got, ref, rtol=2e-2)
    if name != "MultiSteps":  # (MultiSteps applies every other step)
        assert got[-1] < got[0]


LOW_PRECISION_OPTIMIZERS = {
    "adamw": lambda: optim.adamw(1e-2),
    "adamw_kahan": lambda: optim.adamw(1e-2, kahan=True),
    "master_weights": lambda: optim.master_weights(optax.adam(1e-2)),
    "stochastic_rounding": lambda: optim.stochastic_rounding(optax.adam(1e-2), 0),
    "8bit": lambda: optim.adamw(1e-2, state_format="8bit", min_quantized_size=0),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("opt", sorted(LOW_PRECISION_OPTIMIZERS))
@pytest.mark.parametrize("wrapper", ["apply_if_finite", "MultiSteps"])
def test_optax_wrappers_with_low_precision_parameters(wrapper, opt, dtype):
    """optax's wrappers put a ``lax.cond`` around the inner update whose other
    branch is built from the gradients (``zeros_like(grads)``): amp's
    optimizers return updates in the gradients' dtype, so it traces, steps
    while the gradients are finite and skips (state bit-identical) when not."""
    tx = WRAPPERS[wrapper](lambda lr: LOW_PRECISION_OPTIMIZERS[opt]())
    params = start = {"w": (jax.random.normal(jax.random.key(0), (64, 64)) / 8).astype(dtype)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    good = {"w": jnp.full((64, 64), 0.5, dtype)}
    for _ in range(2):  # (MultiSteps applies every second step)
        updates, state = step(good, state, params)
        assert updates["w"].dtype == dtype
        params = optax.apply_updates(params, updates)
    assert params["w"].dtype == dtype
    moved = float(
        jnp.max(jnp.abs(params["w"].astype(jnp.float32) - start["w"].astype(jnp.float32)))
    )
    assert moved > 1e-3
    if wrapper == "apply_if_finite":
        bad = {"w": good["w"].at[0, 0].set(jnp.inf)}
        updates, new_state = step(bad, state, params)
        assert not np.any(np.asarray(updates["w"], np.float32))
        for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(state.inner_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_if_finite_inside_static_loss_scale_with_float16_parameters():
    # the composition static_loss_scale's docstring recommends
    tx = optim.static_loss_scale(optax.apply_if_finite(optax.adam(1e-2), 3), 4.0)
    params = jnp.ones(8, jnp.float16)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        _, g = optim.scaled_value_and_grad(lambda p: jnp.sum(p.astype(jnp.float32) ** 2), s)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    new, state, updates = step(params, state)
    assert updates.dtype == jnp.float16 and new.dtype == jnp.float16
    assert float(new[0]) < 1.0


# -- implicit differentiation: optimistix and lineax ------------------------------


def _solver_losses():
    import lineax as lx
    import optimistix as optx

    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    w = jax.random.normal(k1, (32, 32)) / 8
    a = jnp.eye(32) * 4 + jax.random.normal(k2, (32, 32)) / 8
    u = jax.random.normal(k3, (32, 32)) / 8
    solver = optx.FixedPointIteration(rtol=1e-5, atol=1e-5)

    def fixed_point(x):  # the fixed point's gradient is a lineax solve (closure-converted)
        sol = optx.fixed_point(lambda z, a: jnp.tanh(0.5 * z + a), solver, x, args=x)
        return jnp.sum(sol.value)

    def deq(x):  # a matmul inside the solved function, and around it
        sol = optx.fixed_point(lambda z, a: jnp.tanh(0.1 * z + a), solver, x, args=x @ w)
        return jnp.sum((sol.value @ u) ** 2)

    def newton(x):
        root = optx.root_find(
            lambda z, a: z**3 + z - a, optx.Newton(rtol=1e-6, atol=1e-6), x, args=x @ w
        )
        return jnp.sum(root.value**2)

    def matrix_solve(x):
        op = lx.MatrixLinearOperator(a + jnp.outer(x, x) / 64)
        return jnp.sum(lx.linear_solve(op, jnp.tanh(x @ w)).value @ u)

    def function_solve(x):  # an operator from a closure: lineax closure-converts it
        op = lx.FunctionLinearOperator(lambda v: a @ v + 0.1 * x * v, jax.eval_shape(lambda: x))
        return jnp.sum(lx.linear_solve(op, x @ w, lx.AutoLinearSolver(well_posed=True)).value)

    return {f.__name__: f for f in (fixed_point, deq, newton, matrix_solve, function_solve)}


@pytest.mark.parametrize("name", sorted(_solver_losses()))
def test_implicit_differentiation_through_solvers(name):
    loss = _solver_losses()[name]
    x = jnp.linspace(-1, 1, 32)
    v32, g32 = jax.jit(jax.value_and_grad(loss))(x)
    v, g = jax.jit(jax.value_and_grad(amp(loss, policy="float32")))(x)
    np.testing.assert_array_equal(v, v32)
    np.testing.assert_array_equal(g, g32)
    v, g = jax.value_and_grad(amp(loss))(x)  # eager, as well as under jit
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(v, v32, rtol=3e-2, atol=1e-2)
    np.testing.assert_allclose(g, g32, rtol=5e-2, atol=3e-2 * float(jnp.max(jnp.abs(g32))))
    vj, gj = jax.jit(jax.value_and_grad(amp(loss)))(x)
    np.testing.assert_allclose(gj, g32, rtol=5e-2, atol=3e-2 * float(jnp.max(jnp.abs(g32))))
    dots = [r for r in dtype_report(jax.grad(amp(loss)), x) if r[0] == "dot_general"]
    if name in ("matrix_solve", "function_solve"):
        # a matmul whose result a solve reads (or that reads the solution) stays float32
        assert dots and all("bfloat16" not in r[1] for r in dots), dots
    else:
        assert name == "fixed_point" or any(r[1] == "bfloat16,bfloat16" for r in dots), dots
    # (the solver primitive's own jaxprs run as written: float32)
    assert not any(r[3] == "linear_solve" and "bfloat16" in r[1] for r in dots), dots
