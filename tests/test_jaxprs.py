"""The jaxpr toolkit every walker in amp shares (``amp_jax._src.jaxprs``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_jax._src import jaxprs


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


def test_eval_jaxpr_evaluates_through_the_hook():
    closed = jax.make_jaxpr(_f)(X, W)
    seen = []

    def bind(eqn, args):
        seen.append(eqn.primitive.name)
        return (
            eqn.primitive.bind(*args, **eqn.params)
            if eqn.primitive.multiple_results
            else [eqn.primitive.bind(*args, **eqn.params)]
        )

    out = jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (X, W), bind)
    for got, want in zip(out, _f(X, W)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert seen == [e.primitive.name for e in closed.jaxpr.eqns]
    # the default hook binds each eqn as it is
    out = jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (X, W))
    np.testing.assert_allclose(out[1], _f(X, W)[1], rtol=1e-6)


def test_eval_jaxpr_reads_constants_and_literals():
    c = np.arange(3.0, dtype=np.float32)
    closed = jax.make_jaxpr(lambda x: x * c + 1.0)(jnp.ones(3))
    (out,) = jaxprs.eval_jaxpr(closed.jaxpr, closed.consts, (jnp.ones(3),))
    np.testing.assert_allclose(out, c + 1.0)


def test_iter_eqns_walks_sub_jaxprs_with_run_counts():
    def f(x, w):
        def body(c, _):
            return lax.cond(c.sum() > 0, jnp.tanh, jnp.sin, c @ w), None

        c, _ = lax.scan(body, x, None, length=5)
        return jnp.exp(c)

    jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 3)), jnp.ones((3, 3))).jaxpr
    rows = [(e.primitive.name, where, times) for e, where, times, _ in jaxprs.iter_eqns(jaxpr)]
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
