"""Loss-scaling state machine, unscaling and state search."""

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim

# These tests feed hand-scaled gradients to (often jitted) updates, with the
# scale read outside the trace: the unscaled-gradient check does not apply.
_dls = functools.partial(optim.dynamic_loss_scale, check_scaled=False)
_sls = functools.partial(optim.static_loss_scale, check_scaled=False)


def _tree_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-4.0), "init_scale"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(max_scale=-1.0), "max_scale"),
        (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), "min_scale"),
        (dict(growth_interval=0), "growth_interval"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        _dls(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf")])
def test_static_bad_scale(scale):
    with pytest.raises(ValueError, match="`scale`"):
        _sls(optax.sgd(0.1), scale)


def test_state_fields_and_dtypes():
    tx = _dls(optax.adam(1e-3))
    state = tx.init({"w": jnp.zeros(3)})
    assert isinstance(state, optim.DynamicLossScaleState)
    assert state._fields == (
        "scale",
        "good_steps",
        "skipped_steps",
        "steps",
        "last_skipped_step",
        "inner_state",
    )
    assert state.scale.dtype == jnp.float32 and state.scale.shape == ()
    assert state.good_steps.dtype == jnp.int32
    assert state.skipped_steps.dtype == jnp.int32
    assert float(state.scale) == 2.0**15
    assert isinstance(state.inner_state[0], optax.ScaleByAdamState)


def test_growth_after_exactly_growth_interval():
    tx = _dls(optax.sgd(0.1), init_scale=4.0, growth_interval=3)
    params = jnp.ones(2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    scales, goods = [], []
    for _ in range(7):
        _, state = update(jnp.ones(2), state, params)
        scales.append(float(state.scale))
        goods.append(int(state.good_steps))
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert goods == [1, 2, 0, 1, 2, 0, 1]
    assert int(state.skipped_steps) == 0


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_backoff_and_skip_on_nonfinite(bad):
    tx = _dls(optax.adam(0.1), init_scale=64.0, growth_interval=5)
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    good = {"a": jnp.full(3, 64.0), "b": jnp.full(2, 64.0)}
    _, state = update(good, state, params)
    assert int(state.good_steps) == 1
    inner_before = state.inner_state
    grads = {"a": jnp.array([64.0, bad, 1.0]), "b": jnp.full(2, 64.0)}
    updates, state2 = update(grads, state, params)
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.asarray(u), 0.0)
    _tree_equal(state2.inner_state, inner_before)
    assert float(state2.scale) == 32.0
    assert int(state2.good_steps) == 0
    assert int(state2.skipped_steps) == 1
    # The next finite step counts again and unscales by the new scale.
    updates, state3 = update({"a": jnp.full(3, 32.0), "b": jnp.full(2, 32.0)}, state2, params)
    assert int(state3.good_steps) == 1 and int(state3.skipped_steps) == 1
    assert int(state3.inner_state[0].count) == 2


def test_clamped_at_min_scale():
    tx = _dls(optax.sgd(0.1), init_scale=2.0, min_scale=1.0)
    state = tx.init(jnp.ones(1))
    for expected in [1.0, 1.0, 1.0]:
        _, state = tx.update(jnp.array([jnp.nan]), state, jnp.ones(1))
        assert float(state.scale) == expected
    assert int(state.skipped_steps) == 3


def test_clamped_at_max_scale_and_growth_only_if_finite():
    tx = _dls(optax.sgd(0.1), init_scale=16.0, max_scale=24.0, growth_interval=1)
    state = tx.init(jnp.ones(1))
    _, state = tx.update(jnp.ones(1), state, jnp.ones(1))
    assert float(state.scale) == 24.0
    _, state = tx.update(jnp.ones(1), state, jnp.ones(1))
    assert float(state.scale) == 24.0
    # A grown scale that overflows float32 is not taken.
    big = float(2.0**127)
    tx = _dls(optax.sgd(0.1), init_scale=big, max_scale=3e38, growth_interval=1, growth_factor=4.0)
    state = tx.init(jnp.ones(1))
    _, state = tx.update(jnp.ones(1), state, jnp.ones(1))
    assert float(state.scale) == big
    assert int(state.good_steps) == 0 and int(state.skipped_steps) == 0


def test_unscales_with_the_scale_used_not_the_adjusted_one():
    # growth_interval=1: the scale grows on every step. A wrapper that unscaled
    # with the adjusted scale would halve every update.
    tx = _dls(optax.sgd(1.0), init_scale=2.0, growth_interval=1)
    params = jnp.ones(3)
    state = tx.init(params)
    true_grad = jnp.array([0.5, -0.25, 3.0])
    for step in range(4):
        scale = optim.loss_scale(state)
        assert float(scale) == 2.0 * 2.0**step
        updates, state = tx.update(true_grad * scale, state, params)
        np.testing.assert_array_equal(np.asarray(updates), -np.asarray(true_grad))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_low_precision_gradients(dtype):
    tx = _dls(optax.sgd(1.0), init_scale=2.0**8)
    params = jnp.ones(4, dtype)
    state = tx.init(params)
    g = jnp.array([0.5, -0.125, 3.0, 2.0**-10], dtype)
    updates, state = jax.jit(tx.update)(g * jnp.asarray(2.0**8, dtype), state, params)
    # The updates come back in the gradients' dtype (optax's convention).
    assert updates.dtype == dtype
    np.testing.assert_array_equal(np.asarray(updates, np.float32), -np.asarray(g, np.float32))
    # An overflowing float16/bfloat16 gradient is caught.
    bad = g.at[0].set(jnp.asarray(jnp.inf, dtype))
    updates, state = jax.jit(tx.update)(bad, state, params)
    assert updates.dtype == dtype
    assert int(state.skipped_steps) == 1 and float(state.scale) == 2.0**7


def test_float16_loss_with_scaled_value_and_grad():
    # A float16 model: with scale 2**16 the cotangent 65536 overflows float16, so
    # the step is skipped and the scale backs off; the next step goes through.
    tx = _dls(optax.sgd(0.5), init_scale=2.0**16)
    params = jnp.array([0.25, 0.5], jnp.float16)
    state = tx.init(params)

    def loss_fn(p):
        out = jnp.sum(p * p)
        assert out.dtype == jnp.float16
        return out

    @jax.jit
    def step(params, state):
        loss, grads = optim.scaled_value_and_grad(loss_fn, state)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    new_params, state, loss = step(params, state)
    assert loss.dtype == jnp.float16 and float(loss) == 0.3125
    assert int(state.skipped_steps) == 1 and float(state.scale) == 2.0**15
    np.testing.assert_array_equal(np.asarray(new_params), np.asarray(params))
    new_params, state, loss = step(params, state)
    assert int(state.skipped_steps) == 1 and int(state.good_steps) == 1
    assert new_params.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(new_params, np.float32), [0.0, 0.0])


def test_scaled_value_and_grad_has_aux():
    tx = _sls(optax.sgd(1.0), 4.0)
    state = tx.init(jnp.ones(2))
    fn = lambda p, x: (jnp.sum(p * x), {"n": 3})
    (loss, aux), grads = optim.scaled_value_and_grad(fn, state, has_aux=True)(
        jnp.ones(2), jnp.array([1.0, 2.0])
    )
    assert float(loss) == 3.0 and aux == {"n": 3}
    assert isinstance(grads, optim.ScaledGradients)
    np.testing.assert_array_equal(np.asarray(grads.grads), [4.0, 8.0])


def test_non_float_leaves_pass_through():
    tx = _dls(optax.identity(), init_scale=4.0)
    params = {"f": jnp.ones(2), "i": jnp.arange(3)}
    state = tx.init(params)
    grads = {"f": jnp.array([4.0, 8.0]), "i": jnp.array([4, 5, 6])}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["i"].dtype == grads["i"].dtype
    np.testing.assert_array_equal(np.asarray(updates["i"]), [4, 5, 6])
    np.testing.assert_array_equal(np.asarray(updates["f"]), [1.0, 2.0])
    assert int(state.good_steps) == 1


def test_static_loss_scale_unscales_without_skipping():
    tx = _sls(optax.sgd(1.0), 16.0)
    state = tx.init(jnp.ones(2))
    assert isinstance(state, optim.StaticLossScaleState)
    assert state.scale.dtype == jnp.float32
    updates, state = tx.update(jnp.array([16.0, jnp.inf]), state)
    np.testing.assert_array_equal(np.asarray(updates), [-1.0, -jnp.inf])
    assert float(optim.loss_scale(state)) == 16.0


def test_loss_scale_found_in_nested_states():
    params = {"w": jnp.ones(2)}
    ls = _dls(optax.sgd(0.1), init_scale=8.0)
    wrappers = {
        "chain": optax.chain(ls, optax.identity()),
        "multisteps": optax.MultiSteps(ls, 2),
        "inject": optax.inject_hyperparams(
            lambda learning_rate: _dls(optax.sgd(learning_rate), init_scale=8.0)
        )(learning_rate=0.1),
        "masked": optax.masked(ls, {"w": True}),
        "dict": optax.multi_transform({"a": ls, "b": optax.sgd(0.1)}, {"w": "a"}),
    }
    for name, tx in wrappers.items():
        state = tx.init(params)
        scale = optim.loss_scale(state)
        assert scale.dtype == jnp.float32 and float(scale) == 8.0, name
        # Also after a jitted step.
        state = jax.jit(tx.update)({"w": jnp.ones(2)}, state, params)[1]
        assert float(optim.loss_scale(state)) == 8.0, name


def test_loss_scale_errors():
    with pytest.raises(ValueError, match="dynamic_loss_scale"):
        optim.loss_scale(optax.adam(0.1).init(jnp.ones(2)))
    two = optax.chain(_sls(optax.identity(), 2.0), _dls(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="found 2"):
        optim.loss_scale(two.init(jnp.ones(2)))
    nested = _dls(_sls(optax.sgd(1), 2.0))
    with pytest.raises(ValueError, match="exactly one"):
        optim.loss_scale(nested.init(jnp.ones(2)))


def test_float16_gradients_below_float16_range_survive_unscaling():
    """1e-9 is below float16's smallest subnormal (6e-8): only the scaled value
    is representable, and unscaling must not cast it back to float16."""
    tx = _dls(optim.master_weights(optax.sgd(1.0)), init_scale=2.0**15)
    params = jnp.zeros(3, jnp.float16)  # (the float32 master of 0 - 1e-9 is exact)
    state = tx.init(params)
    true = np.array([1e-9, 3e-8, 1e-6], np.float32)
    scaled = jnp.asarray(true * 2.0**15, jnp.float16)
    _, state = tx.update(scaled, state, params)
    master = optim.master_params(state)
    np.testing.assert_allclose(-np.asarray(master), true, rtol=2e-3)


def test_loss_scale_stats_count_steps_and_skips_under_jit():
    tx = _dls(optax.sgd(0.1), init_scale=2.0**4, growth_interval=100)
    state = tx.init(jnp.zeros(2))
    update = jax.jit(tx.update)
    stats_fn = jax.jit(optim.loss_scale_stats)
    bad = {2, 5}
    for i in range(1, 8):
        g = jnp.array([1.0, jnp.inf if i in bad else 1.0])
        _, state = update(g, state)
        stats = {k: float(v) for k, v in stats_fn(state).items()}
        assert stats["steps"] == i
        assert stats["skipped_steps"] == len([b for b in bad if b <= i])
        assert stats["last_skipped_step"] == max([0] + [b for b in bad if b <= i])
        assert stats["scale"] == 2.0**4 / 2 ** stats["skipped_steps"]
    assert stats["good_steps"] == 2 and abs(stats["skip_rate"] - 2 / 7) < 1e-6
    static = _sls(optax.sgd(0.1), 8.0).init(jnp.zeros(2))
    assert {k: float(v) for k, v in optim.loss_scale_stats(static).items()} == {"scale": 8.0}
    with pytest.raises(ValueError, match="loss_scale_stats"):
        optim.loss_scale_stats(optax.sgd(0.1).init(jnp.zeros(2)))


def _misuse_setup():
    params = {"w": jnp.ones(3)}
    loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    return params, loss_fn


_CHECKED = [
    lambda: optim.dynamic_loss_scale(optax.sgd(0.1)),
    lambda: optim.static_loss_scale(optax.sgd(0.1), 2.0**10),
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("make", _CHECKED)
def test_update_refuses_gradients_that_were_never_scaled(make, jit):
    params, loss_fn = _misuse_setup()
    tx = make()
    state = tx.init(params)
    maybe_jit = jax.jit if jit else (lambda f: f)

    @maybe_jit
    def plain(params, state):  # the mistake: jax.value_and_grad, no loss scale
        _, g = jax.value_and_grad(loss_fn)(params)
        return tx.update(g, state, params)[0]

    with pytest.raises(ValueError, match=r"plain gradients.*scaled_value_and_grad"):
        plain(params, state)

    @maybe_jit
    def scaled(params, state):
        _, g = optim.scaled_value_and_grad(loss_fn, state)(params)
        return tx.update(g, state, params)[0]

    np.testing.assert_allclose(np.asarray(scaled(params, state)["w"]), -0.2, rtol=1e-6)

    # the loss multiplied by hand: declared with ScaledGradients
    g = jax.grad(lambda p: loss_fn(p) * optim.loss_scale(state))(params)
    u, _ = tx.update(optim.ScaledGradients(g), state, params)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.2, rtol=1e-6)
    # opted out: plain gradients are taken as scaled
    unchecked = optim.dynamic_loss_scale(optax.sgd(0.1), check_scaled=False)
    maybe_jit(unchecked.update)({"w": jnp.ones(3)}, unchecked.init(params), params)


@pytest.mark.parametrize("jit_update", [False, True])
@pytest.mark.parametrize("make", _CHECKED)
def test_gradient_accumulation_across_jitted_calls(make, jit_update):
    # micro-batch gradients from one jitted function, summed outside it, one
    # update (eager or jitted): no flag needed, and the update is the mean's
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    batches = [jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 0.0, -1.0]), jnp.ones(3)]
    loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
    tx = make()
    state = tx.init(params)
    grad_fn = jax.jit(lambda p, s, x: optim.scaled_value_and_grad(loss_fn, s)(p, x)[1])
    acc = jax.tree.map(jnp.zeros_like, grad_fn(params, state, batches[0]))
    for x in batches:
        acc = jax.tree.map(jnp.add, acc, grad_fn(params, state, x))
    acc = jax.tree.map(lambda g: g / len(batches), acc)
    assert isinstance(acc, optim.ScaledGradients)
    update = jax.jit(tx.update) if jit_update else tx.update
    u, _ = update(acc, state, params)
    mean = sum(jax.grad(loss_fn)(params, x)["w"] for x in batches) / len(batches)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.1 * np.asarray(mean), rtol=1e-6)

    @jax.jit
    def scanned(params, state):  # accumulation in a lax.scan carry, update in the same jit
        def body(acc, x):
            _, g = optim.scaled_value_and_grad(loss_fn, state)(params, x)
            return jax.tree.map(jnp.add, acc, g), None

        zero = optim.ScaledGradients(jax.tree.map(jnp.zeros_like, params))
        acc, _ = jax.lax.scan(body, zero, jnp.stack(batches))
        return tx.update(jax.tree.map(lambda g: g / len(batches), acc), state, params)[0]

    np.testing.assert_allclose(np.asarray(scanned(params, state)["w"]), np.asarray(u["w"]))


