"""Real third-party layers (Flax linen and NNX, Equinox) under amp."""

import equinox as eqx
import flax
import jax
import jax.numpy as jnp
import pytest
from _util import F32, check_dots_low, prim_dtypes, rel
from flax import linen as nn
from flax import nnx

from amp_jax import Policy, amp

# Layers at toy sizes: lower every matmul, whatever its size.
LOW = Policy(jnp.bfloat16, min_low_contraction=0, min_low_flops=0)

KEY = jax.random.PRNGKey(0)


def _norm_stats_f32(jaxpr):
    # mean/variance reductions and rsqrt stay float32
    for name in ("reduce_sum", "rsqrt"):
        rows = prim_dtypes(jaxpr, name)
        assert rows, name
        assert all(all(d == F32 for d in i) for i, _, _ in rows), (name, rows)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Conv(8, (3, 3))(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = h.reshape(h.shape[0], -1, 8)
        h = nn.LayerNorm()(h)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return nn.Dense(4)(h.mean(1))


def test_flax_linen_layers():
    x = jax.random.normal(KEY, (2, 6, 6, 3))
    model = LinenNet()
    variables = model.init({"params": KEY, "dropout": KEY}, x, train=False)

    def loss(params, stats, x, rng):
        y, upd = model.apply(
            {"params": params, "batch_stats": stats},
            x,
            train=True,
            rngs={"dropout": rng},
            mutable=["batch_stats"],
        )
        return jnp.mean(y**2), upd

    args = (variables["params"], variables["batch_stats"], x, KEY)
    (l, upd), g = jax.value_and_grad(amp(loss, policy=LOW), has_aux=True)(*args)
    (l0, upd0), g0 = jax.value_and_grad(loss, has_aux=True)(*args)
    assert abs(float(l) - float(l0)) / float(l0) < 3e-2
    assert jax.tree.map(lambda a: a.dtype, upd) == jax.tree.map(lambda a: a.dtype, upd0)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        assert a.dtype == b.dtype == jnp.float32
    assert rel(jax.flatten_util.ravel_pytree(g)[0], jax.flatten_util.ravel_pytree(g0)[0]) < 5e-2
    jaxpr = jax.make_jaxpr(amp(loss, policy=LOW))(*args)
    check_dots_low(jaxpr, min_low=4)  # q, k, v, out projections, Dense
    _norm_stats_f32(jaxpr)


def test_flax_nnx_layers():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.ln = nnx.LayerNorm(16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.att = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            h = self.bn(self.ln(jax.nn.relu(self.l1(x))))
            h = self.drop(self.att(h[:, None, :].repeat(3, 1)).mean(1))
            return self.l2(h)

    model = Net(nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(KEY, (4, 8))

    def writing_loss(params, rest, x):  # writes batch statistics and RNG counts into `rest`
        m = nnx.merge(graphdef, params, rest)
        return jnp.mean(m(x) ** 2)

    # Under jax.grad such writes into Variables of an outer trace are refused,
    # by Flax without amp and by amp's write-back alike: amp behaves as `f` does.
    for f in (writing_loss, amp(writing_loss, policy=LOW)):
        with pytest.raises(flax.errors.TraceContextError):
            jax.grad(f)(params, rest, x)

    def loss(params, rest, x):  # the functional form: the writes land in a copy
        m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
        return jnp.mean(m(x) ** 2)

    l, l0 = amp(loss, policy=LOW)(params, rest, x), loss(params, rest, x)
    assert abs(float(l) - float(l0)) / float(l0) < 3e-2
    g = jax.grad(amp(loss, policy=LOW))(params, rest, x)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(g))
    jaxpr = jax.make_jaxpr(amp(loss, policy=LOW))(params, rest, x)
    check_dots_low(jaxpr, min_low=4)
    _norm_stats_f32(jaxpr)


def test_equinox_layers():
    k1, k2, k3 = jax.random.split(KEY, 3)
    mlp = eqx.nn.MLP(8, 8, 32, 2, key=k1)
    att = eqx.nn.MultiheadAttention(2, 8, key=k2)
    ln = eqx.nn.LayerNorm(8)
    x = jax.random.normal(k3, (5, 8))

    @eqx.filter_value_and_grad
    def loss(models, x):
        mlp, att, ln = models
        h = jax.vmap(mlp)(x)
        h = jax.vmap(ln)(att(h, h, h))
        return jnp.mean(h**2)

    v, g = amp(loss, policy=LOW)((mlp, att, ln), x)
    v0, g0 = loss((mlp, att, ln), x)
    assert abs(float(v) - float(v0)) / float(v0) < 3e-2
    ga, gb = eqx.filter(g, eqx.is_array), eqx.filter(g0, eqx.is_array)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        assert a.dtype == b.dtype
    assert rel(jax.flatten_util.ravel_pytree(ga)[0], jax.flatten_util.ravel_pytree(gb)[0]) < 5e-2
    arrays, static = eqx.partition((mlp, att, ln), eqx.is_array)
    jaxpr = jax.make_jaxpr(
        lambda p: amp(lambda m, x: loss(m, x)[0], policy=LOW)(eqx.combine(p, static), x)
    )(arrays)
    check_dots_low(jaxpr, min_low=3)
    _norm_stats_f32(jaxpr)
