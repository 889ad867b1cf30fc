"""Failure modes that users of other mixed-precision systems ran into, replayed on amp_jax.

Each test names, in its docstring, what went wrong elsewhere (PyTorch
autocast and GradScaler, apex, DeepSpeed, Keras mixed precision, jmp, Flax
``dtype=``, bitsandbytes, Transformer Engine, torchdistx, torchtitan) and
checks that amp_jax, used as its docs say, does not do the same. The ones
already covered elsewhere in the suite (gradient accumulation with a loss
scale, the clipping order, the growth step, checkpoint resume of the loss
scale and quantized states, remat, custom_vjp dtypes, weight swaps,
donation, ``inject_hyperparams``, parameter groups) are not repeated here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import amp, optim


def _dtypes_of(fn, *args, prim: str) -> list[str]:
    """The output dtypes of every ``prim`` eqn in the (flattened) jaxpr of ``fn``."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == prim:
                found.extend(str(v.aval.dtype) for v in eqn.outvars)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_half_precision_sum_of_many_values_does_not_overflow():
    """autocast/Keras float16: a sum over many activations overflowed float16's
    65504 and the loss became inf. amp accumulates reductions in float32."""
    w = jnp.full((256, 256), 0.5)
    x = jnp.ones((512, 256))
    f = lambda w, x: jnp.sum(x @ w)  # 512*256 values of 128: 1.7e7
    got = amp(f, policy="float16")(w, x)
    assert np.isfinite(got)
    np.testing.assert_allclose(got, f(w, x), rtol=1e-3)
    assert "float16" not in _dtypes_of(amp(f, policy="float16"), w, x, prim="reduce_sum")


def test_layer_norm_variance_of_inputs_with_a_large_mean():
    """apex O2 / Keras mixed_float16: a layer norm computed in half precision
    (E[x^2] - E[x]^2 of inputs with a large mean) lost the variance to
    cancellation and divided by ~0. amp keeps normalisation statistics float32."""

    def layer_norm(x, w):
        h = x @ w + 300.0  # a large mean, a small spread
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(h * h, -1, keepdims=True) - mean * mean
        return (h - mean) * jax.lax.rsqrt(var + 1e-5)

    w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
    x = jax.random.normal(jax.random.key(1), (32, 64))
    want = layer_norm(x, w)
    for pol in ("bfloat16", "float16"):
        got = amp(layer_norm, policy=pol)(x, w)
        assert got.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(got)))
        # the dot's rounding moves h by ~1e-2 relative to its spread: a few percent
        assert float(jnp.abs(got - want).mean()) < 0.05


def test_a_tiny_epsilon_does_not_flush_to_zero():
    """Keras/autocast float16: an epsilon of 1e-8 (Adam, a norm) is 0 in float16,
    and a constant input divided by its zero spread gave NaN. amp never turns
    a float32 literal into float16 where it is divided by or added to a variance."""

    def normalize(x, w):
        h = x @ w
        var = jnp.var(h, -1, keepdims=True)
        return (h - h.mean(-1, keepdims=True)) / jnp.sqrt(var + 1e-8)

    x, w = jnp.ones((16, 64)), jnp.ones((64, 64))  # every row constant: var == 0
    got = amp(normalize, policy="float16")(x, w)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_array_equal(got, normalize(x, w))


def test_dropout_masks_are_those_of_float32():
    """Flax dtype=bfloat16 / Keras: random numbers drawn in bf16 (8 bits of
    mantissa) biased the dropout rate. amp never changes random-number ops,
    so the mask is bitwise float32's."""

    def f(x, w, key):
        h = x @ w
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        return jnp.where(keep, h / 0.9, 0.0)

    x = jax.random.normal(jax.random.key(0), (64, 128))
    w = jax.random.normal(jax.random.key(1), (128, 128)) / 11
    key = jax.random.key(2)
    np.testing.assert_array_equal(amp(f)(x, w, key) == 0, f(x, w, key) == 0)
    uniform = _dtypes_of(amp(lambda k: jax.random.uniform(k, (8,))), key, prim="random_bits")
    assert uniform and "bfloat16" not in uniform


def test_a_fully_masked_attention_row_matches_float32():
    """autocast float16: a mask of -1e9 overflows float16 to -inf, and a row
    masked everywhere gave NaN where float32 gave a uniform softmax. amp keeps
    the mask's add and the softmax in float32."""

    def attend(q, k, v, mask):
        s = (q @ k.T) / 8.0 + jnp.where(mask, 0.0, -1e9)
        return jax.nn.softmax(s, axis=-1) @ v

    q = jax.random.normal(jax.random.key(0), (16, 64))
    k = jax.random.normal(jax.random.key(1), (16, 64))
    v = jax.random.normal(jax.random.key(2), (16, 64))
    mask = jnp.ones((16, 16), bool).at[3].set(False)
    want = attend(q, k, v, mask)
    got = amp(attend, policy="float16")(q, k, v, mask)
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got[3], want[3], rtol=2e-2, atol=2e-2)


def test_embedding_gradients_accumulate_in_float32():
    """torchtitan / Flax dtype=bfloat16: the scatter-add of an embedding's
    gradient in bf16 lost the contributions of frequent tokens. Under amp the
    gradient of a gather comes back float32 and sums as float32 does."""
    table = jax.random.normal(jax.random.key(0), (32, 64))
    w = jax.random.normal(jax.random.key(1), (64, 64)) / 8
    ids = jnp.zeros(4096, jnp.int32).at[::7].set(5)  # token 0 repeated ~3500 times

    def loss(table, w):
        return jnp.mean((table[ids] @ w) ** 2)

    want = jax.grad(loss)(table, w)
    got = jax.grad(amp(loss))(table, w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got[0], want[0], rtol=0.03, atol=1e-4)
    assert "bfloat16" not in _dtypes_of(jax.grad(amp(loss)), table, w, prim="scatter-add")