def test_scaled_gradients_survive_jit_and_tree_utilities():
    g = optim.ScaledGradients({"w": jnp.ones(2), "b": jnp.zeros(1)})
    out = jax.jit(lambda g: jax.tree.map(lambda x: 2 * x, g))(g)
    assert isinstance(out, optim.ScaledGradients)
    np.testing.assert_array_equal(np.asarray(out.grads["w"]), [2.0, 2.0])
    assert float(optax.tree.norm(out)) == pytest.approx(np.sqrt(8.0))
    assert "ScaledGradients" in repr(out)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda t: optax.MultiSteps(t, 2),
        lambda t: optax.apply_if_finite(t, 3),
        lambda t: optax.masked(t, {"w": True}),
    ],
)
def test_loss_scaler_inside_a_gradient_reshaping_wrapper_is_refused(wrap):
    params, loss_fn = _misuse_setup()
    tx = wrap(optim.dynamic_loss_scale(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"inside a .*State.*outermost.*check_scaled=False"):
        optim.scaled_value_and_grad(loss_fn, tx.init(params))(params)
    float(optim.loss_scale(tx.init(params)))  # reading the scale is fine
    # the recommended order works under jit
    good = optim.dynamic_loss_scale(optax.MultiSteps(optax.sgd(0.1), 2))
    state = good.init(params)

    @jax.jit
    def step(params, state):
        _, g = optim.scaled_value_and_grad(loss_fn, state)(params)
        return good.update(g, state, params)

    step(params, state)


def test_flax_nnx_state_of_scaled_gradients_is_recognised():
    # flax.nnx.Optimizer.update passes the gradients through nnx.state, which turns
    # the ScaledGradients node into a mapping keyed by its child's name
    nnx = pytest.importorskip("flax.nnx")
    tx = optim.static_loss_scale(optax.sgd(1.0), 4.0)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    graphdef = nnx.graphdef(model)
    loss_fn = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(jnp.ones((1, 2))))
    _, grads = optim.scaled_value_and_grad(loss_fn, optimizer.opt_state)(params)
    before = np.asarray(model.bias[...])
    optimizer.update(model, grads)
    np.testing.assert_allclose(np.asarray(model.bias[...]), before - 1.0, rtol=1e-6)
    _, plain = jax.value_and_grad(loss_fn)(params)
    with pytest.raises(ValueError, match="plain gradients"):
        optimizer.update(model, plain)


