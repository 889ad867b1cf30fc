"""optax's shared optimizer checks, in our words, over every amp_jax.optim
transformation and every adamw state format: convergence on small problems,
dtype preservation, state stability under jit and lax.cond, composition with
optax's wrappers, complex64 and float64 (x64) parameters.

One compiled program per transformation and check, on problems of a few
elements. Marked ``heavy`` (~25 s of CPU, ~1.5 min on 2 loaded cores): the
newest-JAX leg runs it; the regression tests of each item run on every leg
(tests/test_optim_*.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim

pytestmark = pytest.mark.heavy

_Q = {"min_quantized_size": 1, "block_size": 4}

# name -> (factory of a transformation with learning rate `lr`, loss-scaled?)
OPTIMIZERS = {
    "adamw": (lambda lr: optim.adamw(lr, weight_decay=0.0), False),
    "adamw_kahan": (lambda lr: optim.adamw(lr, weight_decay=0.0, kahan=True), False),
    "adamw_bf16_moments": (
        lambda lr: optim.adamw(lr, weight_decay=0.0, mu_dtype=jnp.bfloat16, nu_dtype=jnp.float32),
        False,
    ),
    "adamw_8bit": (lambda lr: optim.adamw(lr, weight_decay=0.0, state_format="8bit", **_Q), False),
    "adamw_4bit": (lambda lr: optim.adamw(lr, weight_decay=0.0, state_format="4bit", **_Q), False),
    "adamw_float8": (
        lambda lr: optim.adamw(lr, weight_decay=0.0, state_format="float8", **_Q),
        False,
    ),
    "scale_by_any_precision_adam": (
        lambda lr: optax.chain(optim.scale_by_any_precision_adam(), optax.scale(-lr)),
        False,
    ),
    "scale_by_quantized_adam": (
        lambda lr: optax.chain(optim.scale_by_quantized_adam(**_Q), optax.scale(-lr)),
        False,
    ),
    "master_weights": (lambda lr: optim.master_weights(optax.adam(lr)), False),
    "kahan_summation": (lambda lr: optim.kahan_summation(optax.adam(lr)), False),
    "stochastic_rounding": (lambda lr: optim.stochastic_rounding(optax.adam(lr), 0), False),
    "dynamic_loss_scale": (
        lambda lr: optim.dynamic_loss_scale(optax.adam(lr), init_scale=2.0**10),
        True,
    ),
    "static_loss_scale": (lambda lr: optim.static_loss_scale(optax.adam(lr), 2.0**10), True),
}
NAMES = sorted(OPTIMIZERS)


def _grads_for(tx_name, grads, state):
    """The gradients ``update`` takes: loss scalers get ``ScaledGradients``."""
    if not OPTIMIZERS[tx_name][1]:
        return grads
    scale = optim.loss_scale(state)
    return optim.ScaledGradients(jax.tree.map(lambda g: g * scale.astype(g.dtype), grads))


# --- the problems in one pytree: the losses are separable, one compile each.
# The parabola (1-D) and the matrix target (2-D) together are the mixed 1-D/2-D
# target (optax runs it as a separate problem: here it is the same two leaves).
_PARABOLA = jnp.array([1.0, -1.0, 2.0, 0.5])
_MATRIX = jnp.array([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])


def _small(dtype=jnp.float32):
    """The mixed target: a parabola and a matrix target, both from zeros."""
    return {"parabola": jnp.zeros(4, dtype), "matrix": jnp.zeros((2, 3), dtype)}


def _problems(dtype=jnp.float32):
    return _small(dtype) | {"rosenbrock": jnp.array([-0.5, 0.5], dtype)}


def _losses(p):
    f32 = jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), p)
    out = {
        "parabola": jnp.sum((f32["parabola"] - _PARABOLA) ** 2),
        "matrix": jnp.sum((f32["matrix"] - _MATRIX) ** 2),
    }
    out["mixed"] = out["parabola"] + out["matrix"]  # 22.5 from zeros
    if "rosenbrock" in f32:
        x, y = f32["rosenbrock"][0], f32["rosenbrock"][1]
        out["rosenbrock"] = (1.0 - x) ** 2 + 100.0 * (y - x**2) ** 2
    return out


def _loss(p):
    return sum(v for k, v in _losses(p).items() if k != "mixed")


def _train(name, tx, params, steps):
    def body(_, carry):
        p, s = carry
        g = _grads_for(name, jax.grad(_loss)(p), s)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(lambda p, s: jax.lax.fori_loop(0, steps, body, (p, s)))(params, tx.init(params))


@pytest.mark.parametrize("name", NAMES)
def test_converges_on_parabola_rosenbrock_matrix_and_mixed_targets(name):
    params, _ = _train(name, OPTIMIZERS[name][0](0.02), _problems(), 1500)
    final = {k: float(v) for k, v in _losses(params).items()}
    for k in ("parabola", "matrix", "mixed"):
        assert final[k] < 1e-3, (k, final)
    assert final["rosenbrock"] < 5e-3, final  # from 6.5 (optax.adam: see the baseline test)
    np.testing.assert_allclose(np.asarray(params["rosenbrock"]), [1.0, 1.0], atol=0.15)


def test_baseline_optax_adam_on_the_same_problems():
    # what the tolerances above are measured against
    params, _ = _train("adamw", optax.adam(0.02), _problems(), 1500)
    assert float(_losses(params)["rosenbrock"]) < 5e-3


def _one_step(name, tx, params, grads, state):
    return tx.update(_grads_for(name, grads, state), state, params)


def _assert_like(new, old):
    assert jax.tree.structure(new) == jax.tree.structure(old)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        assert a.dtype == b.dtype and a.shape == b.shape


def _wrap(tx):
    """optax's wrappers, each around the next: MultiSteps (every 2 steps) of
    apply_if_finite of masked (the 2-D leaves); the other leaves pass through
    masked as their gradients, inside apply_if_finite's check."""
    masked = optax.masked(tx, lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
    return optax.MultiSteps(optax.apply_if_finite(masked, 2), 2)


def _wrapped(name):
    make, scaled = OPTIMIZERS[name]
    if not scaled:
        return _wrap(make(1e-2))
    inner = _wrap(optax.adam(1e-2))  # the loss scaler goes outermost
    if "dynamic" in name:
        return optim.dynamic_loss_scale(inner)
    return optim.static_loss_scale(inner, 2.0**10)


@pytest.mark.parametrize("name", NAMES)
def test_dtypes_state_under_cond_and_wrappers_multisteps_masked_apply_if_finite(name):
    # one jit: the step as a lax.cond branch (the other branch returns the
    # state unchanged and zero updates in the parameters' dtypes: the branches
    # must agree), and the step inside MultiSteps, apply_if_finite and masked;
    # on bf16 parameters (float32, float64: the convergence tests)
    txs = {"plain": OPTIMIZERS[name][0](1e-2), "wrapped": _wrapped(name)}
    params = _small(jnp.bfloat16)
    states = {w: tx.init(params) for w, tx in txs.items()}

    @jax.jit
    def step(p, g, states):
        skip = lambda: (jax.tree.map(jnp.zeros_like, p), states["plain"])  # noqa: E731
        plain = lambda: _one_step(name, txs["plain"], p, g, states["plain"])  # noqa: E731
        return {
            "plain": jax.lax.cond(g["parabola"][0] > 0, plain, skip),
            "wrapped": _one_step(name, txs["wrapped"], p, g, states["wrapped"]),
        }

    ps = {w: params for w in txs}
    for g in (0.25, 0.5, jnp.inf, 0.5):  # MultiSteps applies steps 2 and 4 (non-finite)
        grads = jax.tree.map(lambda p: jnp.full_like(p, g), params)
        out = step(params, grads, states)
        for w in txs:
            _assert_like(out[w][0], params)  # updates in the gradients' (= params') dtype
            _assert_like(out[w][1], states[w])
            ps[w] = optax.apply_updates(ps[w], out[w][0])
            _assert_like(ps[w], params)
        states = {w: out[w][1] for w in txs}
    for x, x0 in zip(jax.tree.leaves(ps["wrapped"]), jax.tree.leaves(params)):
        assert bool(jnp.all(jnp.isfinite(x))) and not bool(jnp.all(x == x0))  # moved, no inf
    if name != "dynamic_loss_scale":  # (which skips a non-finite step itself)
        assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(ps["plain"]))


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("adamw")])
def test_inject_hyperparams(name):
    kw = {"weight_decay": 0.0}
    if "bit" in name or "float8" in name:
        kw |= {"state_format": name.split("_")[1], **_Q}
    static = ("state_format", "min_quantized_size", "block_size", "mu_dtype", "nu_dtype")
    tx = optax.inject_hyperparams(optim.adamw, static_args=static)(learning_rate=0.05, **kw)
    params, state = _train(name, tx, _small(), 100)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.05)
    assert float(_losses(params)["mixed"]) < 1.0  # from 22.5