def test_position_ids_from_a_cumulative_sum_stay_exact():
    """HF/Flax bf16 models: position ids from a cumsum of a mask in bf16 stop
    at 256 (bf16 counts integers exactly only up to 2**8). amp keeps cumsum float32."""

    def positions(mask, w):
        pos = jnp.cumsum(mask, axis=-1)
        return pos, (mask[None] @ w)

    mask = jnp.ones(1024)
    w = jnp.ones((1024, 64))
    pos, _ = amp(positions)(mask, w)
    np.testing.assert_array_equal(pos, np.arange(1, 1025))


def test_rotary_angles_at_long_positions_stay_float32():
    """HF Llama/GPT-NeoX in bf16: rotary angles position * frequency computed in
    bf16 were off by whole radians at positions in the thousands. amp computes
    them (the multiply feeding sin/cos) in float32."""

    def rope(x, w):
        pos = jnp.arange(4096, dtype=jnp.float32)[:, None]
        freq = 1.0 / (10000.0 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64))
        angle = pos * freq
        h = x @ w
        return h[:, :32] * jnp.cos(angle) - h[:, 32:] * jnp.sin(angle)

    x = jax.random.normal(jax.random.key(0), (4096, 64))
    w = jax.random.normal(jax.random.key(1), (64, 64)) / 8
    want, got = rope(x, w), amp(rope)(x, w)
    # only the dot's bf16 operands differ: no error of whole radians at the far end
    np.testing.assert_allclose(got[-64:], want[-64:], atol=0.1)
    assert "bfloat16" not in _dtypes_of(amp(rope), x, w, prim="sin")


def test_pure_bf16_tiny_updates_are_not_lost_with_kahan():
    """torchdistx AnyPrecisionAdamW: pure bf16 parameters stop moving when the
    update is below half an ulp (lr 1e-5 on weights near 1). Kahan summation
    keeps the lost part and applies it."""
    p = {"w": jnp.ones(256, jnp.bfloat16)}
    g = {"w": jnp.ones(256, jnp.bfloat16)}
    plain, kahan = (
        optax.adamw(1e-5, weight_decay=0.0),
        optim.adamw(1e-5, weight_decay=0.0, kahan=True),
    )

    def run(tx):
        def step(c, _):
            params, state = c
            u, state = tx.update(g, state, params)
            return (optax.apply_updates(params, u), state), None

        (params, _), _ = jax.lax.scan(step, (p, tx.init(p)), None, length=300)
        return params["w"]

    assert bool(jnp.all(jax.jit(lambda: run(plain))() == 1))  # stalled: 1e-5 < half an ulp
    moved = jax.jit(lambda: run(kahan))().astype(jnp.float32)
    np.testing.assert_allclose(moved, 1 - 300 * 1e-5, rtol=2e-3)


def test_a_skipped_step_changes_neither_weights_nor_optimizer_state():
    """GradScaler / DeepSpeed: on an overflowing step the optimizer still
    decayed the weights (AdamW's weight decay) or advanced its moments. A step
    dynamic_loss_scale skips leaves parameters, moments and count as they were."""
    params = {"w": jnp.ones((8, 8), jnp.float16)}
    tx = optim.dynamic_loss_scale(optim.master_weights(optax.adamw(1e-2, weight_decay=0.1)))
    state = tx.init(params)
    loss = amp(lambda p, x: jnp.sum(x @ p["w"]), policy="float16")
    x = jnp.full((4, 8), 6e4)  # overflows float16 in the forward pass
    _, grads = optim.scaled_value_and_grad(loss, state)(params, x)
    updates, new_state = tx.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new_params["w"], params["w"])
    np.testing.assert_array_equal(
        optim.master_params(new_state)["w"], optim.master_params(state)["w"]
    )
    inner_old = [x for x in jax.tree.leaves(state) if x.dtype == jnp.float32 and x.ndim == 2]
    inner_new = [x for x in jax.tree.leaves(new_state) if x.dtype == jnp.float32 and x.ndim == 2]
    for a, b in zip(inner_old, inner_new):
        np.testing.assert_array_equal(a, b)
    assert float(optim.loss_scale(new_state)) < float(optim.loss_scale(state))


@pytest.mark.parametrize("policy", ["float8", "bfloat16"])
def test_a_call_does_not_depend_on_earlier_calls(policy):
    """Transformer Engine: float8 scales from an amax history carried between
    steps (and lost or stale after a checkpoint resume) made a step's result
    depend on earlier steps. amp's scales are computed from the step's own
    values: the same inputs give the same output whatever ran before."""
    w = jax.random.normal(jax.random.key(0), (256, 256)) / 16
    x = jax.random.normal(jax.random.key(1), (128, 256))
    f = jax.jit(amp(lambda w, x: jnp.tanh(x @ w), policy=policy))
    first = f(w, x)
    f(w * 1000.0, x * 1000.0)  # a step with very different ranges in between
    np.testing.assert_array_equal(f(w, x), first)


def test_outputs_keep_the_callers_dtypes():
    """autocast: tensors produced inside the autocast region came out in
    float16 and broke float32 code after it (an optimizer, a metric, a
    concatenation with float32 values). amp returns what the function would."""

    def f(w, x):
        h = x @ w
        return h, jnp.tanh(h).astype(jnp.bfloat16), {"n": jnp.sum(h)}

    w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
    got = amp(f, policy="float16")(w, x)
    want = f(w, x)
    assert [a.dtype for a in jax.tree.leaves(got)] == [a.dtype for a in jax.tree.leaves(want)]
