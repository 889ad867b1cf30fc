"""Moment storage as a part: `MomentStorage`, and the transformations built on it
(`scale_by_adam`, `scale_by_lion`, `ema`), with `adamw` a chain of them."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim

BF16 = optim.MomentStorage(dtype=jnp.bfloat16)
Q8 = optim.MomentStorage(format="8bit", min_quantized_size=64)


def _params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (4, 300)).astype(dtype),
        "b": (jax.random.normal(k2, (7,)) * 0.1).astype(dtype),
    }


def _grads(params, i, seed=3):
    key = jax.random.fold_in(jax.random.key(seed), i)
    return jax.tree.map(
        lambda p: (jax.random.normal(key, p.shape) * 1e-2 + 0.01 * p).astype(p.dtype), params
    )


def _run(tx, params, steps=20):
    """``steps`` jitted steps: (params, state, the updates of every step)."""

    @jax.jit
    def step(params, state, i):
        u, state = tx.update(_grads(params, i), state, params)
        return optax.apply_updates(params, u), state, u

    state, updates = tx.init(params), []
    for i in range(steps):
        params, state, u = step(params, state, i)
        updates.append(u)
    return params, state, updates


def _u8(x):
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _bits_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(_u8(x), _u8(y))


@pytest.mark.parametrize(
    "ours,ref",
    [
        (
            lambda: optim.scale_by_adam(0.8, 0.99, 1e-7),
            lambda: optax.scale_by_adam(0.8, 0.99, 1e-7),
        ),
        (lambda: optim.scale_by_lion(0.9, 0.99), lambda: optax.scale_by_lion(0.9, 0.99)),
        (lambda: optim.ema(0.9), lambda: optax.ema(0.9)),
        (lambda: optim.ema(0.99, debias=False), lambda: optax.ema(0.99, debias=False)),
    ],
    ids=["adam", "lion", "ema", "ema-nodebias"],
)
def test_float32_storage_is_optax_bitwise(ours, ref):
    """With float32 moments each part does optax's operations: bitwise under jit."""
    _bits_equal(_run(ours(), _params()), _run(ref(), _params()))


@pytest.mark.parametrize(
    "kwargs,mu,nu",
    [
        (dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16), BF16, BF16),
        (
            dict(mu_dtype=jnp.float16, state_rounding="nearest"),
            optim.MomentStorage(dtype=jnp.float16, rounding="nearest"),
            optim.MomentStorage(rounding="nearest"),
        ),
        (dict(state_format="8bit", min_quantized_size=64), Q8, Q8),
        (
            dict(state_format="4bit", min_quantized_size=64, block_size=64),
            optim.MomentStorage(format="4bit", min_quantized_size=64, block_size=64),
            optim.MomentStorage(format="4bit", min_quantized_size=64, block_size=64),
        ),
    ],
    ids=["bf16", "f16-nearest", "8bit", "4bit"],
)
@pytest.mark.parametrize("pdtype", [jnp.float32, jnp.bfloat16])
def test_adamw_is_the_chain_of_its_parts(kwargs, mu, nu, pdtype):
    """``adamw(...)`` and ``chain(scale_by_adam(mu_storage, nu_storage),
    add_decayed_weights, scale_by_learning_rate)`` are one optimizer: same state
    structure, bitwise equal states and updates under jit."""
    params = _params(pdtype)
    built = optax.chain(
        optim.scale_by_adam(mu_storage=mu, nu_storage=nu),
        optax.add_decayed_weights(1e-2),
        optax.scale_by_learning_rate(1e-2),
    )
    with pytest.warns(optim.RoundedAwayWarning) if pdtype == jnp.bfloat16 else _nothing():
        adamw = optim.adamw(1e-2, weight_decay=1e-2, **kwargs)
        ours = _run(adamw, params)
    _bits_equal(ours, _run(built, params))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("storage", [BF16, Q8], ids=["bf16", "8bit"])
def test_lion_momentum_in_a_narrow_storage_follows_float32_lion(storage):
    """Another optimizer than AdamW from the parts: Lion (optax.chain of
    `scale_by_lion` with its momentum stored in bfloat16 or 8-bit, weight decay
    and the learning rate) stores its momentum as asked and follows float32
    Lion: the momentum within the storage's precision, the updates' signs."""
    params = _params()

    def lion(mu_storage):
        return optax.chain(
            optim.scale_by_lion(mu_storage=mu_storage),
            optax.add_decayed_weights(1e-3),
            optax.scale_by_learning_rate(1e-3),
        )

    p, s, us = _run(lion(storage), params, steps=60)
    p32, s32, us32 = _run(optax.lion(1e-3, weight_decay=1e-3), params, steps=60)
    mu, mu32 = s[0].mu, s32[0].mu
    if storage.format is None:
        assert mu["w"].dtype == mu["b"].dtype == jnp.bfloat16
        decoded = mu
    else:
        assert isinstance(mu["w"], optim.QuantizedArray) and mu["w"].codes.dtype == jnp.uint8
        assert mu["b"].dtype == jnp.float32  # (7 elements: under min_quantized_size)
        decoded = {k: storage.decode(mu[k], params[k].shape) for k in mu}
    # the stored momentum is a random walk around float32's (an error of up to
    # half a gap a step, decaying by b2): rms within 3% (bf16) or 12% (8-bit)
    tol = 0.03 if storage.format is None else 0.12
    for k in mu:
        err = np.asarray(decoded[k], np.float32) - np.asarray(mu32[k])
        rms = np.sqrt(np.mean(np.square(mu32[k])))
        assert np.sqrt(np.mean(err**2)) <= tol * rms, (k, np.sqrt(np.mean(err**2)) / rms)
        assert abs(np.mean(err)) <= 0.1 * tol * rms  # unbiased
    agree = np.mean([np.mean(np.sign(a["w"]) == np.sign(b["w"])) for a, b in zip(us, us32)])
    assert agree > 0.97, agree
    # a step whose sign differs moves a parameter 2 * lr away: 3% of the steps at most
    assert np.mean(np.abs(p["w"] - p32["w"])) <= 2 * 1e-3 * 60 * 0.03


