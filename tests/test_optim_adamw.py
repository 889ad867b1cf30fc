"""Any-precision AdamW."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim


def _params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (16, 8)).astype(dtype),
        "b": (jax.random.normal(k2, (8,)) * 0.1).astype(dtype),
    }


def _run(tx, params, steps=6, seed=0):
    state = tx.init(params)

    @jax.jit
    def step(params, state, i):
        g = jax.tree.map(
            lambda p: jax.random.normal(
                jax.random.fold_in(jax.random.key(seed), i), p.shape
            ).astype(p.dtype),
            params,
        )
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    for i in range(steps):
        params, state = step(params, state, i)
    return params, state


_SCHED = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6)


@pytest.mark.parametrize(
    "lr,wd,mask",
    [
        (1e-2, 0.0, None),
        (1e-2, 1e-2, None),
        (_SCHED, 1e-2, {"w": True, "b": False}),
    ],
)
def test_bitwise_equal_to_optax_adamw(lr, wd, mask):
    params = _params()
    ours = optim.adamw(lr, b1=0.8, b2=0.99, eps=1e-7, weight_decay=wd, mask=mask)
    ref = optax.adamw(lr, b1=0.8, b2=0.99, eps=1e-7, weight_decay=wd, mask=mask)
    p1, s1 = _run(ours, params)
    p2, s2 = _run(ref, params)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bitwise_equal_with_inject_hyperparams():
    params = _params()
    sched = optax.linear_schedule(1e-2, 1e-3, 5)
    ours = optax.inject_hyperparams(optim.adamw)(learning_rate=sched, weight_decay=1e-3)
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=sched, weight_decay=1e-3)
    p1, s1 = _run(ours, params)
    p2, _ = _run(ref, params)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(float(s1.hyperparams["learning_rate"]), float(sched(6)), rtol=1e-6)


@pytest.mark.parametrize(
    "mu_dtype,nu_dtype,pdtype",
    [
        (None, None, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
        (None, None, jnp.bfloat16),
    ],
)
def test_state_dtypes_are_stable(mu_dtype, nu_dtype, pdtype):
    params = _params(pdtype)
    tx = optim.adamw(1e-3, mu_dtype=mu_dtype, nu_dtype=nu_dtype)
    state0 = tx.init(params)
    _, state = _run(tx, params, steps=2)
    adam = state[0]
    assert isinstance(adam, optax.ScaleByAdamState)
    assert adam.count.dtype == jnp.int32 and int(adam.count) == 2
    for leaf in jax.tree.leaves(adam.mu):
        assert leaf.dtype == (mu_dtype or pdtype)
    for leaf in jax.tree.leaves(adam.nu):
        assert leaf.dtype == (nu_dtype or pdtype)
    for a, b in zip(jax.tree.leaves(state0), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.shape == b.shape


def test_bf16_second_moment_moves_although_b2_rounds_to_one():
    assert float(jnp.asarray(0.999, jnp.bfloat16)) == 1.0  # the trap
    params = {"w": jnp.zeros(4, jnp.bfloat16)}
    tx = optim.adamw(1e-3, nu_dtype=jnp.bfloat16, mu_dtype=jnp.bfloat16)
    state = tx.init(params)
    for _ in range(10):
        _, state = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, state, params)
    expected = 1.0 - 0.999**10
    nu = np.asarray(state[0].nu["w"], np.float32)
    np.testing.assert_allclose(nu, expected, rtol=2.0**-7)
    # A naive bfloat16 moment update (b2 in bfloat16) never moves off zero.
    naive = jnp.zeros(4, jnp.bfloat16)
    for _ in range(10):
        b2 = jnp.asarray(0.999, jnp.bfloat16)
        naive = (1 - b2) * jnp.ones(4, jnp.bfloat16) + b2 * naive
    np.testing.assert_array_equal(np.asarray(naive, np.float32), 0.0)


def test_kahan_state_and_tracking():
    params = _params(jnp.bfloat16)
    tx = optim.adamw(1e-4, kahan=True, mu_dtype=jnp.float32, nu_dtype=jnp.bfloat16)
    state = tx.init(params)
    assert isinstance(state, optim.KahanSummationState)
    assert all(c.dtype == jnp.bfloat16 for c in jax.tree.leaves(state.compensation))
    tx32 = optim.adamw(1e-4, kahan=True, compensation_dtype=jnp.float32)
    assert all(c.dtype == jnp.float32 for c in jax.tree.leaves(tx32.init(params).compensation))
    # bf16 params with Kahan follow float32 AdamW; without, they stall.
    ref, _ = _run(
        optim.adamw(1e-4), jax.tree.map(lambda p: p.astype(jnp.float32), params), steps=20
    )
    pk, sk = _run(tx, params, steps=20)
    pp, _ = _run(optim.adamw(1e-4), params, steps=20)
    start = np.asarray(params["w"], np.float32)
    # The compensated value p + c is what Kahan tracks (p alone moves only when
    # the accumulated change reaches a bf16 rounding step).
    comp_sum = np.asarray(pk["w"], np.float32) + np.asarray(sk.compensation["w"], np.float32)
    err_k = np.abs(comp_sum - np.asarray(ref["w"]))
    err_p = np.abs(np.asarray(pp["w"], np.float32) - np.asarray(ref["w"]))
    assert err_k.mean() < 0.25 * err_p.mean()
    assert np.mean(np.asarray(pp["w"], np.float32) == start) > 0.5


def test_errors():
    with pytest.raises(ValueError, match="`mu_dtype`"):
        optim.adamw(1e-3, mu_dtype=jnp.int32)
    with pytest.raises(ValueError, match="`nu_dtype`"):
        optim.adamw(1e-3, nu_dtype="int8")
    with pytest.raises(ValueError, match="`compensation_dtype`"):
        optim.adamw(1e-3, compensation_dtype=jnp.float32)


def test_defaults_are_optax_adamw_defaults():
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    g = {"w": jnp.full((2, 3), 0.1)}
    ours, ref = optim.adamw(1e-1), optax.adamw(1e-1)
    u1, _ = ours.update(g, ours.init(params), params)
    u2, _ = ref.update(g, ref.init(params), params)
    np.testing.assert_array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))


# --- optax's contract: complex parameters, x64, the signature, state dtypes ------


def _complex_params():
    k1, k2 = jax.random.split(jax.random.key(1))
    re, im = jax.random.normal(k1, (16, 8)), jax.random.normal(k2, (16, 8))
    return {"w": (re + 1j * im).astype(jnp.complex64), "b": jnp.full(8, 0.5 - 0.25j, jnp.complex64)}


@pytest.mark.parametrize("state_format", [None, "8bit"])
def test_complex_second_moment_is_abs_squared_like_optax(state_format):
    kw = {} if state_format is None else {"state_format": state_format, "min_quantized_size": 1}
    params = _complex_params()
    p1, _ = _run(optim.adamw(1e-2, **kw), params)
    p2, _ = _run(optax.adamw(1e-2), params)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        assert a.dtype == b.dtype == jnp.complex64
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    tx, z = optim.adamw(0.1), jnp.zeros(1, jnp.complex64)
    u, _ = tx.update(jnp.array([1 + 1j], jnp.complex64), tx.init(z), z)
    np.testing.assert_allclose(np.asarray(u), -0.1 * (1 + 1j) / np.sqrt(2), rtol=1e-5)


def test_complex_parabola_converges():
    target = jnp.array([1.0 + 2.0j, -3.0 - 0.5j], jnp.complex64)
    loss = lambda z: jnp.sum(jnp.abs(z - target) ** 2)
    tx = optim.adamw(0.05, weight_decay=0.0)
    z, state = jnp.zeros(2, jnp.complex64), tx.init(jnp.zeros(2, jnp.complex64))

    @jax.jit
    def step(z, state):
        g = jnp.conj(jax.grad(loss)(z))  # the steepest-descent direction, as optax's tests
        u, state = tx.update(g, state, z)
        return optax.apply_updates(z, u), state

    for _ in range(400):
        z, state = step(z, state)
    np.testing.assert_allclose(np.asarray(z), np.asarray(target), atol=1e-2)


@pytest.mark.parametrize("state_format", ["8bit", "4bit", "float8"])
def test_quantized_states_on_float64_parameters_under_x64(state_format):
    kw = {"state_format": state_format, "min_quantized_size": 1}
    with jax.enable_x64(True):
        params = {"w": jnp.linspace(-1.0, 1.0, 2 * 300, dtype=jnp.float64).reshape(2, 300)}
        p64, s64 = _run(optim.adamw(1e-2, **kw), params)
        p32, s32 = _run(
            optim.adamw(1e-2, **kw), jax.tree.map(lambda x: x.astype(jnp.float32), params)
        )
        assert p64["w"].dtype == jnp.float64
        for a, b in zip(jax.tree.leaves(s64), jax.tree.leaves(s32)):
            assert a.dtype == b.dtype and a.shape == b.shape  # float32 codes and absmax
        # the moments are float32 whatever the parameters: same updates to float32 precision
        np.testing.assert_allclose(np.asarray(p64["w"]), np.asarray(p32["w"]), atol=1e-6)


def test_positional_arguments_are_optax_adamws():
    import inspect

    ours = list(inspect.signature(optim.adamw).parameters.values())
    ref = list(inspect.signature(optax.adamw).parameters.values())
    positional = [p.name for p in ours if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [p.name for p in ref if p.kind == p.POSITIONAL_OR_KEYWORD]
    for p in ours:
        if p.name in positional:
            assert p.default == inspect.signature(optax.adamw).parameters[p.name].default
    # a call ported from optax means the same thing: the fifth argument is eps_root
    params = _params()
    args = (1e-2, 0.8, 0.99, 1e-7, 1e-3, None, 1e-2, {"w": True, "b": False})
    p1, _ = _run(optim.adamw(*args), params)
    p2, _ = _run(optax.adamw(*args), params)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weight_decay_schedule_like_optax():
    params = _params()
    wd = optax.linear_schedule(0.5, 0.0, 6)
    p1, s1 = _run(optim.adamw(1e-2, weight_decay=wd), params)
    p2, s2 = _run(optax.adamw(1e-2, weight_decay=wd), params)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p3, _ = _run(optim.adamw(1e-2, weight_decay=0.0), params)
    assert not np.allclose(np.asarray(p1["w"]), np.asarray(p3["w"]))
    with pytest.raises(TypeError, match="`weight_decay`.*number or a schedule"):
        optim.adamw(1e-3, weight_decay="0.1")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", jnp.float8_e5m2])
@pytest.mark.parametrize("arg", ["mu_dtype", "nu_dtype"])
def test_float8_moment_dtype_refused_at_construction(arg, dtype):
    with pytest.raises(ValueError, match=rf"adamw: `{arg}`=float8.*state_format='float8'"):
        optim.adamw(1e-3, **{arg: dtype})
    with pytest.raises(ValueError, match=rf"`{arg}`=float8.*state_format='float8'"):
        optim.scale_by_any_precision_adam(**{arg: dtype})


# --- 16-bit parameters updated with rounding to nearest (issue 56 item 7) ------------


def _float16_params() -> dict[str, jax.Array]:
    w = jax.random.uniform(jax.random.key(0), (64, 64), minval=0.05, maxval=0.2)
    return {"w": w.astype(jnp.float16)}


def test_a_plain_adamw_over_float16_parameters_warns_once_naming_the_fixes():
    params = _float16_params()
    tx = optim.adamw(1e-5, state_format="8bit", min_quantized_size=1)
    with pytest.warns(optim.RoundedAwayWarning, match="float16") as record:
        state = tx.init(params)
    (message,) = [str(w.message) for w in record]
    for fix in ("master_weights", "kahan_summation", "stochastic_rounding"):
        assert fix in message
    # what it warns about is real: one step leaves most weights where they were
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    still = float(jnp.mean(new["w"] == params["w"]))
    assert still > 0.3, still
    # once per transformation: a second init (a restart, a retrace) is quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error", optim.RoundedAwayWarning)
        tx.init(params)


@pytest.mark.parametrize(
    "dtype, make",
    [
        (jnp.float32, lambda: optim.adamw(1e-5)),
        (jnp.float16, lambda: optim.master_weights(optim.adamw(1e-5))),
        (jnp.float16, lambda: optim.adamw(1e-5, kahan=True)),
        (jnp.float16, lambda: optim.kahan_summation(optim.adamw(1e-5, state_format="8bit"))),
        (jnp.float16, lambda: optim.stochastic_rounding(optim.adamw(1e-5), jax.random.key(1))),
    ],
    ids=["float32", "master_weights", "kahan", "kahan_quantized", "stochastic_rounding"],
)
def test_no_rounding_warning_where_the_updates_land(dtype, make):
    params = jax.tree.map(lambda p: p.astype(dtype), _float16_params())
    tx = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", optim.RoundedAwayWarning)
        tx.init(params)
