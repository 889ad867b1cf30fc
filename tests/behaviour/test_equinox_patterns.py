"""What Equinox users hand to amp, as eqx.filter_jit takes it (issue 56, items 3-5).

A training step that returns the model (its activation function a static
leaf), an aux string, a fresh ``amp(model)`` made in a training loop, a
``functools.partial`` holding arrays, checkify, ``jax.enable_x64`` around a
custom derivative, and ``jax.disable_jit``.
"""

import functools
import gc
import weakref

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, prim_dtypes
from jax.experimental import checkify

from amp_jax import amp

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (8, 16))  # (dots above min_low_flops)


def _mlp(key=KEY):
    return eqx.nn.MLP(16, 2, 16, 2, key=key)


def _step(model, x):
    """A training step that returns the updated model, as Equinox users write it."""

    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), value


# -- item 3: non-array outputs ---------------------------------------------------------


def test_a_step_returns_the_model_with_its_static_leaves_as_filter_jit_does():
    mlp = _mlp()
    new, value = amp(_step)(mlp, X)
    ref, ref_value = eqx.filter_jit(_step)(mlp, X)
    # the activation function comes back as it is; the arrays are arrays
    assert new.activation is mlp.activation and new.final_activation is mlp.final_activation
    assert jax.tree.structure(new) == jax.tree.structure(ref)
    arrays = jax.tree.leaves(eqx.filter(new, eqx.is_array))
    assert len(arrays) == 6  # (three weights and biases)
    for a, b in zip(arrays, jax.tree.leaves(eqx.filter(ref, eqx.is_array))):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-2)
    np.testing.assert_allclose(value, ref_value, rtol=0.05)
    # the matmuls ran low (not the float32 program): the step is rewritten
    jaxpr = eqx.filter_make_jaxpr(amp(_step))(mlp, X)[0]
    assert any(BF16 in ins for ins, _, _ in prim_dtypes(jaxpr, "dot_general"))
    # the second call hits the cache and gives the static leaves back again
    again, _ = amp(_step)(new, X)
    assert again.activation is mlp.activation


def test_an_aux_string_is_returned_under_filter_transformations():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w)), "an aux string"

    w = jnp.ones((16, 4))
    assert amp(loss)(w, X)[1] == "an aux string"
    assert eqx.filter_jit(amp(loss))(w, X)[1] == "an aux string"
    (value, aux), g = eqx.filter_value_and_grad(amp(loss), has_aux=True)(w, X)
    assert aux == "an aux string" and g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(value, loss(w, X)[0], rtol=0.02)
    # filter_jvp: the string has no tangent, the array has its own
    (y, s), (ty, ts) = eqx.filter_jvp(amp(loss), (w, X), (jnp.ones_like(w), jnp.zeros_like(X)))
    (y0, _), (ty0, _) = eqx.filter_jvp(loss, (w, X), (jnp.ones_like(w), jnp.zeros_like(X)))
    assert s == "an aux string" and ts is None
    np.testing.assert_allclose(ty, ty0, rtol=0.05)


def test_callbacks_and_donation_with_a_model_output():
    seen = []

    def step(model, x):
        new, value = _step(model, x)
        jax.debug.callback(lambda v: seen.append(float(v)), value)
        return new, value

    mlp = _mlp()
    new, value = eqx.filter_jit(amp(step), donate="all-except-first")(mlp, X)
    assert seen == [pytest.approx(float(value))]
    assert new.activation is mlp.activation


def test_an_ensemble_made_by_filter_vmap_of_an_amp_model_maker():
    keys = jax.random.split(KEY, 3)
    made = eqx.filter_vmap(amp(_mlp))(keys)
    ref = eqx.filter_vmap(_mlp)(keys)
    assert made.activation is ref.activation
    assert jax.tree.structure(made) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(ref)):
        if eqx.is_array(a):  # (initialisation has no matmul to recast)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert a is b


def test_a_static_output_that_holds_arrays_is_refused_naming_it():
    class Box:  # not a pytree
        def __init__(self, v):
            self.v = v

    with pytest.raises(TypeError, match=r"output leaf 1 is a Box that holds arrays \(`\.v`\)"):
        amp(lambda x: (x @ x.T, Box(x)))(X)


def test_float32_policy_returns_static_outputs_too():
    out = amp(lambda x: (x @ x.T, "s", None), policy="float32")(X)
    assert out[1] == "s" and out[2] is None and isinstance(out[0], jax.Array)


_SCALARS = (3, 2.5, True, 1 - 2j)


@pytest.mark.parametrize("policy", ["bfloat16", "float32"])
def test_python_scalar_outputs_come_back_as_f_returns_them(policy):
    # a Python scalar cannot depend on a traced value: a trace-time constant,
    # returned as it is, as f and eqx.filter_jit return it (jax.jit: an Array)
    def f(x, n):
        return x @ x.T, n + 1, *_SCALARS

    out = amp(f, policy=policy)(X, 1)
    for ref in (f(X, 1), eqx.filter_jit(f)(X, 1)):
        for got, want in zip(out[1:], ref[1:]):
            assert type(got) is type(want) and got == want
    assert isinstance(out[0], jax.Array) and out[0].dtype == jnp.float32
    if policy == "bfloat16":  # (the array beside them is still the rewritten matmul)
        jaxpr = jax.make_jaxpr(amp(f), static_argnums=1)(X, 1)
        assert [ins for ins, _, _ in prim_dtypes(jaxpr, "dot_general")] == [(BF16, BF16)]
        # the scalars are no outputs of amp's program: kept with its trace
        (traced,) = amp(f).traces()
        assert traced.num_outputs == 1
        assert [v for _, v in traced.statics] == [2, *_SCALARS]