def test_loss_scaler_after_another_transformation_in_a_chain_is_refused():
    params, loss_fn = _misuse_setup()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optim.dynamic_loss_scale(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"dynamic_loss_scale\(optax.chain\("):
        optim.scaled_value_and_grad(loss_fn, tx.init(params))(params)
    first = optax.chain(optim.dynamic_loss_scale(optax.sgd(0.1)), optax.identity())
    optim.scaled_value_and_grad(loss_fn, first.init(params))(params)


def test_forgotten_has_aux_is_named():
    params, loss_fn = _misuse_setup()
    state = optim.dynamic_loss_scale(optax.sgd(0.1)).init(params)
    with pytest.raises(TypeError, match="has_aux=True"):
        optim.scaled_value_and_grad(lambda p: (loss_fn(p), {"n": 1.0}), state)(params)


def test_dynamic_loss_scale_names_its_rule_and_inner():
    """The rule the update applies is a public value (what eager.scan_step takes),
    built from the arguments; its `advance` is the update's scale arithmetic."""
    tx = optim.dynamic_loss_scale(
        optax.sgd(0.1), init_scale=8.0, growth_interval=1, growth_factor=4.0, max_scale=64.0
    )
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert optax.with_extra_args_support(tx) is tx
    rule = tx.rule
    assert (rule.init_scale, rule.growth_interval, rule.growth_factor, rule.max_scale) == (
        8.0,
        1,
        4.0,
        64.0,
    )
    state = tx.init(jnp.ones(2))
    _, by_update = tx.update(optim.ScaledGradients(jnp.ones(2)), state)
    by_rule = rule.advance(state, jnp.asarray(True), by_update.inner_state)
    assert float(by_update.scale) == float(by_rule.scale) == 32.0
    assert float(rule.advance(by_rule, jnp.asarray(True), None).scale) == 64.0  # clamped
    assert rule.init(None).scale == 8.0 and tx.inner.init(jnp.ones(2)) == state.inner_state


def test_dynamic_loss_scale_survives_tree_map_and_pickle():
    """A transformation is a pytree of its two functions (optax's NamedTuple):
    code that maps over it (Flax NNX 0.10's `nnx.Optimizer` keeps it in its
    graph) must get the same `DynamicLossScale` back, parts included. The
    NamedTuple's own unflatten called `DynamicLossScale(init, update)`, a
    TypeError, on every JAX version."""
    tx = optim.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
    assert len(jax.tree.leaves(tx)) == 2
    again = jax.tree.map(lambda f: f, tx)
    assert type(again) is optim.DynamicLossScale
    assert again.rule == tx.rule and again.inner is tx.inner
    assert again.update is tx.update
    state = again.init(jnp.ones(2))
    assert float(state.scale) == 8.0
    unpickled = pickle.loads(pickle.dumps(tx.rule))
    assert unpickled == tx.rule