def _hlo(tx, params):
    state = tx.init(params)
    return jax.jit(tx.update).lower(params, state, params).compile().as_text()


def test_stochastic_rounding_of_a_lion_momentum_is_in_the_optimized_hlo():
    """Lion's momentum (decay 0.99) in bfloat16 is rounded stochastically by
    default: the truncation of 16 added random bits (``and`` with 0xFFFF0000)
    is in the compiled program; with ``rounding="nearest"`` it is not."""
    params = {"w": jnp.ones((8, 128))}
    mask = "4294901760"  # 0xFFFF0000
    auto = _hlo(optim.scale_by_lion(mu_storage=BF16), params)
    nearest = _hlo(
        optim.scale_by_lion(mu_storage=optim.MomentStorage(dtype=jnp.bfloat16, rounding="nearest")),
        params,
    )
    assert mask in auto and " and(" in auto
    assert mask not in nearest


def test_ema_in_8bit_and_the_codec_round_trip():
    """`ema` with an 8-bit storage keeps uint8 codes and tracks float32 `ema`;
    the codec's ``encode``/``decode`` round-trip a leaf within a code's gap."""
    params = _params()
    _, s, _ = _run(optim.ema(0.9, storage=Q8), params)
    _, s32, _ = _run(optax.ema(0.9), params)
    assert s.ema["w"].codes.dtype == jnp.uint8
    dec = Q8.decode(s.ema["w"], (4, 300))
    assert dec.dtype == jnp.float32 and dec.shape == (4, 300)
    np.testing.assert_allclose(dec, s32.ema["w"], atol=0.05 * float(jnp.abs(s32.ema["w"]).max()))
    x = jax.random.normal(jax.random.key(1), (4, 300))
    stored = Q8.init({"x": x})["x"]
    back = Q8.decode(jax.jit(Q8.encode)(x, stored), x.shape)
    np.testing.assert_allclose(back, x, rtol=0.08, atol=1e-3)
    nu = optim.MomentStorage(format="4bit", min_quantized_size=0)
    v = x * x
    s2 = nu.encode(v, nu.init(v, second_moment=True), second_moment=True)
    assert s2.codes.shape == (4, 3, 64)  # two codes per byte, blocks of 128
    assert float(jnp.min(nu.decode(s2, v.shape, second_moment=True))) > 0  # no zero code


def test_mixed_storages_in_one_adam():
    """mu 8-bit, nu bfloat16: a quantized state whose nu leaves are bfloat16 arrays,
    updates close to float32 Adam's."""
    params = _params()
    tx = optim.scale_by_adam(mu_storage=Q8, nu_storage=BF16)
    _, s, us = _run(tx, params)
    _, _, us32 = _run(optax.scale_by_adam(), params)
    assert isinstance(s, optim.ScaleByQuantizedAdamState)
    assert isinstance(s.mu["w"], optim.QuantizedArray) and s.nu["w"].dtype == jnp.bfloat16
    err, ref = np.asarray(us[-1]["w"] - us32[-1]["w"]), np.asarray(us32[-1]["w"])
    assert np.sqrt(np.mean(err**2)) <= 0.1 * np.sqrt(np.mean(ref**2))


def test_state_round_trips_through_jit():
    tx = optim.scale_by_adam(mu_storage=Q8, nu_storage=optim.MomentStorage(format="float8"))
    s = tx.init(_params())
    back = jax.jit(lambda s: s)(s)
    assert jax.tree.structure(back) == jax.tree.structure(s)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: optim.MomentStorage(dtype=jnp.float8_e4m3fn), "format='float8'"),
        (lambda: optim.MomentStorage(dtype=jnp.int8), "floating dtype"),
        (lambda: optim.MomentStorage(dtype=jnp.bfloat16, format="8bit"), "pass one of them"),
        (lambda: optim.MomentStorage(block_size=64), "pass a format"),
        (lambda: optim.MomentStorage(format="3bit"), "`format` must be"),
        (lambda: optim.MomentStorage(format="4bit", block_size=63), "even"),
        (lambda: optim.MomentStorage(rounding="up"), "`rounding` must be"),
        (
            lambda: optim.scale_by_adam(nu_storage=optim.MomentStorage(dtype=jnp.float16)),
            "bfloat16",
        ),
        (lambda: optim.scale_by_adam(0.9, mu_dtype=jnp.bfloat16, mu_storage=BF16), "both"),
        (lambda: optim.scale_by_lion(mu_storage=jnp.bfloat16), "MomentStorage"),
    ],
)
def test_bad_storage_is_refused_naming_the_fix(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_storage_is_a_frozen_hashable_record():
    s = optim.MomentStorage(format="8bit")
    assert s.block_size == 256 and s == optim.MomentStorage(format="8bit", block_size=256)
    assert hash(s) == hash(optim.MomentStorage(format="8bit"))
    with pytest.raises(AttributeError):
        s.format = "4bit"  # type: ignore[misc]


def test_the_parts_doctests_pass():
    for mod in ("_storage", "_moments", "_quantized", "_codes"):
        module = importlib.import_module(f"amp_jax.optim.{mod}")
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, mod
