"""Flax NNX objects keep their identity through ``amp``, as through ``nnx.jit``.

A pytree flatten copies a Variable or module once per path; amp ties the
copies back into one object inside its trace (weight tying: a write through
one path is read through the other), returns an argument's node as that
object, stores what a function writes as Arrays, carries attributes written
(``__init__`` under ``nnx.vmap``), and its diagnostics take a model in train
mode as ``amp`` does.
"""

import inspect

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_stateful_modules import _Net  # Linear -> BatchNorm -> Dropout -> Linear

import amp_jax
from amp_jax import amp

X = jax.random.normal(jax.random.key(0), (8, 16))

#: Flax 0.12.8+ takes graph=/graph_updates= on its transforms; the lowest Flax we admit
#: (0.12.2) has only what graph=True, graph_updates=True means there
_GRAPH_KW = "graph" in inspect.signature(nnx.jit).parameters
_HIJAX = hasattr(nnx, "var_defaults")


def _graph(graph: bool = True, graph_updates: bool = True) -> dict[str, bool]:
    if not _GRAPH_KW and not (graph and graph_updates):
        pytest.skip(f"flax {flax.__version__} has no graph=/graph_updates= (its mode is both True)")
    return {"graph": graph, "graph_updates": graph_updates} if _GRAPH_KW else {}


class _Tied(nnx.Module):
    def __init__(self, rngs, tie=True):
        self.a = nnx.Linear(3, 3, use_bias=False, rngs=rngs)
        self.b = nnx.Linear(3, 3, use_bias=False, rngs=rngs)
        if tie:
            self.b.kernel = self.a.kernel  # one Variable, two paths


def _write_a_read_b(m):
    m.a.kernel.set_value(m.a.kernel.get_value() * 0)  # write through a
    return m.b.kernel.get_value().sum()  # read through b


def test_a_tied_variable_is_one_variable_inside_amp():
    plain = _write_a_read_b(_Tied(nnx.Rngs(0)))
    jitted = nnx.jit(_write_a_read_b)(_Tied(nnx.Rngs(0)))
    m = _Tied(nnx.Rngs(0))
    got = amp(_write_a_read_b)(m)
    assert float(plain) == float(jitted) == float(got) == 0.0
    assert m.a.kernel is m.b.kernel and not np.asarray(m.a.kernel[...]).any()


def test_tied_and_untied_arguments_trace_apart():
    # same pytree structure, other sharing: the cached trace must not be reused
    # (a local function: amp of a module-level one shares the traces of other tests)
    f = amp(lambda m: _write_a_read_b(m))
    assert float(f(_Tied(nnx.Rngs(0)))) == 0.0
    untied = _Tied(nnx.Rngs(0), tie=False)
    want = float(untied.b.kernel[...].sum())
    assert want != 0.0
    assert float(f(untied)) == pytest.approx(want, rel=1e-6)
    assert f.trace_count == 2


def test_a_module_passed_twice_is_one_module():
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def f(m1, m2):
        assert m1 is m2
        m1.kernel.set_value(m1.kernel.get_value() + 1)
        return m2.kernel.get_value()  # read through the other argument

    want = nnx.Linear(2, 2, rngs=nnx.Rngs(0)).kernel[...] + 1
    np.testing.assert_allclose(amp(f)(m, m), want)
    np.testing.assert_allclose(m.kernel[...], want)


def test_a_module_returned_twice_is_the_argument():
    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    ref = nnx.jit(lambda m: (m, m))(m)
    a, b = amp(lambda m: (m, m))(m)
    assert ref[0] is ref[1] is m
    assert a is b is m


def test_a_module_made_inside_and_returned_thrice_is_one_object():
    m1, m2, m3 = amp(lambda: (lambda m: (m, m, m))(nnx.Linear(2, 2, rngs=nnx.Rngs(0))))()
    assert m1 is m2 is m3
    assert isinstance(m1.kernel[...], jax.Array)


def test_a_submodule_returned_is_the_arguments_submodule():
    class Outer(nnx.Module):
        def __init__(self):
            self.inner = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    m = Outer()
    got = amp(lambda m: m.inner)(m)
    assert got is m.inner


