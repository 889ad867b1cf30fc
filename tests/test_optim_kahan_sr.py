"""kahan_summation and stochastic_rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim

# ----------------------------------------------------------------- Kahan ---


@pytest.mark.parametrize("comp", [None, jnp.float32])
def test_kahan_state_structure(comp):
    params = {
        "w": jnp.ones((3, 2), jnp.bfloat16),
        "s": jnp.ones(2, jnp.float32),
        "i": jnp.arange(2),
    }
    tx = optim.kahan_summation(optax.sgd(0.1), compensation_dtype=comp)
    state = tx.init(params)
    assert isinstance(state, optim.KahanSummationState)
    assert state._fields == ("compensation", "inner_state")
    assert state.compensation["w"].dtype == (comp or jnp.bfloat16)
    assert state.compensation["w"].shape == (3, 2)
    assert state.compensation["s"].dtype == jnp.float32
    assert isinstance(state.compensation["i"], optax.MaskedNode)
    state2 = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)[1]
    assert jax.tree.structure(state2) == jax.tree.structure(state)


def test_kahan_invariant_exact_with_float32_compensation():
    # p_new + c_new == p + (c + u) exactly (the rounding error is all kept).
    params = (jax.random.normal(jax.random.key(0), (512,)) * 4).astype(jnp.bfloat16)
    tx = optim.kahan_summation(optax.sgd(1.0), compensation_dtype=jnp.float32)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(5):
        g = jax.random.normal(jax.random.key(i + 1), (512,)) * 1e-3
        c_old = np.asarray(state.compensation, np.float64)
        updates, state = step(g.astype(jnp.bfloat16), state, params)
        new = optax.apply_updates(params, updates)
        assert new.dtype == jnp.bfloat16 and updates.dtype == jnp.bfloat16
        # The update is the compensated increment c + u, in the gradients' dtype.
        y = np.float32(c_old) - np.asarray(g.astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(np.asarray(updates), y.astype(jnp.bfloat16))
        # ... and the compensation keeps the rounding of the update too
        lhs = np.asarray(new, np.float64) + np.asarray(state.compensation, np.float64)
        rhs = np.asarray(params, np.float64) + y
        np.testing.assert_array_equal(lhs, rhs)
        params = new


def test_kahan_follows_float32_sum_where_plain_bf16_stalls():
    n = 200
    p0 = jnp.full((4,), 1.0, jnp.bfloat16)
    g = jnp.full((4,), -1e-3, jnp.bfloat16)  # each step adds ~1e-3 < ulp/2
    kahan = optim.kahan_summation(optax.sgd(1.0))
    plain = optax.sgd(1.0)

    def run(tx):
        def body(carry, _):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p0, tx.init(p0)), None, length=n)[0][0]

    exact = 1.0 + n * float(-g[0].astype(jnp.float32))
    kp = np.asarray(jax.jit(lambda: run(kahan))(), np.float32)
    pp = np.asarray(jax.jit(lambda: run(plain))(), np.float32)
    np.testing.assert_array_equal(pp, 1.0)  # round-to-nearest loses them all
    assert np.all(np.abs(kp - exact) <= 2.0**-7)  # within one bf16 ulp


def test_kahan_errors_and_pass_through():
    with pytest.raises(ValueError, match="`compensation_dtype`"):
        optim.kahan_summation(optax.sgd(0.1), compensation_dtype=jnp.int8)
    tx = optim.kahan_summation(optax.identity())
    params = {"i": jnp.arange(3), "f": jnp.ones(1, jnp.bfloat16)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs `params`"):
        tx.update(params, state)
    updates, _ = tx.update(
        {"i": jnp.array([4, 5, 6]), "f": jnp.ones(1, jnp.bfloat16)}, state, params
    )
    np.testing.assert_array_equal(np.asarray(updates["i"]), [4, 5, 6])
    assert updates["i"].dtype == params["i"].dtype


# ---------------------------------------------------- stochastic rounding ---


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "p0,step", [(1.0, 1.5e-3), (-3.0, 7.3e-3), (0.0123, -1.1e-5), (200.0, 0.3)]
)
def test_stochastic_rounding_unbiased(dtype, p0, step):
    n = 100_000
    params = jnp.full((n,), p0, dtype)
    tx = optim.stochastic_rounding(optax.sgd(1.0), jax.random.key(42))
    state = tx.init(params)
    grads = jnp.full((n,), -step, jnp.float32)
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert new.dtype == dtype and updates.dtype == grads.dtype  # optax: the gradients'
    exact = np.float64(np.float32(np.asarray(params[0], np.float32)) + np.float32(step))
    vals = np.asarray(new, np.float64)
    # Only the two neighbours of the exact value appear...
    lo, hi = vals.min(), vals.max()
    assert lo <= exact <= hi and len(np.unique(vals)) == 2
    assert np.nextafter(np.asarray(lo, dtype), np.asarray(np.inf, dtype)) == hi
    # ...and the mean is the exact value (round-to-nearest is off by far more).
    assert abs(vals.mean() - exact) <= 3e-5 * abs(exact)
    rtn = np.float64(np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype), np.float32))
    assert abs(rtn - exact) > 3e-5 * abs(exact)


def test_stochastic_rounding_state_and_key_handling():
    params = {"b": jnp.ones(8, jnp.bfloat16), "f": jnp.ones(8, jnp.float32), "i": jnp.arange(2)}
    grads = {"b": jnp.full(8, -1e-3, jnp.bfloat16), "f": jnp.full(8, -1e-3), "i": jnp.array([5, 6])}
    for key in [jax.random.key(3), jax.random.PRNGKey(3), 3]:
        tx = optim.stochastic_rounding(optax.sgd(1.0), key)
        state = tx.init(params)
        assert isinstance(state, optim.StochasticRoundingState)
        assert state._fields == ("key", "inner_state")
        assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
        u1, s1 = jax.jit(tx.update)(grads, state, params)
        u1b, _ = jax.jit(tx.update)(grads, state, params)
        u2, s2 = jax.jit(tx.update)(grads, s1, params)
        assert not np.array_equal(np.asarray(state.key), np.asarray(s1.key))
        np.testing.assert_array_equal(np.asarray(u1["b"]), np.asarray(u1b["b"]))
        assert not np.array_equal(np.asarray(u1["b"]), np.asarray(u2["b"]))
        # float32 parameters and non-float leaves get the inner update as is.
        np.testing.assert_array_equal(np.asarray(u1["f"]), np.full(8, 1e-3, np.float32))
        plain = optax.sgd(1.0).update(grads, optax.sgd(1.0).init(params))[0]
        assert u1["i"].dtype == plain["i"].dtype
        np.testing.assert_array_equal(np.asarray(u1["i"]), np.asarray(plain["i"]))
    with pytest.raises(ValueError, match="needs `params`"):
        tx.update(grads, state)


def test_stochastic_rounding_non_finite():
    params = jnp.array([1.0, 2.0, 3.0], jnp.bfloat16)
    tx = optim.stochastic_rounding(optax.identity(), 0)
    u, _ = tx.update(jnp.array([jnp.nan, jnp.inf, -jnp.inf]), tx.init(params), params)
    new = optax.apply_updates(params, u)
    assert np.isnan(float(new[0]))
    assert float(new[1]) == np.inf and float(new[2]) == -np.inf


def test_bfloat16_stochastic_rounding_never_overflows_a_finite_value():
    """Round-to-nearest of 0x1.fe02p+127 is bfloat16's maximum; rounding up must
    not give inf (it did 0.4% of the time before the clamp)."""
    from amp_jax.optim._stochastic import _round_bf16

    x = jnp.full((20000,), float.fromhex("0x1.fe02p+127"), jnp.float32)
    bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint32)
    for sign in (1.0, -1.0):
        out = _round_bf16(sign * x, bits)
        assert bool(jnp.all(jnp.isfinite(out)))
        assert float(out[0]) == sign * float(jnp.finfo(jnp.bfloat16).max)


# ------------------------------------------------- rounding XLA keeps ---


def _sweep(n=20_000):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-46, 39, n)
    edge = [
        1e-39,
        3e-40,
        1e-45,
        6e-5,
        3e-8,
        2.9802322e-08,
        1e-7,
        7e4,
        65519.0,
        65520.0,
        3.4e38,
        0.0,
        np.inf,
        np.nan,
    ]
    x = np.concatenate([x, edge]).astype(np.float32)
    return np.concatenate([x, -x])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_round_nearest_is_the_cast_under_jit(dtype):
    # The explicit rounding equals NumPy's round-to-nearest-even cast, with
    # subnormals, overflow and NaN, compiled on the default backend.
    from amp_jax.optim._rounding import round_nearest

    x = _sweep()
    with np.errstate(over="ignore"):
        ref = x.astype(dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: round_nearest(v, dtype))(x))
    same = (got == ref) & (np.signbit(got) == np.signbit(ref))
    same |= np.isnan(got) & np.isnan(ref)
    assert same.all(), (x[~same][:5], got[~same][:5], ref[~same][:5])


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.kahan_summation(optax.sgd(1.0)),
        lambda: optim.adamw(1e-3, kahan=True),
        lambda: optim.stochastic_rounding(optax.sgd(1.0), 0),
        lambda: optim.master_weights(optax.sgd(1.0)),
    ],
    ids=["kahan", "adamw-kahan", "stochastic-f16", "master"],
)
def test_rounding_survives_in_the_optimized_hlo(make):
    # Under excess precision (XLA's default on GPU) a float32 -> low -> float32
    # convert pair is dropped; the rounding these algorithms measure must be a
    # reduce-precision op in the program XLA runs.
    dtype = jnp.float16
    params = jnp.ones(64, dtype)
    tx = make()
    state = tx.init(params)
    hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
    assert "reduce-precision" in hlo, hlo[-2000:]
