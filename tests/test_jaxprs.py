"""The jaxpr toolkit every walker in amp shares (``amp_jax._src.jaxprs``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxpr_as_fun

import amp_jax
from amp_jax._src import compat, jaxprs
from amp_jax.eager._deps import dependencies


def _f(x, w):
    h = x @ w
    return jnp.tanh(h) + h, jnp.sum(h)


X, W = jnp.ones((4, 8)), jnp.full((8, 3), 0.5)


def test_def_use_maps_producers_and_consumers():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * jnp.sin(x) + 2.0)(X).jaxpr
    producer, consumers = jaxprs.def_use(jaxpr)
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names[:2] == ["sin", "sin"]
    (x,) = jaxpr.invars
    assert x not in producer and consumers[x] == [0, 1]  # an input: read, not written
    for i, e in enumerate(jaxpr.eqns):
        assert all(producer[v] == i for v in e.outvars)
    mul = names.index("mul")
    assert consumers[jaxpr.eqns[0].outvars[0]] == [mul]
    add = names.index("add")
    assert consumers[jaxpr.eqns[mul].outvars[0]] == [add]
    assert jaxpr.eqns[add].outvars[0] not in consumers  # the output: nobody reads it
    # the literal 2.0 is nobody's
    assert all(isinstance(k, jax.extend.core.Var) for k in consumers)


def test_contraction_and_flops_of_dots_and_convolutions():
    def f(x, w, a, b, img, k):
        return (
            x @ w,
            jnp.einsum("bij,bjk->bik", a, b),
            lax.conv_general_dilated(img, k, (1, 1), "SAME"),
            jnp.tanh(x),
        )

    args = (
        X,
        W,
        jnp.ones((2, 4, 5)),
        jnp.ones((2, 5, 6)),
        jnp.ones((1, 3, 8, 8)),  # NCHW
        jnp.ones((7, 3, 3, 3)),  # OIHW
    )
    eqns = {
        e.primitive.name + str(len(e.outvars[0].aval.shape)): e
        for e in jax.make_jaxpr(f)(*args).jaxpr.eqns
    }
    assert jaxprs.contraction_and_flops(eqns["dot_general2"]) == (8, 2 * 8 * 4 * 3)
    assert jaxprs.contraction_and_flops(eqns["dot_general3"]) == (5, 2 * 5 * 2 * 4 * 6)
    # in-features x window, times every output element
    assert jaxprs.contraction_and_flops(eqns["conv_general_dilated4"]) == (
        3 * 3 * 3,
        2 * 27 * 7 * 8 * 8,
    )
    assert jaxprs.contraction_and_flops(eqns["tanh2"]) is None


def _recording(seen):
    """A hook that binds each eqn as it is and records (index, primitive, name stack)."""

    def hook(i, eqn, env):
        seen.append((i, eqn.primitive.name, compat.current_name_stack_str()))
        return jaxprs.bind(i, eqn, env)

    return hook


def test_eval_jaxpr_calls_the_hook_once_per_eqn_in_order():
    closed = jax.make_jaxpr(_f)(X, W)
    seen = []
    out = jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (X, W), _recording(seen))
    for got, want in zip(out, _f(X, W)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert [(i, name) for i, name, _ in seen] == [
        (i, e.primitive.name) for i, e in enumerate(closed.jaxpr.eqns)
    ]


def test_eval_jaxpr_results_come_from_the_hook():
    # a hook that doubles every tanh: the outputs follow it, values are threaded
    closed = jax.make_jaxpr(_f)(X, W)

    def doubled_tanh(i, eqn, env):
        outs = jaxprs.bind(i, eqn, env)
        return [2 * o for o in outs] if eqn.primitive.name == "tanh" else outs

    out, total = jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (X, W), doubled_tanh)
    h = X @ W
    np.testing.assert_allclose(out, 2 * jnp.tanh(h) + h, rtol=1e-6)
    np.testing.assert_allclose(total, jnp.sum(h), rtol=1e-6)


def test_eval_jaxpr_runs_each_eqn_under_its_source_context():
    def f(x):
        with jax.named_scope("outer"):
            y = jnp.sin(x)
        return jnp.cos(y)

    closed = jax.make_jaxpr(f)(X)
    seen = []
    jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (X,), _recording(seen))
    assert [(name, stack) for _, name, stack in seen] == [("sin", "outer"), ("cos", "")]


def test_eval_jaxpr_reads_constants_and_literals():
    c = np.arange(3.0, dtype=np.float32)
    closed = jax.make_jaxpr(lambda x: x * c + 1.0)(jnp.ones(3))
    assert closed.jaxpr.constvars and any(
        isinstance(v, jax.extend.core.Literal) for e in closed.jaxpr.eqns for v in e.invars
    )
    (out,) = jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (jnp.ones(3),))
    np.testing.assert_allclose(out, c + 1.0)


def test_eval_jaxpr_over_another_value_domain():
    # label sets instead of arrays: a literal has none, an eqn unites its operands'
    closed = jax.make_jaxpr(lambda x, y: (jnp.sin(x) * 2.0, x + y))(X, X)

    def union(i, eqn, env):
        return [frozenset().union(*env.operands(eqn))] * len(eqn.outvars)

    env = jaxprs.Env(literal=lambda _: frozenset())
    out = jaxprs.eval_jaxpr(closed.jaxpr, [], [{"x"}, {"y"}], union, env)
    assert out == [{"x"}, {"x", "y"}]


def test_eval_jaxpr_keeps_no_dropped_var():
    closed = jax.make_jaxpr(lambda x: (jnp.sin(x), jnp.cos(x)))(X)
    sin, cos = closed.jaxpr.eqns
    drop = jax.extend.core.DropVar(sin.outvars[0].aval)
    jaxpr = closed.jaxpr.replace(eqns=[sin.replace(outvars=[drop]), cos], outvars=[cos.outvars[0]])
    env = jaxprs.Env()
    (out,) = jaxprs.eval_jaxpr(jaxpr, [], (X,), jaxprs.bind, env)
    np.testing.assert_allclose(out, jnp.cos(X))
    assert set(env.vals) == {jaxpr.invars[0], cos.outvars[0]}


def test_run_eqns_evaluates_a_slice_into_a_dict():
    closed = jax.make_jaxpr(_f)(X, W)
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.invars, (X, W)))
    jaxprs.run_eqns(jaxpr.eqns[:1], env)  # the dot only
    np.testing.assert_allclose(jaxprs.read(env, jaxpr.eqns[0].outvars[0]), X @ W, rtol=1e-6)
    assert len(env) == 3


def test_iter_eqns_walks_sub_jaxprs_with_run_counts():
    def f(x, w):
        def body(c, _):
            return lax.cond(c.sum() > 0, jnp.tanh, jnp.sin, c @ w), None

        c, _ = lax.scan(body, x, None, length=5)
        return jnp.exp(c)

    jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 3)), jnp.ones((3, 3))).jaxpr
    rows = [(e.primitive.name, where, times) for e, where, times, _, _ in jaxprs.iter_eqns(jaxpr)]
    assert ("dot_general", "scan", 5) in rows
    assert ("tanh", "scan/cond", 5) in rows and ("sin", "scan/cond", 5) in rows
    assert ("exp", "", 1) in rows
    assert not any(name in ("scan", "cond") for name, _, _ in rows)  # first-order only


def test_open_jaxpr_and_closed_subjaxprs():
    closed = jax.make_jaxpr(lambda x: lax.cond(x.sum() > 0, jnp.tanh, jnp.sin, x))(X)
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    subs = jaxprs.closed_subjaxprs(cond)
    assert len(subs) == 2
    for sub in subs:
        jaxpr, consts = jaxprs.open_jaxpr(sub)
        assert consts == list(sub.consts) and jaxpr is sub.jaxpr
    jaxpr, consts = jaxprs.open_jaxpr(subs[0].jaxpr)  # an open one: no consts
    assert jaxpr is subs[0].jaxpr and consts == []


def test_every_evaluator_in_amp_is_a_hook_on_eval_jaxpr(monkeypatch):
    # the interpreter, debug's probes and eager's dependency analysis all walk
    # through jaxprs.eval_jaxpr, each with its own hook (jit inlining splices:
    # test_inline_splices_jit_bodies_in_place)
    hooks = []
    real = jaxprs.eval_jaxpr

    def spy(jaxpr, consts, args, hook=jaxprs.bind, *rest):
        hooks.append(hook.__name__)
        return real(jaxpr, consts, args, hook, *rest)

    monkeypatch.setattr(jaxprs, "eval_jaxpr", spy)

    def f(x, w):
        return jnp.sum(jax.jit(jnp.tanh)(x @ w))

    amp_jax.amp(f)(X, W)
    amp_jax.debug.first_nonfinite(f, X, W)
    dependencies(jax.make_jaxpr(f)(X, W), [frozenset("x"), frozenset("w")])
    assert {"by_decision", "probing", "_propagate"} <= set(hooks), hooks


def test_inline_splices_jit_bodies_in_place():
    # nested jits, a body forwarding an input, a literal result, a dropped
    # result, a body constant and a named scope around the call
    @jax.jit
    def inner(a):
        return jnp.sin(a) * np.arange(4.0, dtype=np.float32), a

    @jax.jit
    def outer(a, b):
        s, fwd = inner(a)
        return s + b, fwd, 2.0

    def f(x, y):
        with jax.named_scope("block"):
            s, fwd, two = outer(x, y)
        _, dropped, _ = outer(y, x)
        del dropped
        return jnp.cos(s) * two + fwd

    x, y = jnp.linspace(0.0, 1.0, 4), jnp.linspace(1.0, 2.0, 4)
    closed = jax.make_jaxpr(f)(x, y)
    flat = jaxprs.inline(closed, compat.jit_is_inlinable, compat.jit_jaxpr)
    names = [e.primitive.name for e in flat.jaxpr.eqns]
    assert not {"jit", "pjit"} & set(names), names
    assert names.count("sin") == 2 and names.count("cos") == 1
    # the eqns of ``closed`` itself are the same objects
    assert [e for e in closed.jaxpr.eqns if e.primitive.name == "cos"][0] in flat.jaxpr.eqns
    # a spliced eqn gets the name stack of the call in front of its own
    sin = [e for e in flat.jaxpr.eqns if e.primitive.name == "sin"]
    assert "block" in str(sin[0].source_info.name_stack)
    assert "block" not in str(sin[1].source_info.name_stack)
    np.testing.assert_array_equal(jaxpr_as_fun(flat)(x, y)[0], f(x, y))
    # nothing to inline: the same closed jaxpr
    plain = jax.make_jaxpr(jnp.sin)(x)
    assert jaxprs.inline(plain, compat.jit_is_inlinable, compat.jit_jaxpr) is plain


def test_inline_folds_a_constant_as_tracing_in_place_would():
    # jnp.where's jitted body converts its weak scalar operand: with a literal
    # operand, tracing the body in place folds the convert into a literal
    def f(m, s):
        return jax.jit(lambda m, s, v: jnp.where(m, s, v))(m, s, -1e9)

    m, s = jnp.array([True, False]), jnp.ones(2)
    flat = jaxprs.inline(jax.make_jaxpr(f)(m, s), compat.jit_is_inlinable, compat.jit_jaxpr)
    converts = [e for e in flat.jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert not converts, flat
    assert any(isinstance(v, compat.Literal) for e in flat.jaxpr.eqns for v in e.invars)


def test_inline_folds_each_body_eqn_and_constant_once(monkeypatch):
    # a helper's jitted body is one jaxpr at every call site (one per layer of
    # a model): its convert of a literal is traced once per literal value, and
    # every call site still gets its own Literal objects, with its own value
    where = jax.jit(lambda m, s, v: jnp.where(m, s, v))

    def f(m, s):
        for _ in range(3):
            s = where(m, s, -1e9)
        return where(m, s, -2e9), where(m, s, -1e9)

    traced = []
    real = jaxprs._folded
    monkeypatch.setattr(jaxprs, "_folded", lambda e, v: traced.append(e) or real(e, v))
    m, s = jnp.array([True, False]), jnp.ones(2)
    closed = jax.make_jaxpr(f)(m, s)
    flat = jaxprs.inline(closed, compat.jit_is_inlinable, compat.jit_jaxpr)
    # the convert (folded) and the broadcast of its literal (not), for -1e9 (four
    # call sites) and -2e9: without the memo, 10
    assert [e.primitive.name for e in traced] == ["convert_element_type", "broadcast_in_dim"] * 2
    names = [e.primitive.name for e in flat.jaxpr.eqns]
    assert names.count("select_n") == 5 and "convert_element_type" not in names
    broadcasts = [e for e in flat.jaxpr.eqns if e.primitive.name == "broadcast_in_dim"]
    lits = [v for e in broadcasts for v in e.invars if isinstance(v, compat.Literal)]
    assert len(lits) == 5 and len({id(v) for v in lits}) == 5  # no Literal shared
    assert [float(v.val) for v in lits] == [-1e9, -1e9, -1e9, -2e9, -1e9]
    np.testing.assert_array_equal(jaxpr_as_fun(flat)(m, s)[0], f(m, s)[0])
    # the memo is one inline's: inlining again traces again, to the same jaxpr
    again = jaxprs.inline(closed, compat.jit_is_inlinable, compat.jit_jaxpr)
    assert len(traced) == 8 and str(again) == str(flat)


def test_inline_folds_a_literal_numpy_cannot_read_without_the_memo():
    # a literal of an extended dtype (a PRNG key) has no bytes to key the memo
    # by: it is folded (or not) as without the memo
    key = jax.random.key(0)
    eqn = jax.make_jaxpr(jax.random.key_data)(key).jaxpr.eqns[0]
    lit = compat.Literal(key, jax.typeof(key))
    folds = jaxprs._Folds()
    assert folds.get(eqn, [lit]) == jaxprs._folded(eqn, [lit]) and not folds.made


def test_iter_eqns_names_no_place_for_a_jit_jax_inlines():
    # JAX 0.12 keeps a jit(inline=True) in jaxprs (Inline.JAX_LATE) and inlines
    # it when lowering; amp's dots are such jits: no "jit" place for their ops
    def f(x):
        a = jax.jit(jnp.sin, inline=True)(x)
        return jax.jit(jnp.cos)(a)

    rows = {e.primitive.name: where for e, where, *_ in jaxprs.iter_eqns(jax.make_jaxpr(f)(X))}
    assert rows == {"sin": "", "cos": "jit"}, rows


# -- bind_jitted: amp binds an op as jnp binds its functions ------------------------

_STAGED = pytest.mark.skipif(
    not compat.inline_jits_staged(),
    reason="JAX 0.12+ keeps inline jits in the jaxpr until lowering: amp binds each op itself",
)


def _deep(depth):
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) * 2.0 + 1.0  # (one line: every layer's ops share it)
        return jnp.sum(x * x)

    ws = [jnp.full((16, 16), 0.01 * (i + 1)) for i in range(depth)]
    return loss, ws, jnp.ones((4, 16))


def _tanh_binds(monkeypatch, depth):
    """How often amp's trace of the depth-``depth`` model's gradient binds ``tanh``."""
    calls = []
    bind = compat.bind_eqn

    def counting(eqn, invals, params=None):
        calls.append(eqn.primitive.name)
        return bind(eqn, invals, params)

    monkeypatch.setattr(compat, "bind_eqn", counting)
    jaxprs._JITTED.clear()
    loss, ws, x = _deep(depth)
    jax.make_jaxpr(jax.value_and_grad(amp_jax.amp(loss)))(ws, x)
    return calls.count("tanh")


@_STAGED
def test_an_op_is_traced_once_per_line_and_reused_at_every_layer(monkeypatch):
    """Under ``grad``, each layer's ``tanh`` goes through one cached inline jit
    (JAX then linearizes it once, as it does ``jnp``'s own jitted functions),
    not a bind per layer."""
    assert _tanh_binds(monkeypatch, 2) == _tanh_binds(monkeypatch, 6) == 1


@_STAGED
def test_the_jitted_binds_leave_the_program_as_it_was(monkeypatch):
    loss, ws, x = _deep(3)
    step = jax.value_and_grad(amp_jax.amp(loss))
    jaxprs._JITTED.clear()
    jitted = str(jax.make_jaxpr(step)(ws, x))
    assert jaxprs._JITTED  # (the feature ran)
    monkeypatch.setattr(jaxprs, "bind_jitted", lambda eqn, invals: None)
    step = jax.value_and_grad(amp_jax.amp(loss))
    assert str(jax.make_jaxpr(step)(ws, x)) == jitted
    assert "pjit" not in jitted and "jit[" not in jitted  # (inlined where JAX stages them)


@_STAGED
def test_a_jitted_bind_keeps_each_ops_own_source_line_and_its_literals():
    def f(x):
        a = jnp.tanh(x)
        b = jnp.tanh(x * 3.0)
        return a + b

    jaxprs._JITTED.clear()
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(amp_jax.amp(f)(x))))(jnp.ones(8)).jaxpr
    eqns = [e for e, *_ in jaxprs.iter_eqns(jaxpr)]
    tanhs = [e for e in eqns if e.primitive.name == "tanh"]
    lines = {compat.source_line(e).split(" ")[0].rsplit(":", 1)[0] for e in tanhs}
    assert len(tanhs) == 2 and len(lines) == 2, lines
    muls = [e for e in eqns if e.primitive.name == "mul"]
    lits = [
        compat.literal_value(a) for e in muls for a in e.invars if isinstance(a, compat.Literal)
    ]
    assert 3.0 in lits  # (a literal stays one)


def test_no_jitted_bind_outside_a_trace():
    eqn = jax.make_jaxpr(jnp.tanh)(1.0).jaxpr.eqns[0]
    assert jaxprs.bind_jitted(eqn, [np.float32(1.0)]) is None


def test_an_eager_grad_binds_its_ops_one_by_one():
    """Outside ``jit`` a gradient's values are concrete: amp binds each op as
    written (a primitive without a lowering still runs eagerly there)."""
    loss, ws, x = _deep(2)
    jaxprs._JITTED.clear()
    jax.grad(amp_jax.amp(loss))(ws, x)
    assert not jaxprs._JITTED
    jax.make_jaxpr(jax.grad(amp_jax.amp(loss)))(ws, x)
    assert bool(jaxprs._JITTED) == compat.inline_jits_staged()