@pytest.mark.parametrize("name", [n for n in NAMES if n != "adamw_bf16_moments"])
def test_complex64_parabola(name):  # (a real moment dtype cannot hold a complex moment)
    target = jnp.array([1.0 + 2.0j, -0.5 - 1.0j, 0.25j, 1.0], jnp.complex64)
    tx = OPTIMIZERS[name][0](0.05)
    loss = lambda z: jnp.sum(jnp.abs(z - target) ** 2)

    def body(_, carry):
        z, s = carry
        g = _grads_for(name, jnp.conj(jax.grad(loss)(z)), s)
        u, s = tx.update(g, s, z)
        return optax.apply_updates(z, u), s

    z0 = jnp.zeros(4, jnp.complex64)
    z, _ = jax.jit(lambda z, s: jax.lax.fori_loop(0, 200, body, (z, s)))(z0, tx.init(z0))
    assert z.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(z), np.asarray(target), atol=0.05)


# float64 parameters under these: already as wide as their float32 masters / compensation
_REDUNDANT_ON_FLOAT64 = ("adamw_kahan", "kahan_summation", "master_weights")


@pytest.mark.parametrize("name", NAMES)
def test_float64_under_x64(name):
    with jax.enable_x64(True):
        tx = OPTIMIZERS[name][0](0.05)
        if name in _REDUNDANT_ON_FLOAT64:
            with pytest.warns(UserWarning, match="all float64 or wider does nothing useful"):
                params, state = _train(name, tx, _small(jnp.float64), 100)
        else:
            params, state = _train(name, tx, _small(jnp.float64), 100)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(params))
        assert float(_losses(params)["mixed"]) < 1.0  # from 22.5
