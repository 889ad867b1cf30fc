"""Training a few steps under amp with each supported library.

Each test checks the structure (dot_general operands are bfloat16 inside the
amp-rewritten step, except batched dots on CPU, see ``_util.check_dots_low``),
that gradients come back in the parameters' dtype, and that the loss goes down.
The code mirrors the examples in docs/integrations.md.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"  # before keras is imported anywhere

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import keras
import optax
from _util import F16, check_dots_low, prim_dtypes
from flax import linen as nn
from flax import nnx

from amp_jax import amp, optim

KEY = jax.random.PRNGKey(0)
STEPS = 25


def _data(n=128, d=16, classes=4):
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (n, d))
    y = jnp.argmax(x @ jax.random.normal(kw, (d, classes)), -1)  # a learnable labelling
    return x, y


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _assert_decreases(losses):
    losses = [float(l) for l in losses]
    assert all(jnp.isfinite(jnp.asarray(losses))), losses
    assert losses[-1] < 0.7 * losses[0], losses


def _train_with_state(loss_fn, params, state, x, y):
    """STEPS of adam on ``loss_fn(params, state, x, y) -> (loss, state)``."""
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, state, opt_state):
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss, grads

    losses = []
    for _ in range(STEPS):
        params, state, opt_state, loss, grads = step(params, state, opt_state)
        losses.append(loss)
    _assert_decreases(losses)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    return params, state, losses


# --- Haiku -------------------------------------------------------------------


def test_haiku_transform_with_state():
    def forward(x, is_training):
        h = hk.Linear(64)(x)
        h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
        return hk.Linear(4)(jax.nn.relu(h))

    model = hk.transform_with_state(forward)
    x, y = _data()
    params, state = model.init(KEY, x, is_training=True)
    state_dtypes = jax.tree.map(lambda s: s.dtype, state)

    @amp
    def loss_fn(params, state, x, y):
        logits, state = model.apply(params, state, None, x, is_training=True)
        return _ce(logits, y), state

    params, state, _ = _train_with_state(loss_fn, params, state, x, y)
    assert jax.tree.map(lambda s: s.dtype, state) == state_dtypes  # float32 BatchNorm statistics
    check_dots_low(jax.make_jaxpr(jax.grad(loss_fn, has_aux=True))(params, state, x, y), min_low=4)


# --- Keras 3 (JAX backend) -----------------------------------------------------


def test_keras_stateless_call():
    assert keras.backend.backend() == "jax"
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="gelu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(4),
        ]
    )
    x, y = _data()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    @amp
    def loss_fn(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return _ce(logits, y), non_trainable

    trainable, non_trainable, losses = _train_with_state(loss_fn, trainable, non_trainable, x, y)
    check_dots_low(
        jax.make_jaxpr(jax.grad(loss_fn, has_aux=True))(trainable, non_trainable, x, y), min_low=4
    )
    # write the trained values back into the Keras model and use it as usual
    for v, value in zip(model.trainable_variables, trainable):
        v.assign(value)
    for v, value in zip(model.non_trainable_variables, non_trainable):
        v.assign(value)
    assert float(_ce(model(x, training=False), y)) < float(losses[0])


# --- Flax linen -----------------------------------------------------------------


def test_flax_linen_train_state():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            h = nn.Dense(64)(x)
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
            return nn.Dense(4)(nn.gelu(h))

    model = MLP()
    x, y = _data()
    variables = model.init(KEY, x, train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]

    @amp
    def loss_fn(params, batch_stats, x, y):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        return _ce(logits, y), updates["batch_stats"]

    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, batch_stats, opt_state, x, y):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    losses = []
    for _ in range(STEPS):
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, x, y)
        losses.append(loss)
    _assert_decreases(losses)
    check_dots_low(
        jax.make_jaxpr(jax.grad(loss_fn, has_aux=True))(params, batch_stats, x, y), min_low=4
    )


# --- Flax NNX: split/merge, nnx.Optimizer, dynamic loss scaling -----------------


def test_flax_nnx_optimizer_loss_scaling():
    # the docs' recipe on a model with BatchNorm (train mode) and Dropout: its
    # statistics and RNG counts come back through the loss's auxiliary state
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 64, rngs=rngs)
            self.bn = nnx.BatchNorm(64, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(64, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.gelu(self.bn(self.l1(x)))))

    model = MLP(nnx.Rngs(0))
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    optimizer = nnx.Optimizer(model, optim.dynamic_loss_scale(optax.adamw(1e-2)), wrt=nnx.Param)
    x, y = _data()

    @amp(policy="float16")
    def loss_fn(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return _ce(model(x), y), nnx.state(model, nnx.Not(nnx.Param))

    @nnx.jit
    def step(model, optimizer, x, y):
        _, params, rest = nnx.split(model, nnx.Param, ...)
        grad_fn = optim.scaled_value_and_grad(loss_fn, optimizer.opt_state, has_aux=True)
        (loss, rest), grads = grad_fn(params, rest, x, y)
        nnx.update(model, rest)
        optimizer.update(model, grads)  # unscales, skips non-finite steps
        return loss

    losses = [step(model, optimizer, x, y) for _ in range(STEPS)]
    _assert_decreases(losses)
    assert float(optim.loss_scale(optimizer.opt_state)) == 2.0**15
    assert model.l1.kernel[...].dtype == jnp.float32
    assert int(model.drop.rngs.count[...]) == STEPS
    assert isinstance(model.bn.mean[...], jax.Array) and bool((model.bn.mean[...] != 0).all())
    _, params, rest = nnx.split(model, nnx.Param, ...)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: loss_fn(*a)[0]))(params, rest, x, y)
    dots = prim_dtypes(jaxpr, "dot_general")
    # two forward, two weight gradients, the first layer's input gradient only
    # where x is differentiated (it is not: no product for it)
    assert len(dots) >= 5 and all(ins == (F16, F16) for ins, _, _ in dots), dots


# --- Equinox: filtered transformations, modules as arguments --------------------


def test_equinox_filter_training():
    x, y = _data()
    model = eqx.nn.MLP(16, 4, 64, 2, activation=jax.nn.gelu, key=KEY)
    tx = optax.adam(1e-2)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @amp
    def loss_fn(model, x, y):
        return _ce(jax.vmap(model)(x), y)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(STEPS):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(loss)
    _assert_decreases(losses)
    arrays, static = eqx.partition(model, eqx.is_array)
    jaxpr = jax.make_jaxpr(lambda a: eqx.filter_grad(loss_fn)(eqx.combine(a, static), x, y))(arrays)
    check_dots_low(jaxpr, min_low=3)
