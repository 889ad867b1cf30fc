"""amp_jax._src.compat: the params of JAX's higher-order primitives, on this JAX.

CI runs the suite on JAX 0.10, 0.11 and the newest JAX (noxfile.py); these
tests pin the params of each version (``PARAMS``) and the version-dependent
reads, so that a change in JAX fails here, by name, rather than deep inside
a rewrite.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from amp_jax._src import compat


def _eqn(jaxpr, name):
    found = [e for e in compat.jaxpr_of(jaxpr).eqns if e.primitive.name in name]
    assert found, [e.primitive.name for e in compat.jaxpr_of(jaxpr).eqns]
    return found[0]


def _rebind(jaxpr, eqn_name, args, **kw):
    """Evaluates ``jaxpr`` with the ``eqn_name`` eqn re-bound through compat."""
    closed = jaxpr
    eqn = _eqn(closed, eqn_name)

    def run(*a):
        env = dict(zip(compat.jaxpr_of(closed).invars, a))
        env.update(zip(compat.jaxpr_of(closed).constvars, compat.consts_of(closed)))
        read = lambda v: compat.literal_value(v) if isinstance(v, compat.Literal) else env[v]
        for e in compat.jaxpr_of(closed).eqns:
            params = compat.map_subjaxprs(e, lambda c: c) if e is eqn else None
            outs = compat.bind_eqn(e, [read(v) for v in e.invars], params)
            env.update(zip(e.outvars, outs))
        return [read(v) for v in compat.jaxpr_of(closed).outvars]

    return run(*args)


@pytest.mark.parametrize("n_consts, n_carry, n_xs", [(0, 1, 1), (2, 1, 3), (1, 2, 0)])
def test_scan_xs_are_the_trailing_scanned_operands(n_consts, n_carry, n_xs):
    consts = [jnp.full((3,), float(i)) for i in range(n_consts)]
    xs = [jnp.ones((5, 3)) * (i + 1) for i in range(n_xs)]

    def f(carry, xs):
        def body(c, x):
            c = tuple(ci + sum(consts, 0.0) + sum(x, 0.0) for ci in c)
            return c, c[0]

        return lax.scan(body, carry, xs, length=5)

    carry = tuple(jnp.zeros(3) for _ in range(n_carry))
    jaxpr = jax.make_jaxpr(f)(carry, xs)
    eqn = _eqn(jaxpr, {"scan"})
    body, idx = compat.scan_xs(eqn)
    assert list(idx) == list(range(len(eqn.invars) - n_xs, len(eqn.invars)))
    assert compat.scan_num_xs(eqn.params) == n_xs
    # the scanned operands are [length, ...] slices of the body's trailing inputs
    for i in idx:
        assert eqn.invars[i].aval.shape == (5, *compat.in_avals(body)[i].shape)
    # a body with retyped inputs is accepted by the primitive
    new = compat.scan_params_with_body(eqn, body)
    assert new["jaxpr"] is body


@pytest.mark.parametrize(
    "name, fn",
    [
        (
            "while",
            lambda x: lax.while_loop(
                lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, x)
            )[1],
        ),
        ("cond", lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)),
        ("scan", lambda x: lax.scan(lambda c, y: (c * y, c), x, jnp.ones((3, 4)))[0]),
        ("checkpoint", jax.checkpoint(lambda x: jnp.sin(x) * 2)),
        ("custom_jvp_call", jax.nn.relu),
        ("custom_vjp_call", jax.custom_vjp(lambda x: x * 3)),
        ("jit", jax.jit(lambda x: x @ x.T)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_map_subjaxprs_identity_rebinds_every_higher_order_primitive(name, fn):
    if name == "custom_vjp_call":
        fn.defvjp(lambda x: (x * 3, None), lambda _, g: (g * 3,))
    x = jnp.linspace(-1.0, 1.0, 4)
    jaxpr = jax.make_jaxpr(fn)(x)
    names = {name, "pjit", "remat", "remat2", "custom_vjp_call_jaxpr"} & {
        e.primitive.name for e in jaxpr.eqns
    }
    assert names, [e.primitive.name for e in jaxpr.eqns]
    eqn = _eqn(jaxpr, names)
    assert compat.has_subjaxprs(eqn)
    out = _rebind(jaxpr, names, [x])
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(fn(x)))
    if name == "custom_jvp_call":
        assert "jvp_jaxpr_fun" in eqn.params and compat.is_closed_jaxpr(eqn.params["call_jaxpr"])
    if name == "custom_vjp_call":
        assert "fwd_jaxpr_thunk" in eqn.params


def test_jit_is_inlinable_only_without_shardings_or_donation():
    x = jnp.ones(4)
    plain = _eqn(jax.make_jaxpr(jax.jit(jnp.sin))(x), compat.JIT_NAMES)
    donated = _eqn(
        jax.make_jaxpr(lambda x: jax.jit(jnp.sin, donate_argnums=0)(x))(x), compat.JIT_NAMES
    )
    assert compat.jit_is_inlinable(plain)
    assert not compat.jit_is_inlinable(donated)
    assert compat.is_closed_jaxpr(compat.jit_jaxpr(plain))


def test_closed_and_open_jaxprs():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 1.0)(jnp.ones(2))
    assert compat.is_closed_jaxpr(closed)
    opened = compat.jaxpr_of(closed)
    assert [v.aval for v in opened.invars] == compat.in_avals(closed)
    again = compat.close(opened, compat.consts_of(closed))
    assert compat.is_closed_jaxpr(again)


# -- helpers read by the interpreter, debug and transform -----------------------


def test_literal_value_and_cast_constant_stay_constants():
    closed = jax.make_jaxpr(lambda x: x * 2.5)(jnp.ones(3, jnp.float32))
    (eqn,) = compat.jaxpr_of(closed).eqns
    lit = eqn.invars[1]
    assert isinstance(lit, compat.Literal)
    val = compat.literal_value(lit)
    assert float(val) == 2.5 and np.dtype(val.dtype) == np.float32
    low = compat.cast_constant(val, np.dtype(jnp.bfloat16))
    # a numpy scalar of the new dtype, not a traced or device array
    assert isinstance(low, np.generic) and np.dtype(low.dtype) == np.dtype(jnp.bfloat16)
    assert float(low) == 2.5
    arr = compat.cast_constant(np.array([1.0, 1e-8, 3.0]), np.dtype(np.float16))
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float16 and arr.shape == (3,)
    np.testing.assert_array_equal(arr, np.array([1.0, 0.0, 3.0], np.float16))
    # a python scalar too
    assert np.dtype(compat.cast_constant(2, np.dtype(np.float32)).dtype) == np.float32


def test_while_split_counts_cond_and_body_consts():
    k1, k2, k3 = jnp.float32(1.0), jnp.float32(2.0), jnp.float32(3.0)

    def f(x, a, b, c):
        return lax.while_loop(
            lambda s: s[0] < a,  # cond reads one const
            lambda s: (s[0] + b * c, s[1] * c),  # body reads two
            (x, x),
        )

    closed = jax.make_jaxpr(f)(jnp.float32(0.0), k1, k2, k3)
    eqn = _eqn(closed, {"while"})
    cn, bn = compat.while_split(eqn.params)
    assert (cn, bn) == (1, 2)
    # the rest of the operands is the carry
    assert len(eqn.invars) - cn - bn == 2
    assert len(compat.jaxpr_of(eqn.params["cond_jaxpr"]).invars) == cn + 2
    assert len(compat.jaxpr_of(eqn.params["body_jaxpr"]).invars) == bn + 2


@pytest.mark.parametrize("n_consts, n_carry, n_xs", [(0, 1, 1), (2, 3, 1), (1, 2, 2)])
def test_scan_split_counts_consts_and_carry(n_consts, n_carry, n_xs):
    consts = [jnp.full((3,), float(i + 2)) for i in range(n_consts)]
    xs = [jnp.ones((4, 3)) * (i + 1) for i in range(n_xs)]

    def f(carry, xs):
        def body(c, x):
            return tuple(ci * sum(consts, 1.0) + sum(x) for ci in c), c[0]

        return lax.scan(body, carry, xs)

    carry = tuple(jnp.zeros(3) for _ in range(n_carry))
    eqn = _eqn(jax.make_jaxpr(f)(carry, xs), {"scan"})
    assert compat.scan_split(eqn.params) == (n_consts, n_carry)
    nc, ncarry = compat.scan_split(eqn.params)
    assert nc + ncarry + compat.scan_num_xs(eqn.params) == len(eqn.invars)


def test_name_stack_str_has_the_named_scopes():
    def f(x):
        with jax.named_scope("outer"):
            with jax.named_scope("inner"):
                y = jnp.sin(x)
        return y + 1.0

    eqns = compat.jaxpr_of(jax.make_jaxpr(f)(jnp.ones(2))).eqns
    sin = next(e for e in eqns if e.primitive.name == "sin")
    add = next(e for e in eqns if e.primitive.name == "add")
    assert compat.name_stack_str(sin) == "outer/inner"
    assert "outer" not in compat.name_stack_str(add)


def test_trace_to_closed_jaxpr_round_trip():
    def f(x, y):
        return jnp.tanh(x) @ y, x.sum()

    avals = [jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((3, 4), jnp.bfloat16)]
    closed = compat.trace_to_closed_jaxpr(f, avals)
    assert compat.is_closed_jaxpr(closed)
    assert not compat.is_open_jaxpr(closed)
    if compat.ONE_JAXPR_CLASS:  # JAX >= 0.11: the closed jaxpr is its own open jaxpr
        assert compat.jaxpr_of(closed) is closed
        assert not compat.is_open_jaxpr(compat.jaxpr_of(closed))
    else:  # JAX 0.10: a ClosedJaxpr wraps an open Jaxpr
        assert compat.is_open_jaxpr(compat.jaxpr_of(closed))
    assert [(a.shape, a.dtype) for a in compat.in_avals(closed)] == [
        ((2, 3), jnp.float32),
        ((3, 4), jnp.bfloat16),
    ]
    x = jnp.arange(6.0).reshape(2, 3) / 6
    y = jnp.ones((3, 4), jnp.bfloat16)
    want = f(x, y)
    got = jax.core.eval_jaxpr(compat.jaxpr_of(closed), compat.consts_of(closed), x, y)
    assert len(got) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # re-closing the open jaxpr gives an equivalent closed jaxpr
    again = compat.close(compat.jaxpr_of(closed), compat.consts_of(closed))
    assert compat.in_avals(again) == compat.in_avals(closed)
    assert compat.closed_to_open_no_consts(closed, "test") is compat.jaxpr_of(closed)


def test_closed_to_open_no_consts_refuses_captured_constants():
    c = np.arange(3.0, dtype=np.float32)
    open_ = compat.jaxpr_of(jax.make_jaxpr(lambda x, k: x + k)(jnp.ones(3), c))
    # the same jaxpr back: the object itself on JAX 0.10, a copy sharing its
    # eqns and variables on JAX >= 0.11 (ClosedJaxpr(jaxpr, consts) copies)
    again = compat.closed_to_open_no_consts(compat.close(open_, []), "x")
    assert again is open_ or compat.ONE_JAXPR_CLASS
    assert again.eqns is open_.eqns and again.invars == open_.invars
    assert again.outvars == open_.outvars and not again.constvars
    # a jaxpr that closes over an array constant
    const_closed = jax.make_jaxpr(lambda x: x + jnp.asarray(c) * 2)(jnp.ones(3))
    assert len(compat.consts_of(const_closed)) == 1
    with pytest.raises(NotImplementedError, match="captured constants"):
        compat.closed_to_open_no_consts(const_closed, "scan")


def test_trace_with_shape_kw_orders_args_then_kwargs():
    def f(x, *, scale):
        return {"y": x * scale["s"]}

    x = jax.ShapeDtypeStruct((2,), jnp.float32)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    closed, shape = compat.trace_with_shape_kw(f, [x], {"scale": {"s": s}})
    assert [a.shape for a in compat.in_avals(closed)] == [(2,), ()]
    assert jax.tree.structure(shape) == jax.tree.structure({"y": 0})
    assert shape["y"].shape == (2,) and shape["y"].dtype == jnp.float32
    closed2, shape2 = compat.trace_with_shape(lambda a: (a, a.sum()), [x])
    assert [o.shape for o in shape2] == [(2,), ()]
    assert len(compat.jaxpr_of(closed2).outvars) == 2


def test_abstract_key_tells_dtypes_and_weak_types_apart():
    a32 = compat.abstract_key(jnp.ones(3, jnp.float32))
    assert a32 == compat.abstract_key(jnp.zeros(3, jnp.float32))
    assert a32 != compat.abstract_key(jnp.ones(3, jnp.bfloat16))
    assert a32 != compat.abstract_key(jnp.ones(4, jnp.float32))
    assert compat.abstract_key(jnp.float32(1.0)) != compat.abstract_key(jnp.asarray(1.0))
    hash(a32)
    aval = compat.abstractify(jnp.ones((2, 3), jnp.bfloat16))
    assert aval.shape == (2, 3) and aval.dtype == jnp.bfloat16
    assert compat.aval_of(jnp.ones(2)).shape == (2,)


def test_vjp_residuals_rebuild_the_pullback():
    def f(x):
        return jnp.sin(x) * x

    x = jnp.linspace(0.0, 1.0, 4)
    _, vjp = jax.vjp(f, x)
    got = compat.vjp_residuals(vjp)
    assert got is not None
    leaves, treedef = got
    assert leaves and all(isinstance(l, jax.Array) for l in leaves)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    (g,) = rebuilt(jnp.ones(4))
    np.testing.assert_allclose(np.asarray(g), np.asarray(jnp.cos(x) * x + jnp.sin(x)), rtol=1e-6)


def test_source_line_names_this_file():
    eqn = compat.jaxpr_of(jax.make_jaxpr(lambda x: jnp.cos(x))(1.0)).eqns[0]
    line = compat.source_line(eqn)
    assert "test_compat.py" in line, line


def test_source_line_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    eqn = compat.jaxpr_of(jax.make_jaxpr(lambda x: jnp.cos(x))(1.0)).eqns[0]
    here = pathlib.Path(__file__).resolve()
    monkeypatch.chdir(here.parent)
    assert compat.source_line(eqn).startswith("test_compat.py:"), compat.source_line(eqn)
    monkeypatch.chdir(tmp_path)
    assert compat.source_line(eqn).startswith(str(here)), compat.source_line(eqn)


def test_memoized_fun_calls_once_per_argument_tuple():
    calls = []

    def fn(*args):
        calls.append(args)
        return sum(args)

    like = jax.make_jaxpr(jax.nn.relu)(jnp.ones(2)).eqns[0].params["jvp_jaxpr_fun"]
    wrapped = compat.memoized_fun(fn, like)
    assert wrapped.call_wrapped(1, 2) == 3
    assert wrapped.call_wrapped(1, 2) == 3
    assert calls == [(1, 2)]


@pytest.mark.parametrize(
    "fn",
    [
        jax.jit(jnp.sin),
        jax.checkpoint(jnp.sin),
        jax.nn.relu,
        jax.custom_vjp(jnp.sin),
    ],
    ids=["jit", "checkpoint", "custom_jvp", "custom_vjp"],
)
def test_call_like_names_cover_this_jax(fn):
    if isinstance(fn, jax.custom_vjp):
        fn.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
    (eqn,) = compat.jaxpr_of(jax.make_jaxpr(fn)(jnp.ones(3))).eqns
    assert eqn.primitive.name in compat.CALL_LIKE_NAMES, eqn.primitive.name
    assert len(list(jax.extend.core.jaxprs_in_params(eqn.params))) == 1


# -- the params of each higher-order primitive, per JAX version -------------------------

_JIT = {
    "jaxpr",
    "in_shardings",
    "out_shardings",
    "in_layouts",
    "out_layouts",
    "donated_invars",
    "ctx_mesh",
    "name",
    "keep_unused",
    "inline",
    "compiler_options_kvs",
}
_COMMON = {
    "while": {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"},
    "cond": {"branches"},
    "remat2": {"jaxpr", "prevent_cse", "differentiated", "policy"},
    "custom_jvp_call": {"call_jaxpr", "jvp_jaxpr_fun", "num_consts", "symbolic_zeros"},
    "custom_vjp_call": {
        "call_jaxpr",
        "fwd_jaxpr_thunk",
        "bwd",
        "num_consts",
        "out_trees",
        "symbolic_zeros",
    },
    "jit": _JIT,
    "shard_map": {"jaxpr", "mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes"},
}
_SCAN_011 = {"jaxpr", "length", "reverse", "unroll", "ft_in", "ft_out"}
#: (major, minor) -> primitive -> (param names, names of params holding an open
#: jaxpr, type name of jit's ``inline``). A new JAX fails
#: ``test_higher_order_params_are_pinned`` until its row is here and compat
#: handles what changed.
PARAMS = {
    (0, 10): (
        {**_COMMON, "scan": {"jaxpr", "length", "reverse", "unroll", "num_consts", "num_carry"}},
        {"remat2": {"jaxpr"}, "shard_map": {"jaxpr"}},
        "bool",
    ),
    (0, 11): ({**_COMMON, "scan": _SCAN_011}, {}, "Inline"),
}
PARAMS[(0, 12)] = PARAMS[(0, 11)]  # nothing amp_jax reads changed in 0.12

_MESH = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
_VJP = jax.custom_vjp(lambda x: x * 3)
_VJP.defvjp(lambda x: (x * 3, None), lambda _, g: (g * 3,))
_PROGRAMS = {
    "while": lambda x: lax.while_loop(
        lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, x)
    )[1],
    "cond": lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x),
    "scan": lambda x: lax.scan(lambda c, y: (c * y, c), x, jnp.ones((3, 4)))[0],
    "remat2": jax.checkpoint(lambda x: jnp.sin(x) * 2),
    "custom_jvp_call": jax.nn.relu,
    "custom_vjp_call": _VJP,
    "jit": jax.jit(lambda x: x @ x.T),
    "shard_map": jax.shard_map(
        lambda x: jnp.sin(x) * 2, mesh=_MESH, in_specs=jax.P("d"), out_specs=jax.P("d")
    ),
}


@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_higher_order_params_are_pinned(name):
    assert compat.JAX_VERSION in PARAMS, (
        f"JAX {jax.__version__} is not pinned: print each primitive's params here, add a "
        "PARAMS row for it, and make amp_jax/_src/compat/ read whatever changed"
    )
    names, open_params, inline_type = PARAMS[compat.JAX_VERSION]
    x = jnp.linspace(-1.0, 1.0, 4)
    eqn = _eqn(jax.make_jaxpr(_PROGRAMS[name])(x), {name})
    assert set(eqn.params) == names[name], sorted(eqn.params)
    # every jaxpr in the params is closed, or open where this JAX keeps it open
    jaxprs = [(k, j) for k, v in eqn.params.items() for j in (v if k == "branches" else [v])]
    jaxprs = [(k, j) for k, j in jaxprs if isinstance(j, (compat.Jaxpr, compat.ClosedJaxpr))]
    assert jaxprs
    for key, j in jaxprs:
        if key in open_params.get(name, ()):
            assert compat.is_open_jaxpr(j) and not compat.is_closed_jaxpr(j), key
        else:
            assert compat.is_closed_jaxpr(j) and not compat.is_open_jaxpr(j), key
    if name == "jit":
        assert type(eqn.params["inline"]).__name__ == inline_type
    # the compat readers agree with the params, on every version
    if name == "scan":
        assert compat.scan_split(eqn.params) == (0, 1)
        assert compat.scan_num_xs(eqn.params) == 1
    if name == "while":
        assert compat.while_split(eqn.params) == (0, 0)
    assert compat.has_subjaxprs(eqn)