@pytest.mark.parametrize("graph, graph_updates", [(True, True), (True, False), (False, False)])
def test_nnx_vmap_sees_an_argument_returned_with_another_axis(graph, graph_updates):
    # Flax's transforms_test test_consistent_aliasing_input_output: in_axes=0,
    # out_axes=1 on the same module is inconsistent; through amp, Flax sees it too
    class Foo(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.zeros((2, 3)))

    f = nnx.vmap(amp(lambda m: m), in_axes=0, out_axes=1, **_graph(graph, graph_updates))
    with pytest.raises(ValueError, match="Inconsistent aliasing detected|Duplicate Param"):
        f(Foo())


def test_cached_partial_shares_the_variables():
    # Flax's transforms_test test_cache_args, with amp around the function
    m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    @nnx.jit(**_graph())
    @amp
    def f(cached_m, m):
        assert cached_m is not m
        assert cached_m.kernel is m.kernel and cached_m.bias is m.bias
        return cached_m

    # (nnx.compat.cached_partial in Flax 0.12.8+, nnx.cached_partial before)
    cached_partial = getattr(getattr(nnx, "compat", nnx), "cached_partial", None)
    if cached_partial is None:
        pytest.skip(f"flax {flax.__version__} has no cached_partial")
    cached_f = cached_partial(f, m)
    cached_m = cached_f(m)
    assert cached_m is not m and cached_m.kernel is m.kernel
    assert cached_f(m) is cached_m


@pytest.mark.parametrize(
    "make, dtype",
    [
        (lambda: jnp.array(-1.0), jnp.float32),
        (lambda: jnp.array(3, jnp.int8), jnp.int8),
        (lambda: jnp.array(True), jnp.bool_),
    ],
    ids=["float32", "int8", "bool"],
)
def test_a_constant_written_into_a_variable_is_an_array(make, dtype):
    def f(m):
        m.v.set_value(make())  # made inside: a jaxpr literal (TypedFloat, TypedNdArray)
        return m.w[...].sum()

    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))
            self.v = nnx.Variable(jnp.zeros((), dtype))

    m, ref = M(), M()
    nnx.jit(f)(ref)
    amp(f)(m)
    got = m.v.get_value()
    assert isinstance(got, jax.Array) and type(got) is type(ref.v.get_value())
    assert got.dtype == dtype and got.shape == () and got == make()
    assert m.v[...] == make()  # (a TypedFloat is not subscriptable)


def test_literal_outputs_are_arrays_of_their_dtype():
    # (a guard: the output path already made Arrays of literals; writes did not)
    f = lambda x: (jnp.array(2.0), jnp.array(2, jnp.int8), jnp.asarray(True), 3)  # noqa: E731
    jaxpr = jax.make_jaxpr(f)(X)
    assert not jaxpr.eqns  # every output a literal
    got, ref = amp(f)(X), jax.jit(f)(X)
    for g, r in zip(got[:3], ref[:3]):
        assert isinstance(g, jax.Array) and (g.dtype, g.weak_type) == (r.dtype, r.weak_type)
    assert type(got[3]) is int and got[3] == 3  # (a Python scalar as f returns it)


_AXES = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})


def test_init_under_nnx_vmap():
    # Flax's ensemble creation (transforms_test test_out_axes): amp around __init__
    class MLP(nnx.Module):
        @nnx.split_rngs(splits=5, **_graph())
        @nnx.vmap(in_axes=(_AXES, _AXES), axis_size=5, **_graph())
        @amp
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 3, rngs=rngs)
            self.node = nnx.BatchStat(jnp.ones((2,)))
            self.width = 3

    m = MLP(rngs=nnx.Rngs(0))
    assert m.linear.kernel.shape == (5, 3, 3) and m.node.shape == (2,)
    assert m.width == 3 and isinstance(m.linear.kernel[...], jax.Array)


def test_init_with_static_attributes_under_nnx_jit():
    class Foo(nnx.Module):
        @nnx.jit(static_argnums=(1, 2), **_graph())
        @amp
        def __init__(self, din, dout, *, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), shape=(din, dout)))
            self.din = din

    m = Foo(2, 3, rngs=nnx.Rngs(0))
    assert m.w.shape == (2, 3) and m.din == 2 and isinstance(m.w[...], jax.Array)