def test_numpy_outputs_come_back_as_arrays_as_filter_jit_returns_them():
    # eqx.filter_jit takes NumPy arrays and scalars as arrays: jax Arrays, as jax.jit
    # gives them (float64 as float32 without x64, silently, strongly typed)
    def f(x):
        return x @ x.T, np.ones(2), np.float64(1.5), np.int32(2)

    for policy in ("bfloat16", "float32"):
        out = amp(f, policy=policy)(X)
        ref = jax.jit(f)(X)
        for got, want in zip(out[1:], ref[1:]):
            assert isinstance(got, jax.Array) and got.dtype == want.dtype
            assert got.weak_type == want.weak_type
            np.testing.assert_array_equal(got, want)


def test_python_scalar_outputs_under_outer_transformations_as_f_gives_them():
    def f(x):
        return jnp.sin(x) @ x.T, 3, 0.5

    # jax.jit and jax.vmap make them Arrays (a broadcast one under vmap), as for f
    for outer in (jax.jit, jax.vmap):
        xs = X if outer is jax.jit else X[None]
        got, want = outer(amp(f))(xs), outer(f)(xs)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(got[1:], want[1:]):
            assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            assert a.weak_type == b.weak_type
            np.testing.assert_array_equal(a, b)
    # Equinox's filter transformations give them back as they are, as for f
    for outer in (eqx.filter_jit, functools.partial(eqx.filter_vmap, out_axes=(0, None, None))):
        xs = X if outer is eqx.filter_jit else X[None]
        got, want = outer(amp(f))(xs), outer(f)(xs)
        assert got[1:] == want[1:] == (3, 0.5) and type(got[1]) is int


def test_python_scalar_outputs_of_a_cached_trace():
    traced = []

    def f(x, scale):  # (a local function: equal amp wrappers of one function share traces)
        traced.append(1)
        return x * scale, scale * 2, "tag"

    g = amp(f)
    first, second = g(X, 3), g(X + 1, 3)
    assert len(traced) == 1 and g.trace_count == 1
    for out in (first, second):
        assert type(out[1]) is int and out[1] == 6 and out[2] == "tag"
    assert g(X, 4)[1] == 8 and len(traced) == 2  # (another static: another trace)


# -- item 4: equal wrappers, one trace ----------------------------------------------


class _Calls:
    """A count of traces (hashable by identity: a static field of a module)."""

    def __init__(self):
        self.n = 0


class _Counted(eqx.Module):
    w: jax.Array
    b: jax.Array
    calls: _Calls = eqx.field(static=True)

    def __call__(self, x):
        self.calls.n += 1  # (runs when traced)
        return jnp.tanh(x @ self.w + self.b)


def _counted(calls, key=KEY):
    return _Counted(jax.random.normal(key, (16, 4)), jnp.zeros(4), calls)


