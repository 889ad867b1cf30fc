"""A small training run: pure bf16 + Kahan / master weights match float32."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

from amp_jax import optim

_D, _N, _STEPS, _LR = 32, 256, 1000, 1e-3


def _data():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (_N, _D))
    w0 = 1.0 + 0.5 * jax.random.normal(k[1], (_D,))
    w_star = w0 + 0.3 * jax.random.normal(k[2], (_D,))
    y = x @ w_star + 0.2 * jax.random.normal(k[3], (_N,))
    return x, y, w0


def _loss(params, x, y):
    # The loss is computed in float32: only the parameter storage differs.
    pred = x @ params["w"].astype(jnp.float32) + params["b"].astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _train(make_tx, dtype):
    x, y, w0 = _data()
    tx = make_tx()
    params = {"w": w0.astype(dtype), "b": jnp.zeros((), dtype)}

    def body(carry, _):
        p, s = carry
        g = jax.grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=_STEPS)
    assert p["w"].dtype == dtype
    return _loss(p, x, y), _loss(params, x, y)


def _adamw(**kw):
    # float32 moments everywhere so only the parameter update rounding differs.
    return optim.adamw(_LR, mu_dtype=jnp.float32, nu_dtype=jnp.float32, **kw)


@pytest.fixture(scope="module")
def losses():
    return {
        "float32": _train(_adamw, jnp.float32),
        "bf16": _train(_adamw, jnp.bfloat16),
        "bf16+kahan": _train(lambda: _adamw(kahan=True), jnp.bfloat16),
        "bf16+master": _train(lambda: optim.master_weights(_adamw()), jnp.bfloat16),
        "bf16+sr": _train(lambda: optim.stochastic_rounding(_adamw(), 0), jnp.bfloat16),
    }


def test_float32_reference_trains(losses):
    final, initial = (float(v) for v in losses["float32"])
    assert final < 0.05 * initial


@pytest.mark.parametrize("name", ["bf16+kahan", "bf16+master"])
def test_kahan_and_master_weights_match_float32(losses, name):
    ref = float(losses["float32"][0])
    assert abs(float(losses[name][0]) - ref) <= 0.02 * ref


def test_plain_bf16_is_measurably_worse(losses):
    # lr * update ~ 1e-3 is below half a bf16 ulp for |w| >= 0.5: round to
    # nearest cancels most updates.
    ref = float(losses["float32"][0])
    assert float(losses["bf16"][0]) > 5.0 * ref


def test_stochastic_rounding_recovers_most_of_the_gap(losses):
    assert float(losses["bf16+sr"][0]) < 0.25 * float(losses["bf16"][0])