def test_an_nnx_pytree_attribute_written_and_returned():
    class P(nnx.Pytree):
        def __init__(self):
            self.x = nnx.data(jnp.ones(2))
            self.n = 0

    def f(p):
        p.x = p.x * 2
        p.n = p.n + 1
        return p

    ref = P()
    out_ref = nnx.jit(f)(ref)
    p = P()
    out = amp(f)(p)
    assert out is p and out_ref is ref
    np.testing.assert_array_equal(p.x, ref.x)
    assert p.n == ref.n == 1


_needs_hijax = pytest.mark.skipif(not _HIJAX, reason="this Flax has no hijax Variables")


def _hijax_model():
    with nnx.var_defaults(hijax=True):
        m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        m.count = nnx.BatchStat(jnp.array(0))
    return m


def _count_and_call(m, x):
    m.count[...] += 1
    return m(x)


@_needs_hijax
def test_hijax_variables_under_jax_jit():
    m, x = _hijax_model(), jnp.ones((1, 2))
    want = jax.jit(lambda m, x: m(x))(m, x)
    got = jax.jit(amp(lambda m, x: m(x)))(m, x)  # "'aval_property' object is not callable"
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@_needs_hijax
def test_a_hijax_variable_written_is_written():
    m, x = _hijax_model(), jnp.ones((1, 2))
    assert amp(_count_and_call)(m, x).dtype == jnp.float32 and int(m.count[...]) == 1
    ref = _hijax_model()
    try:  # (Flax 0.12.8 writes a hijax Variable under jit; newer Flax needs ref=True)
        jax.jit(_count_and_call)(ref, x)
    except Exception as e:
        with pytest.raises(type(e)):
            jax.jit(amp(_count_and_call))(m, x)
        return
    jax.jit(amp(_count_and_call))(m, x)
    assert int(m.count[...]) == int(ref.count[...]) + 1 == 2


def _writable_under_jit():
    return _HIJAX and amp_jax._src.compat.hijax_writable_under_jit(nnx)


_needs_writable_hijax = pytest.mark.skipif(
    not _writable_under_jit(), reason="this Flax refuses a hijax Variable written under jit"
)


@_needs_writable_hijax
def test_a_hijax_variable_is_traced_as_itself():
    # (Flax's TestHijaxVariables::test_variable_to_hijax: fn gets the hijax
    # Variable, as under jax.jit, not a plain copy of it)
    seen = []

    def f(v, x):
        seen.append(v.hijax)
        v[...] = x @ v[...] @ x
        return v[...] + 1

    v = nnx.with_vars(nnx.Param(jnp.eye(256)), hijax=True)
    ref = nnx.with_vars(nnx.Param(jnp.eye(256)), hijax=True)
    x = jax.random.normal(jax.random.key(1), (256, 256))
    want = jax.jit(f)(ref, x)
    got = amp(f)(v, x)
    assert seen == [True, True] and v.hijax
    assert got.dtype == want.dtype == v[...].dtype == jnp.float32
    np.testing.assert_allclose(v[...], ref[...], rtol=0.05, atol=1.0)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=1.0)
    # the jaxpr reads and writes the Variable (Flax's get/set_variable), the
    # matmuls in bfloat16, the write in the Variable's float32
    rows = {(r.primitive, r.dtype) for r in amp_jax.explain(amp(f), v, x).rows}
    assert {("dot_general", "bfloat16"), ("set_variable", "float32")} <= rows, rows


