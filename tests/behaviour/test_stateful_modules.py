"""Module state written inside ``amp`` comes out as it does without ``amp``.

Flax NNX modules are mutable: BatchNorm statistics, Dropout's RNG counts and
``sow`` are written into the module's Variables, and amp carries the writes
it traces out to the caller's objects. Equinox (``eqx.nn.State``) and Haiku
(``transform_with_state``) return their state, and it round-trips. A write
amp cannot carry is refused.
"""

import warnings

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from amp_jax import amp

X = jax.random.normal(jax.random.key(0), (8, 16))
Y = jnp.ones((8, 4))


class _Net(nnx.Module):
    """Linear(16, 32) -> BatchNorm(32) -> Dropout(0.1) -> Linear(32, 4)."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.do = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(self.bn(self.l1(x))))


def _loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def _np(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


_NOT_PARAMS = nnx.Not(nnx.Param)


def _state(m, which=_NOT_PARAMS):
    """The state of ``m`` as NumPy arrays (default: batch statistics and RNG state)."""
    return jax.tree.map(_np, nnx.to_pure_dict(nnx.state(m, which)))


def _train(wrap, grad="value_and_grad", steps=3):
    m = _Net(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, x, y):
        if grad == "value_and_grad":
            _, g = nnx.value_and_grad(wrap(_loss))(m, x, y)
        else:
            g = nnx.grad(wrap(_loss))(m, x, y)
        opt.update(m, g)

    for _ in range(steps):
        step(m, opt, X, Y)
    return m


def _close(a, b, rtol, atol):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("grad", ["value_and_grad", "grad"])
def test_nnx_optimizer_step_keeps_batch_stats_and_rng_counts(grad):
    ref = _train(lambda f: f, grad)
    assert np.abs(np.asarray(ref.bn.mean[...])).max() > 1e-3  # (the statistics moved)
    assert int(ref.do.rngs.count[...]) == 3
    exact = _train(lambda f: amp(f, policy="float32"), grad)  # (the function itself)
    jax.tree.map(np.testing.assert_array_equal, _state(exact), _state(ref))
    jax.tree.map(np.testing.assert_array_equal, _state(exact, ...), _state(ref, ...))
    low = _train(amp, grad)
    assert int(low.do.rngs.count[...]) == 3  # a new dropout mask every step
    _close(_state(low), _state(ref), rtol=0.05, atol=2e-3)


def test_amp_of_module_called_directly():
    ref, m = _Net(nnx.Rngs(0, dropout=1)), _Net(nnx.Rngs(0, dropout=1))
    f = amp(m)
    for _ in range(2):
        ref(X)
        f(X)
    _close(_state(m), _state(ref), rtol=0.05, atol=2e-3)
    assert int(m.do.rngs.count[...]) == 2
    step = nnx.jit(lambda m, x: m(x))
    step(amp(m), X)
    step(ref, X)
    _close(_state(m), _state(ref), rtol=0.05, atol=2e-3)
    assert int(m.do.rngs.count[...]) == 3


def test_rngs_argument_counts():
    def noise(rngs, x):
        return x + jax.random.normal(rngs.noise(), x.shape)

    r1, r2 = nnx.Rngs(noise=3), nnx.Rngs(noise=3)
    f = amp(noise)
    a = [noise(r1, X) for _ in range(3)]
    b = [f(r2, X) for _ in range(3)]
    assert int(r2.noise.count[...]) == 3
    assert not np.array_equal(b[0], b[1])
    jax.tree.map(np.testing.assert_array_equal, a, b)


class _Sower(nnx.Module):
    def __init__(self):
        self.l = nnx.Linear(16, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.sow(nnx.Intermediate, "features", x * 2)
        return self.l(x)


@pytest.mark.parametrize("how", ["sow", "capture_outside", "capture_inside", "jit"])
def test_nnx_intermediates(how):
    if how != "sow" and not hasattr(nnx, "capture"):
        pytest.skip("nnx.capture is newer than this Flax")
    call = lambda m, x: m(x)

    def run(wrap):
        m = _Sower()
        with warnings.catch_warnings():  # (sow outside nnx.capture is deprecated in Flax 0.12)
            warnings.simplefilter("ignore", DeprecationWarning)
            if how == "sow":
                wrap(call)(m, X)
                wrap(call)(m, X)
                return nnx.state(m, nnx.Intermediate)
            if how == "capture_inside":
                return wrap(nnx.capture(call, nnx.Intermediate))(m, X)[1]
            captured = nnx.capture(wrap(call), nnx.Intermediate)
            if how == "jit":
                return nnx.jit(captured)(m, X)[1]
            return captured(m, X)[1]

    ref, got = run(lambda f: f), run(amp)  # (nothing lowered on the sown path: bitwise)
    assert len(jax.tree.leaves(ref)) == (2 if how == "sow" else 1)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(got), nnx.to_pure_dict(ref))


def test_nnx_scan_and_vmap_carry_state():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(16, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.l(x))

    def run(wrap):
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):
            return Block(nnx.Rngs(key))

        blocks = make(jax.random.split(jax.random.key(0), 3))

        @nnx.jit
        def forward(blocks, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return wrap(lambda b, x: b(x))(block, x)

            return body(x, blocks)

        forward(blocks, X)
        return nnx.state(blocks, nnx.BatchStat)

    ref, got = run(lambda f: f), run(amp)
    assert np.abs(np.asarray(ref["bn"]["mean"][...])).max() > 1e-3
    _close(nnx.to_pure_dict(got), nnx.to_pure_dict(ref), rtol=0.05, atol=2e-3)


# -- refusals -------------------------------------------------------------------


def test_refuses_a_write_into_a_plain_container():
    def f(d, x):
        d["seen"] = x * 2
        return x.sum()

    with pytest.raises(TypeError, match=r"wrote `d\['seen'\]`.*Return the new value"):
        amp(f)({"w": X}, X)


def test_refuses_an_array_assigned_to_a_plain_object():
    class Cache:
        pass

    def f(cache, x):
        cache.last = x @ x.T
        return x.sum()

    with pytest.raises(TypeError, match=r"assigned an array to `cache.last`.*not a pytree"):
        amp(f)(Cache(), X)


def test_a_static_attribute_written_is_carried_out_as_nnx_jit_does():
    # (amp refused it before: nnx.jit carries a static attribute written, as
    # plain Python does, and so does amp; the next call, cached, writes it too)
    def f(m, x):
        m.use_running_average = True
        return m(x)

    ref = nnx.BatchNorm(16, rngs=nnx.Rngs(0))
    nnx.jit(f)(ref, X)
    m = nnx.BatchNorm(16, rngs=nnx.Rngs(0))
    g = amp(f)
    g(m, X)
    assert m.use_running_average is ref.use_running_average is True
    m.use_running_average = False
    g(m, X)
    assert m.use_running_average is True and g.trace_count == 1


# -- Equinox and Haiku: state is returned --------------------------------------


@pytest.mark.parametrize("layer", ["batch_norm", "spectral_norm"])
def test_equinox_state_round_trips(layer):
    key = jax.random.key(0)
    if layer == "batch_norm":
        model, state = eqx.nn.make_with_state(
            lambda: eqx.nn.Sequential(
                [eqx.nn.Linear(16, 32, key=key), eqx.nn.BatchNorm(32, "b", mode="ema")]
            )
        )()
    else:
        model, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
            eqx.nn.Linear(16, 32, key=key), "weight", key=key
        )

    def loss(model, state, x):
        out, state = jax.vmap(model, axis_name="b", in_axes=(0, None), out_axes=(0, None))(x, state)
        return jnp.mean(out**2), state

    def run(f):
        step = eqx.filter_jit(lambda m, s: eqx.filter_value_and_grad(f, has_aux=True)(m, s, X))
        return _three_steps(lambda s: step(model, s), state)

    ref = _assert_state_like_float32(run, loss)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), state, ref)
    assert any(jax.tree.leaves(moved))


def _three_steps(step, state):
    """The state after three ``(loss, state), grads = step(state)`` steps."""
    for _ in range(3):
        (_, state), _ = step(state)
    return state


def _assert_state_like_float32(run, loss):
    """``run(f)`` is the state after some steps of ``f``: under amp's float32 policy
    it is ``loss``'s bitwise, under bf16 close to it. Returns ``loss``'s."""
    ref = run(loss)
    jax.tree.map(np.testing.assert_array_equal, run(amp(loss, policy="float32")), ref)
    _close(run(amp(loss)), ref, rtol=0.05, atol=5e-3)
    return ref


def _hk_forward(x, is_training=True):
    h = hk.Linear(32)(x)
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
    return hk.Linear(4)(jax.nn.relu(h))


def test_haiku_apply_with_state_round_trips():
    model = hk.transform_with_state(_hk_forward)
    params, state = model.init(jax.random.key(0), X)

    def loss(params, state, x):
        out, state = model.apply(params, state, None, x)
        return jnp.mean(out**2), state

    def run(f):
        step = jax.jit(lambda p, s: jax.value_and_grad(f, has_aux=True)(p, s, X))
        return _three_steps(lambda s: step(params, s), state)

    _assert_state_like_float32(run, loss)


def test_haiku_state_inside_a_transform_is_refused():
    @amp
    def counted(x):
        n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
        hk.set_state("n", n + 1)
        return x * 2

    model = hk.transform_with_state(lambda x: counted(x))
    with pytest.raises(TypeError, match=r"Haiku.*`~/n`.*amp\(model.apply\)"):
        model.init(jax.random.key(0), X)


def test_haiku_parameters_and_keys_inside_a_transform_are_refused():
    layer = amp(lambda x: hk.Linear(4)(x))
    model = hk.transform(lambda x: layer(x))
    with pytest.raises(TypeError, match=r"Haiku parameter.*`linear/w`.*amp\(model.apply\)"):
        model.init(jax.random.key(0), X)
    params = hk.transform(lambda x: hk.Linear(4)(x)).init(jax.random.key(0), X)
    with pytest.raises(TypeError, match=r"Haiku parameter.*amp\(model.apply\)"):
        model.apply(params, None, X)
    noisy = hk.transform(lambda x: amp(lambda x: x + jax.random.normal(hk.next_rng_key()))(x))
    with pytest.raises(TypeError, match=r"hk.next_rng_key.*amp\(model.apply\)"):
        noisy.apply({}, jax.random.key(0), X)
    # (amp inside a transform on a function that leaves Haiku alone is fine)
    plain = hk.transform(lambda x: hk.Linear(4)(amp(jnp.tanh)(x)))
    plain.apply(plain.init(jax.random.key(0), X), None, X)


# -- the float32 policy is the function itself ---------------------------------


def test_float32_policy_runs_the_function_itself():
    """Bitwise the function's results, gradients and writes, eagerly too:
    amp(f, policy="float32") calls ``f`` rather than evaluating its jaxpr."""

    def f(w, x, seen):
        seen["h"] = jnp.tanh(x @ w)
        return jnp.mean(jax.nn.log_softmax(seen["h"] @ w.T)), 3

    w = jax.random.normal(jax.random.key(1), (16, 16)) / 4
    g = amp(f, policy="float32")
    ref_seen, seen = {}, {}
    ref = jax.value_and_grad(f, has_aux=True)(w, X, ref_seen)
    got = jax.value_and_grad(g, has_aux=True)(w, X, seen)
    jax.tree.map(np.testing.assert_array_equal, got, ref)
    assert type(got[0][1]) is int  # (a Python output comes back as f returns it)
    assert set(seen) == {"h"} and g.trace_count == 0


# -- Equinox state with the amp function inside vmap/jit (the state an argument) -------


def _eqx_layer(layer: str):
    key = jax.random.key(0)
    if layer == "batch_norm":
        return eqx.nn.make_with_state(eqx.nn.BatchNorm)(16, axis_name="batch", mode="batch")
    if layer == "batch_norm_ema":
        return eqx.nn.make_with_state(eqx.nn.BatchNorm)(16, axis_name="batch", mode="ema")
    return eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        eqx.nn.Linear(16, 16, key=key), "weight", key=key
    )


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("layer", ["batch_norm", "batch_norm_ema", "spectral_norm"])
def test_equinox_state_through_an_amp_function_under_vmap(layer, how):
    # amp flattened the arguments again after the layer ran, and Equinox
    # refuses to flatten a State a layer has used ("Attempted to use old state")
    model, state = _eqx_layer(layer)
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def run(m, x, state):
        return jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

    if how == "jit":
        run = eqx.filter_jit(run)
    want, want_state = run(lambda x, s: model(x, s), x, state)
    for pol, rtol in (("float32", 0), ("bfloat16", 0.05)):
        got, got_state = run(amp(lambda x, s: model(x, s), policy=pol), x, state)
        assert got.dtype == want.dtype
        close = np.testing.assert_array_equal if rtol == 0 else _close
        kw = {} if rtol == 0 else {"rtol": rtol, "atol": 0.05}
        close(got, want, **kw)
        jax.tree.map(lambda a, b: close(a, b, **kw), got_state, want_state)
    # the state moved (the layer wrote it), and the caller's state is still usable
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), want_state, state)
    assert any(jax.tree.leaves(moved))
    jax.tree.leaves(state)


def test_equinox_state_through_an_amp_function_eagerly_unbatched():
    model, state = _eqx_layer("spectral_norm")
    x = jax.random.normal(jax.random.key(1), (16,))
    clone = jax.tree.unflatten(*reversed(jax.tree.flatten(state)))
    want, want_state = model(x, clone)  # (eagerly, Equinox invalidates `clone`)
    got, got_state = amp(lambda x, s: model(x, s))(x, state)
    _close(got, want, rtol=0.05, atol=0.05)
    jax.tree.map(lambda a, b: _close(a, b, rtol=0.05, atol=0.05), got_state, want_state)