def test_amp_of_the_same_module_compares_and_hashes_equal():
    m = _counted(_Calls())
    a, b = amp(m), amp(m)
    assert a == b and hash(a) == hash(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    summed = jax.tree.map(lambda p, q: p + q, a, b)  # refused while the treedefs differed
    np.testing.assert_array_equal(summed.fn.w, 2 * m.w)
    # other arrays, another policy, another function: not equal
    assert amp(m) != amp(_counted(m.calls, jax.random.PRNGKey(3)))
    assert amp(m) != amp(m, policy="float16")
    assert amp(jnp.sin) == amp(jnp.sin) and amp(jnp.sin) != amp(jnp.cos)


def test_a_fresh_amp_model_each_step_under_filter_jit_traces_once():
    calls = _Calls()
    m = _counted(calls)
    for _ in range(4):
        y = eqx.filter_jit(amp(m))(X)
        # a step: new arrays, same structure
        m = eqx.tree_at(lambda t: t.w, m, m.w - 0.01 * jnp.ones_like(m.w))
    assert calls.n == 1
    assert y.dtype == jnp.float32
    jaxpr = jax.make_jaxpr(lambda mm, x: amp(mm)(x))(m, X)
    assert prim_dtypes(jaxpr, "dot_general")[0][0] == (BF16, BF16)


def test_a_fresh_amp_function_each_step_under_jit_traces_once():
    calls = []

    def f(x):
        calls.append(1)
        return jnp.sin(x @ x.T)

    for _ in range(4):
        jax.jit(amp(f))(X)
    assert len(calls) == 1
    for _ in range(3):
        amp(f)(X)  # and eagerly: the fresh wrapper finds the trace
    assert len(calls) == 1
    counted = _Calls()
    m = _counted(counted)
    for _ in range(3):
        amp(m)(X)
        m = eqx.tree_at(lambda t: t.b, m, m.b + 1.0)
    assert counted.n == 1


def test_a_callable_objects_state_still_keys_its_trace():
    class Net:
        def __init__(self):
            self.training = True

        def __call__(self, x):
            return x @ x.T if self.training else -(x @ x.T)

    net = Net()
    a = amp(net)(X)
    net.training = False
    np.testing.assert_array_equal(amp(net)(X), -a)


def test_the_shared_cache_does_not_keep_a_function_alive():
    def make():
        return lambda x: x @ x.T

    g = make()
    ref = weakref.ref(g)
    amp(g)(X)
    jax.jit(amp(g))(X)
    del g
    gc.collect()
    assert ref() is None


# -- item 5: a partial holding arrays, checkify, enable_x64, disable_jit -------------


def _loss(params, x):
    w, b = params
    return jnp.sum(jnp.tanh(x @ w + b) ** 2)


def test_a_partial_holding_arrays_is_taken_its_arrays_constants():
    params = [jnp.ones((16, 2)) / 16, jnp.zeros(2)]  # a list: not an array, a pytree
    per_example = jax.vmap(amp(functools.partial(jax.grad(_loss), params)))(X)
    ref = jax.vmap(functools.partial(jax.grad(_loss), params))(X)
    for a, b in zip(per_example, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-2)
    # the partial's arrays are constants of its trace (as under jax.jit), kept
    # for that partial: a second call does not trace again
    p = amp(functools.partial(_loss, params))
    jaxpr = jax.make_jaxpr(p)(X)
    assert prim_dtypes(jaxpr, "dot_general")[0][0] == (BF16, BF16)
    p(X)
    p(X + 1.0)
    assert p.trace_count == 1
    (traced,) = p.traces()
    assert len(traced.plan.closed.consts) == 2
    # as a static argument too
    np.testing.assert_allclose(
        amp(lambda f, x: f(x))(functools.partial(_loss, params), X), _loss(params, X), rtol=0.02
    )


def test_jaxpr_as_fun_with_constants():
    c = jax.random.normal(KEY, (16, 16))
    closed = jax.make_jaxpr(lambda x: jnp.sin(x @ c))(X)
    fn = jax.extend.core.jaxpr_as_fun(closed)
    (out,) = amp(fn)(X)
    np.testing.assert_allclose(out, jnp.sin(X @ c), atol=0.05)  # (bf16 operands)
    assert prim_dtypes(jax.make_jaxpr(amp(fn))(X), "dot_general")[0][0] == (BF16, BF16)


@jax.custom_jvp
def _sin(x):
    return jnp.sin(x)


@_sin.defjvp
def _sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _sin(x), jnp.cos(x) * t


def test_checkify_and_a_custom_jvp():
    checked = checkify.checkify(amp(_sin), errors=checkify.float_checks)
    (err, y), (_, ty) = jax.jvp(checked, (3.0,), (1.0,))
    assert err.get() is None
    np.testing.assert_allclose(ty, np.cos(3.0), rtol=1e-6)
    # the other order: JAX's traced checkify keeps a JVP rule that does not
    # match its function (jax.jvp(jax.jit(...)) fails too): a clear error
    inner = amp(checkify.checkify(_sin, errors=checkify.float_checks))
    with pytest.raises(ValueError, match=r"checkify\.checkify\(amp\(f\)\)"):
        jax.jvp(inner, (3.0,), (1.0,))


def test_custom_rules_inside_enable_x64_run_inside_it():
    seen = []

    @jax.custom_vjp
    def cv(x):
        return jnp.sin(x) * jnp.ones((), dtype=float)  # float64 inside enable_x64

    def fwd(x):
        seen.append(("fwd", bool(jax.config.values["jax_enable_x64"])))
        return cv(x), jnp.cos(x)

    cv.defvjp(fwd, lambda r, g: (r * g,))

    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x)

    @cj.defjvp
    def _(p, t):
        seen.append(("jvp", bool(jax.config.values["jax_enable_x64"])))
        return cj(p[0]), jnp.cos(p[0]) * t[0]

    def f(x):
        with jax.enable_x64():
            y = x.astype(jnp.float64)
            return (cv(y) + cj(y)).astype(jnp.float32).sum()

    x = jnp.ones(3)
    g = jax.grad(amp(f))(x)
    np.testing.assert_allclose(g, 2 * np.cos(1.0) * np.ones(3), rtol=1e-6)
    assert ("fwd", True) in seen and ("jvp", True) in seen and ("fwd", False) not in seen


def test_under_disable_jit_amp_runs_the_function_as_python():
    seen = []

    def f(x):
        seen.append(type(x))
        return jnp.sum(x @ x.T)

    def currently_jitting(x):  # (Equinox's test of it)
        return isinstance(jnp.array(1) + 1, jax.core.Tracer)

    with jax.disable_jit():
        out = amp(f)(X)
        assert amp(currently_jitting)(X) is False
    assert seen == [type(X)]  # concrete, not a tracer
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, f(X), rtol=1e-6)