@_needs_writable_hijax
def test_a_hijax_optimizer_step_with_a_nested_grad():
    # (Flax's TestOptimizer::test_optimize_hijax: fn writes the hijax Variables
    # after a jax.value_and_grad over plain copies of them)
    optax = pytest.importorskip("optax")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.uniform(rngs(), (64, 64)))
            self.count = nnx.Variable(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return x @ self.w

    def step(model, optimizer, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):
            return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(nnx.with_vars(params, hijax=False))
        optimizer.update(params, grads)
        return loss

    def make():
        with nnx.var_defaults(hijax=True):
            model = Model(nnx.Rngs(1))
            return model, nnx.Optimizer(model, tx=optax.adam(1e-3), wrt=nnx.Param)

    x = jax.random.normal(jax.random.key(0), (64, 64))
    y = jnp.ones((64, 64))
    (m, o), (m_ref, o_ref) = make(), make()
    w0 = np.asarray(m.w[...])
    want = jax.jit(step)(m_ref, o_ref, x, y)
    got = amp(step)(m, o, x, y)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert int(m.count[...]) == int(m_ref.count[...]) == 1
    assert int(o.step[...]) == int(o_ref.step[...]) == 1
    assert m.w.hijax and m.w[...].dtype == jnp.float32
    # (Adam's first step moves each weight by about the learning rate, either way)
    np.testing.assert_allclose(np.abs(m.w[...] - w0), 1e-3, rtol=0.05)
    np.testing.assert_allclose(m.w[...], m_ref.w[...], atol=2.1e-3)


@pytest.mark.parametrize(
    "diagnostic",
    [
        lambda m: amp_jax.explain(m, X),
        lambda m: amp_jax.explain(amp(m), X, grad=True),
        lambda m: amp_jax.dtype_report(m, X, policy="bfloat16"),
        lambda m: amp_jax.dtype_report(amp(m), X),
        lambda m: amp_jax.debug.first_nonfinite(m, X),
    ],
    ids=["explain", "explain-grad", "dtype_report", "dtype_report-amp", "first_nonfinite"],
)
def test_diagnostics_take_a_model_in_train_mode(diagnostic):
    m = _Net(nnx.Rngs(0))
    amp(lambda m, x: m(x))(m, X)  # what amp takes, the diagnostics take
    before = jax.tree.leaves(nnx.state(m))
    diagnostic(m)
    after = jax.tree.leaves(nnx.state(m))
    # the caller's model is left as it was (its writes went to the trace's copy)
    assert len(before) == len(after)
    assert all(isinstance(b, jax.Array) and a is b for a, b in zip(before, after))


def test_explain_of_a_model_reads_its_matmuls():
    m = _Net(nnx.Rngs(0))
    ex = amp_jax.explain(m, jnp.ones((256, 16)), policy=amp_jax.Policy(allow_outputs="float32"))
    dots = {r.dtype for r in ex.rows if r.primitive == "dot_general"}
    assert dots == {"bfloat16"}, ex


class _Holder(nnx.Module):
    def __init__(self):
        self.ref = nnx.data(None)


def test_a_cycle_written_into_an_argument_is_refused_and_jax_keeps_working():
    # a flatten of the cycle recursed without end, and JAX's C++ flatten then left the
    # interpreter's recursion depth spent: every later JAX call of the process failed
    def f(m):
        m.ref = m

    with pytest.raises(TypeError, match=r"made a cycle: `m.ref` is `m`.*nnx.jit"):
        amp(f)(_Holder())
    assert float((jnp.ones(3) + 1).sum()) == 6.0


def test_a_cycle_in_the_output_is_refused():
    def f(x):
        h = _Holder()
        h.ref = h
        return h, x

    with pytest.raises(TypeError, match=r"made a cycle: the output\[0\]\.ref is the output\[0\]"):
        amp(f)(jnp.ones(2))
    assert float((jnp.ones(3) * 2).sum()) == 6.0


class _Two(nnx.Module):
    def __init__(self, other: type = nnx.Linear):
        self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.b = (
            other(2, rngs=nnx.Rngs(1)) if other is nnx.BatchNorm else other(2, 2, rngs=nnx.Rngs(1))
        )


def _swap(m):
    m.a, m.b = m.b, m.a


@pytest.mark.parametrize("other", [nnx.Linear, nnx.BatchNorm])
def test_swapped_submodules_swap_places_not_values(other):
    # Flax's transforms_test test_graph_updates_same_type / _unflatten: plain Python and
    # nnx.jit leave the old objects in each other's place; the write-back matched nodes
    # by path, so the caller's objects swapped their values (or became copies)
    m = _Two(other)
    a, b = m.a, m.b
    a_kernel = np.asarray(a.kernel[...])
    f = amp(lambda m: _swap(m))
    f(m)
    assert m.a is b and m.b is a
    np.testing.assert_array_equal(a.kernel[...], a_kernel)
    f(m)  # swapped back (a new structure, Linear and BatchNorm, traces anew; as nnx.jit)
    assert m.a is a and m.b is b and f.trace_count == (1 if other is nnx.Linear else 2)
    f(m)
    assert m.a is b and m.b is a and f.trace_count == (1 if other is nnx.Linear else 2)
    np.testing.assert_array_equal(a.kernel[...], a_kernel)


def test_swapped_variables_keep_what_the_function_wrote():
    class P(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.array(1.0))
            self.b = nnx.Param(jnp.array(2.0))

    def f(p):
        p.a, p.b = p.b, p.a
        p.a[...] = p.a[...] * 10  # writes the old p.b

    want, m = P(), P()
    f(want)
    a, b = m.a, m.b
    amp(f)(m)
    assert m.a is b and m.b is a
    assert float(m.a[...]) == float(want.a[...]) == 20.0
    assert float(m.b[...]) == float(want.b[...]) == 1.0


def test_a_submodule_assigned_twice_is_the_callers_object():
    m = _Two()

    def f(m):
        m.c = m.a
        m.c.kernel[...] = m.c.kernel[...] * 0

    amp(f)(m)
    assert m.c is m.a
    assert not np.asarray(m.a.kernel[...]).any()


@pytest.mark.parametrize("graph_updates", [True, False])
def test_swapped_submodules_inside_a_container_under_nnx_jit(graph_updates):
    # Flax's transforms_test test_objects_in_pytree, with amp inside nnx.jit
    m = _Two()
    a, b = m.a, m.b
    f = nnx.jit(amp(lambda tree: _swap(tree[0]["foo"])), **_graph(True, graph_updates))
    f(({"foo": m},))
    assert (m.a, m.b) == ((b, a) if graph_updates else (a, b))


class _Arange(nnx.Module):
    def __init__(self):
        self.a = nnx.Variable(jnp.arange(4))


def test_a_captured_module_returned_is_the_module():
    # plain Python returns the captured object; amp returned a copy rebuilt from its arrays
    m = _Arange()
    f = amp(lambda x: (m, m.a, x + 1))
    for _ in range(2):  # traced, then from the cache
        got, a, _ = f(jnp.zeros(4))
        assert got is m and a is m.a
    made = amp(lambda x: _Arange())
    assert made(jnp.zeros(4)) is not made(jnp.zeros(4))  # made inside: a new one each call


@pytest.mark.parametrize("graph_updates", [True, False])
def test_a_captured_module_returned_under_nnx_vmap_raises_flaxs_error(graph_updates):
    # Flax's transforms_test test_captured_module_in_return_error, with amp inside nnx.vmap
    m = _Arange()
    f = nnx.vmap(amp(lambda x: m), in_axes=0, out_axes=0, **_graph(True, graph_updates))
    match = "different trace level" if graph_updates else "Cannot return captured Variable"
    with pytest.raises(ValueError, match=match):
        f(jnp.zeros((4,)))


def _bump_and_make(r):
    r[...] += 1.0
    return jax.new_ref(r[...] * 10), r


def test_a_ref_made_inside_amp_is_returned_as_a_new_ref():
    # Flax's transforms_test test_mutable_array_input_output: a jaxpr cannot return a
    # jax.Ref (jax.jit refuses: "returned a mutable array reference"); nnx.jit and plain
    # Python return the argument's Ref itself and the new one
    r = jax.new_ref(jnp.array(1.0))
    f = amp(lambda r: _bump_and_make(r))
    made, same = f(r)
    assert same is r and isinstance(made, jax.Ref) and made is not r
    assert float(r[...]) == 2.0 and float(made[...]) == 20.0
    again, _ = f(r)  # from the cache: a new Ref each call, as plain Python makes one
    assert f.trace_count == 1 and again is not made
    assert float(made[...]) == 20.0 and float(again[...]) == 30.0


def test_a_ref_made_inside_amp_under_nnx_jit():
    r = jax.new_ref(jnp.array(1.0))
    made, same = nnx.jit(amp(lambda r: _bump_and_make(r)), **_graph(True, True))(r)
    assert same is r and isinstance(made, jax.Ref)
    assert float(r[...]) == 2.0 and float(made[...]) == 20.0


def test_a_shared_param_in_nnx_containers_is_no_move():
    # Flax's transforms_test TestGrad::test_grad: a Param at two paths before the call is
    # not moved by it (a first cut of the move tracking wrote the nnx.List's own state back)
    p1 = nnx.Param(10.0)
    m = nnx.Dict(a=nnx.List([p1, nnx.Param(20.0)]), b=p1, c=7)
    grads = nnx.grad(amp(lambda m: m["a"][0][...] + m["a"][1][...] + m["b"][...]))(m)
    assert m.a[0] is m.b is p1
    assert float(grads["a"][0][...]) == 2.0 and float(grads["a"][1][...]) == 1.0
