"""master_weights: landing bitwise, master trajectory equals float32 training."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim


def _bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(
        np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
    )


def _params(dtype, key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "w": (jax.random.normal(k1, (64, 8)) * 3).astype(dtype),
        "b": (jax.random.normal(k2, (8,)) * 1e-3).astype(dtype),
    }


def test_state_structure():
    params = _params(jnp.bfloat16)
    tx = optim.master_weights(optax.adam(1e-3))
    state = tx.init(params)
    assert isinstance(state, optim.MasterWeightsState)
    assert state._fields == ("master", "inner_state")
    assert jax.tree.structure(state.master) == jax.tree.structure(params)
    for m, p in zip(jax.tree.leaves(state.master), jax.tree.leaves(params)):
        assert m.dtype == jnp.float32
        _bits_equal(m.astype(p.dtype), p)
    # The inner optimizer is built from the float32 master copy.
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.inner_state[0].mu))
    assert optim.master_params(state) is state.master


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_apply_updates_lands_on_cast_master_bitwise(dtype):
    params = _params(dtype)
    tx = optim.master_weights(optax.sgd(0.5))
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    for i in range(20):
        # Gradients spanning many magnitudes: tiny (lost in `dtype`) to large.
        g = jax.tree.map(
            lambda p: (
                jax.random.normal(jax.random.key(100 + i), p.shape)
                * 10.0 ** jax.random.randint(jax.random.key(i), p.shape, -6, 2)
            ).astype(dtype),
            params,
        )
        old = params
        params, state, updates = step(params, state, g)
        for p0, p, m, u in zip(
            jax.tree.leaves(old),
            jax.tree.leaves(params),
            jax.tree.leaves(optim.master_params(state)),
            jax.tree.leaves(updates),
        ):
            assert p.dtype == dtype and m.dtype == jnp.float32
            assert u.dtype == dtype  # the gradients' dtype, as optax's updates
            _lands_on_cast_master(p0, p, m, u)


def _lands_on_cast_master(p0, p, m, u):
    """``p`` (``p0`` + the update ``u``, applied) is the cast master ``m``
    bitwise wherever the step is within a factor 2 of ``p0`` (Sterbenz: the
    difference is exact in ``p0``'s dtype), and within half an ulp of ``u``
    elsewhere."""
    target = np.asarray(m.astype(p.dtype), np.float64)
    a, b = np.asarray(p0, np.float64), target
    sterbenz = (
        (np.sign(a) == np.sign(b)) & (np.abs(b) >= np.abs(a) / 2) & (np.abs(b) <= 2 * np.abs(a))
    )
    sterbenz |= a == b
    got = np.asarray(p, np.float64)
    np.testing.assert_array_equal(got[sterbenz], target[sterbenz])
    half_ulp = np.abs(np.asarray(u, np.float64)) * 2.0 ** -(jnp.finfo(p.dtype).nmant + 1)
    assert np.all(
        np.abs(got - target) <= half_ulp + np.abs(target) * 2.0 ** -jnp.finfo(p.dtype).nmant
    )


def test_master_trajectory_equals_float32_training_bitwise():
    params16 = _params(jnp.bfloat16)
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params16)
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.cosine_decay_schedule(1e-2, 30), weight_decay=1e-3),
    )
    mw = optim.master_weights(inner)
    s16, s32 = mw.init(params16), inner.init(params32)

    @jax.jit
    def step(p16, s16, p32, s32, g16):
        u16, s16 = mw.update(g16, s16, p16)
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), g16)
        u32, s32 = inner.update(g32, s32, p32)
        return (optax.apply_updates(p16, u16), s16, optax.apply_updates(p32, u32), s32)

    for i in range(15):
        g = jax.tree.map(
            lambda p: jax.random.normal(jax.random.key(i), p.shape).astype(jnp.bfloat16), params16
        )
        params16, s16, params32, s32 = step(params16, s16, params32, s32, g)
    for a, b in zip(jax.tree.leaves(optim.master_params(s16)), jax.tree.leaves(params32)):
        _bits_equal(a, b)
    for a, b in zip(jax.tree.leaves(s16.inner_state), jax.tree.leaves(s32)):
        _bits_equal(a, b)


def test_float32_params_get_inner_updates_unchanged():
    # An update of 1e-8 on 1.0 is absorbed by float32 rounding: passed through
    # unchanged it stays 1e-8; recomputed as (master - param) it would be 0.
    params = {"w": jnp.array([1.0, 1e-8], jnp.float32)}
    tx = optim.master_weights(optax.sgd(1.0))
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([-1e-8, 0.0])}, state, params)
    _bits_equal(updates["w"], jnp.array([1e-8, -0.0], jnp.float32))
    new = optax.apply_updates(params, updates)
    _bits_equal(new["w"], optim.master_params(state)["w"])


def test_donated_step_with_float32_leaves():
    """bf16 weights next to float32 norm scales (the usual mixed tree): the
    float32 master leaves are copies, not the parameters' own buffers, so a
    step that donates params and state runs (it failed with "donate the same
    buffer twice" when init returned the float32 parameter itself)."""
    params = {"w": jnp.ones((4, 4), jnp.bfloat16), "scale": jnp.ones(4, jnp.float32)}
    tx = optim.master_weights(optax.adam(1e-3))
    state = tx.init(params)
    assert state.master["scale"] is not params["scale"]
    assert state.master["scale"].unsafe_buffer_pointer() != params["scale"].unsafe_buffer_pointer()

    @jax.jit
    def grads(p):
        return jax.grad(lambda p: jnp.sum(p["w"].astype(jnp.float32)) + jnp.sum(p["scale"]))(p)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s):
        u, s = tx.update(grads(p), s, p)
        return optax.apply_updates(p, u), s

    for _ in range(2):
        params, state = step(params, state)
    np.testing.assert_allclose(params["scale"], 1 - 2e-3, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_extreme_shrinks_land_near_and_the_next_step_exactly(dtype):
    # The master copy jumps from large values to tiny ones in one step: an
    # update in the parameters' dtype cannot land there exactly (no such
    # number exists), but the master stays exact and the next (small) step
    # lands on it again.
    m = jnp.array([2.0**10 + 2.0**-3, -3000.5, 1000.0, 2.0**14], jnp.float32)
    params = m.astype(dtype)
    tx = optim.master_weights(optax.sgd(1.0))
    state = tx.init(params)
    g = m - jnp.array([2.0**-12, -3e-7, 1.5e-3, 0.0], jnp.float32)
    updates, state = tx.update(g, state, params)
    assert updates.dtype == g.dtype  # the gradients' dtype, as optax's
    new = optax.apply_updates(params, updates)
    master = optim.master_params(state)
    np.testing.assert_array_equal(np.asarray(master), np.asarray(params.astype(jnp.float32) - g))
    _lands_on_cast_master(params, new, master, updates)
    small = (master * 1e-3).astype(dtype)
    updates, state = tx.update(small, state, new)
    _bits_equal(optax.apply_updates(new, updates), optim.master_params(state).astype(dtype))


def test_float16_overflow_stays_inf_not_nan():
    params = jnp.array([60000.0, 1.0], jnp.float16)
    tx = optim.master_weights(optax.sgd(1.0))
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update(jnp.array([-10000.0, 0.0]), state, params)
        params = optax.apply_updates(params, updates)
        assert bool(jnp.isposinf(params[0])) and float(params[1]) == 1.0
    assert float(optim.master_params(state)[0]) == 80000.0


def test_non_float_params_pass_through():
    params = {"f": jnp.ones(2, jnp.bfloat16), "i": jnp.arange(3)}
    tx = optim.master_weights(optax.identity())
    state = tx.init(params)
    assert state.master["i"].dtype == params["i"].dtype
    grads = {"f": jnp.full(2, 0.5, jnp.bfloat16), "i": jnp.array([7, 8, 9])}
    updates, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(np.asarray(updates["i"]), [7, 8, 9])
    assert updates["i"].dtype == params["i"].dtype
    np.testing.assert_array_equal(np.asarray(state.master["i"]), [0, 1, 2])
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(np.asarray(new["f"], np.float32), [1.5, 1.5])


def test_errors():
    with pytest.raises(ValueError, match="`master_dtype`"):
        optim.master_weights(optax.sgd(0.1), master_dtype=jnp.int32)
    tx = optim.master_weights(optax.sgd(0.1))
    state = tx.init(jnp.ones(2, jnp.bfloat16))
    with pytest.raises(ValueError, match="needs `params`"):
        tx.update(jnp.ones(2, jnp.bfloat16), state)
    with pytest.raises(ValueError, match="master_weights"):
        optim.master_params(optax.sgd(0.1).init(jnp.ones(2)))
    two = optax.chain(tx, optim.master_weights(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="found 2"):
        optim.master_params(two.init(jnp.ones(2)))


# -- master weights or Kahan summation over float32 parameters warn: they buy nothing -------


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: optim.master_weights(optax.sgd(1.0)), "master_weights"),
        (lambda: optim.kahan_summation(optax.sgd(1.0)), "kahan_summation"),
        (lambda: optim.adamw(1e-3, kahan=True), "kahan_summation"),
    ],
    ids=["master_weights", "kahan_summation", "adamw-kahan"],
)
def test_redundant_over_float32_parameters_warns(make, name):
    params32 = {"w": jnp.ones(3), "step": jnp.arange(3)}
    with pytest.warns(UserWarning, match=f"{name}.*all float32 or wider.*bfloat16"):
        make().init(params32)
    # one low-precision leaf is what these transforms are for: no warning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make().init({"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(3)})
    assert not [w for w in seen if "all float32" in str(w.message)]
