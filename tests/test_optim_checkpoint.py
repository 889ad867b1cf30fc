"""Orbax save/restore: N steps + save + restore + M steps == N+M steps, bitwise."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from amp_jax import optim


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (8, 4)).astype(jnp.bfloat16),
        "b": jnp.zeros((4,), jnp.bfloat16),
        "step": jnp.zeros((), jnp.int32),
    }


def _float_only(tx):
    # Integer parameters get no optimizer updates (optax.masked).
    return optax.masked(
        tx, lambda p: jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), p)
    )


WRAPPERS = {
    # (inside _float_only's optax.masked, which cannot pass ScaledGradients on:
    # the tests scale the gradients by hand, check_scaled=False)
    "dynamic_loss_scale": lambda: optim.dynamic_loss_scale(
        optim.master_weights(optax.adamw(1e-2)),
        init_scale=2.0**4,
        growth_interval=2,
        check_scaled=False,
    ),
    "static_loss_scale": lambda: optim.static_loss_scale(optax.adam(1e-2), 8.0, check_scaled=False),
    "master_weights": lambda: optim.master_weights(optax.adam(1e-2)),
    "kahan_summation": lambda: optim.kahan_summation(optax.adam(1e-3)),
    "stochastic_rounding": lambda: optim.stochastic_rounding(optax.adam(1e-3), jax.random.key(5)),
    "adamw_kahan_bf16_moments": lambda: optim.adamw(
        optax.cosine_decay_schedule(1e-3, 10),
        mu_dtype=jnp.bfloat16,
        nu_dtype=jnp.bfloat16,
        kahan=True,
        weight_decay=1e-2,
    ),
    "loss_scale_around_multisteps": lambda: optim.dynamic_loss_scale(
        optax.MultiSteps(optim.adamw(1e-2), 2),
        init_scale=4.0,
        growth_interval=1,
        check_scaled=False,
    ),
}


def _grads(params, i, with_inf):
    def one(p):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            return jnp.zeros_like(p)
        g = jax.random.normal(jax.random.fold_in(jax.random.key(11), i), p.shape)
        if with_inf:  # one overflowing step (i == 2) exercises the skip path
            g = jnp.where(i == 2, g.at[(0,) * g.ndim].set(jnp.inf), g)
        return g.astype(p.dtype)

    return jax.tree.map(one, params)


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(
            np.asarray(x).reshape(-1).view(np.uint8), np.asarray(y).reshape(-1).view(np.uint8)
        )


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_resume_is_bitwise_identical(name, tmp_path):
    tx = _float_only(WRAPPERS[name]())
    params = _params()
    has_scale = "loss_scale" in name
    dynamic = has_scale and name != "static_loss_scale"

    @jax.jit
    def step(params, state, i):
        g = _grads(params, i, dynamic)
        if has_scale:
            g = jax.tree.map(lambda x: x * optim.loss_scale(state).astype(x.dtype), g)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    n, m = 3, 3
    p_ref, s_ref = params, tx.init(params)
    for i in range(n + m):
        p_ref, s_ref = step(p_ref, s_ref, i)

    p, s = params, tx.init(params)
    for i in range(n):
        p, s = step(p, s, i)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": p, "opt_state": s})
        ckptr.wait_until_finished()
    abstract = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract)
    _assert_bitwise(restored, {"params": p, "opt_state": s})
    p, s = restored["params"], restored["opt_state"]
    assert type(s) is type(s_ref)
    for i in range(n, n + m):
        p, s = step(p, s, i)
    _assert_bitwise(p, p_ref)
    _assert_bitwise(s, s_ref)
    if dynamic:
        found = optim._tree.find_states(s, optim.DynamicLossScaleState)
        assert int(found[0][1].skipped_steps) == 1
        # the telemetry counters survive the checkpoint: 6 steps, the third skipped
        stats = {k: float(v) for k, v in optim.loss_scale_stats(s).items()}
        assert stats["steps"] == n + m and stats["skipped_steps"] == 1
        assert stats["last_skipped_step"] == 3
