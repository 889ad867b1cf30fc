"""Planning: one typed decision per eqn, made once, with its reason.

What keeps an op amp would lower in its original precision (float64, an
explicit precision, too small, a constant the compute dtype cannot
represent, no kernel on this backend), the typed records of the plan, and
that ``explain`` and ``dtype_report`` say what the plan decided; what a
loop's or cond's plan hands its sub-jaxprs' plans (`BodyHints`), the printed
plan, and the frozen configuration, all without tracing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F32, prim_dtypes
from jax import lax

import amp_jax
from amp_jax import Policy, amp, dtype_report
from amp_jax._src import compat, context, decision, planning, plans
from amp_jax._src.backends import backend_for
from amp_jax._src.decision import (
    BodyHints,
    Color,
    Decision,
    Fused,
    Kind,
    OpClass,
    Reason,
    Variant,
    Why,
    body_hints,
)


def _ctx(policy="bfloat16", backend="cpu"):
    return context.Context(amp_jax.get_policy(policy), backend_for(backend))


def _plan(fn, *args, policy="bfloat16", backend=None):
    ctx = _ctx(policy, backend or jax.default_backend())
    return planning.plan(ctx, jax.make_jaxpr(fn)(*args))


def _by_prim(p, name):
    return [d for e, d in zip(p.jaxpr.eqns, p.decisions) if e.primitive.name == name]


# -- float64, complex and explicit precision are left as written ------------------------------


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def test_float64_and_complex_dots_are_not_lowered(x64):
    rng = np.random.default_rng(0)
    a32 = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    for other in (jnp.float64, jnp.complex64):
        b = jnp.asarray(rng.standard_normal((64, 64)), other)
        f = amp(lambda a, b: a @ b)
        np.testing.assert_array_equal(np.asarray(f(a32, b)), np.asarray(a32 @ b))
        rows = dtype_report(f, a32, b)
        assert [r[5] for r in rows if r[0] == "dot_general"] == [
            "float64/complex operand: not ours to lower"
        ]


@pytest.mark.parametrize("precision", [lax.Precision.HIGHEST, lax.Precision.HIGH, "highest"])
def test_explicit_precision_stays_float32(precision):
    a, b = jnp.ones((64, 64)) / 3, jnp.ones((64, 64)) / 7
    f = amp(lambda a, b: jnp.dot(a, b, precision=precision) + a @ b)
    dots = sorted(i for i, _, _ in prim_dtypes(jax.make_jaxpr(f)(a, b), "dot_general"))
    assert dots == sorted([(F32, F32), (BF16, BF16)])
    why = {r[5] for r in dtype_report(f, a, b) if r[0] == "dot_general"}
    assert any("explicit precision" in w for w in why), why


def test_tiny_contractions_stay_float32_and_say_why():
    v, m, big = jnp.ones(32), jnp.ones((7, 8, 4)), jnp.ones((64, 64))
    f = amp(lambda v, m, big, c: (jnp.dot(v, v), jnp.einsum("s,sij->ij", c, m), big @ big))
    c = jnp.ones(7)
    dots = prim_dtypes(jax.make_jaxpr(f)(v, m, big, c), "dot_general")
    assert sorted(i for i, _, _ in dots) == sorted([(F32, F32), (F32, F32), (BF16, BF16)])
    reasons = {r[1]: r[5] for r in dtype_report(f, v, m, big, c) if r[0] == "dot_general"}
    assert reasons.keys() == {"float32,float32", "bfloat16,bfloat16"}, reasons  # (one row each)
    assert "too small" in reasons["float32,float32"]
    assert reasons["bfloat16,bfloat16"].startswith("allow class: runs in bfloat16")
    low = amp(lambda v: jnp.dot(v, v), policy=Policy(min_low_contraction=0, min_low_flops=0))
    assert prim_dtypes(jax.make_jaxpr(low)(v), "dot_general")[0][0] == (BF16, BF16)


# -- constants the compute dtype cannot represent ---------------------------------------


def test_float16_constants_out_of_range_keep_their_op_float32():
    x = w = jnp.ones((512, 512))
    f = lambda x, w: ((x @ w) * 1e-8) @ w  # noqa: E731  (1e-8 is 0 in float16)
    out = amp(f, policy="float16")(x, w)
    np.testing.assert_allclose(out, f(x, w), rtol=0.03)  # 0.0026, not 0
    why = [  # (every op has its reason now: the one kept in float32 says why)
        r
        for r in dtype_report(amp(f, policy="float16"), x, w)
        if r[1] == "float32,float32" and r[0] != "convert_element_type"
    ]
    assert [(r[0], r[1], r[5]) for r in why] == [
        ("mul", "float32,float32", "reads a constant the compute dtype cannot represent")
    ]

    def masked_pool(x, w):
        h = x @ w
        h = jnp.where(jnp.arange(h.shape[-1]) % 3 == 0, h, -1e9)  # the usual mask fill
        p = lax.reduce_window(h, -jnp.inf, lax.max, (1, 4), (1, 4), "VALID")
        return p @ w[: p.shape[-1]]

    x, w = (
        jax.random.normal(jax.random.PRNGKey(0), (8, 64)),
        jax.random.normal(jax.random.PRNGKey(1), (64, 64)) / 8,
    )
    out = amp(masked_pool, policy="float16")(x, w)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, masked_pool(x, w), atol=0.02 * float(jnp.max(jnp.abs(out))))
    # bfloat16 represents both constants: nothing is kept (no row gives a reason to keep)
    kept = set(decision.KEPT.values())
    assert not [r for r in dtype_report(amp(masked_pool), x, w) if r[5] in kept]


def test_each_different_constant_is_judged_once_per_jaxpr(monkeypatch):
    # a model's constants repeat at every layer: each value is judged once,
    # and every op that reads an unrepresentable one is still kept
    from amp_jax._src import painted

    judged = []
    real = painted._unrepresentable
    monkeypatch.setattr(painted, "_unrepresentable", lambda v, d: judged.append(v) or real(v, d))

    def f(x, w):
        for _ in range(4):
            x = jnp.tanh(((x @ w) * 1e-8) @ w * 0.5)
        return x

    x = w = jnp.ones((64, 64))
    closed = jax.make_jaxpr(f)(x, w)
    kept = painted._reads_unrepresentable_constant(closed.jaxpr, np.dtype(jnp.float16))
    assert sorted(float(v) for v in judged) == [float(np.float32(1e-8)), 0.5]  # without: 8
    muls = [i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "mul"]
    assert kept == muls[::2] and len(kept) == 4  # the four * 1e-8, not the * 0.5
    # the memo is one jaxpr's: another dtype judges afresh (bfloat16 holds 1e-8)
    assert painted._reads_unrepresentable_constant(closed.jaxpr, np.dtype(jnp.bfloat16)) == []
    assert len(judged) == 4


# -- the typed plan -----------------------------------------------------------------------


def test_every_eqn_gets_one_typed_decision():
    def f(w, x):
        h = jnp.tanh(x @ w) @ w
        return jnp.sum(jnp.exp(h)), lax.cond(h.sum() > 0, jnp.sin, jnp.cos, h), jnp.arange(3) * 2

    w, x = jnp.ones((64, 64)) / 64, jnp.ones((32, 64))
    p = _plan(f, w, x, backend="gpu")  # (XLA:CPU keeps the tanh float32: test_backend_cpu.py)
    assert len(p.decisions) == len(p.jaxpr.eqns)
    assert all(isinstance(d, Decision) for d in p.decisions)
    dots = _by_prim(p, "dot_general")
    assert all(d.lowered and d.kind is Kind.OP for d in dots)
    # the first dot's result decides the cond's branch: it writes float32
    assert dots[1].out_dtype == F32 and dots[1].reason.why is Why.DECIDES_CONTROL
    ((tanh,),) = [_by_prim(p, "tanh")]
    assert (tanh.op_class, tanh.color, tanh.reason.why) == (OpClass.FOLLOW, Color.LOW, Why.PAINTING)
    ((exp,),) = [_by_prim(p, "exp")]
    assert (exp.op_class, exp.color, exp.reason.why) == (OpClass.DENY, Color.HIGH, Why.POLICY_CLASS)
    ((cond,),) = [_by_prim(p, "cond")]
    assert (cond.kind, cond.op_class, cond.color) == (Kind.NESTED, None, Color.ORIG)
    iota = [d for e, d in zip(p.jaxpr.eqns, p.decisions) if e.primitive.name == "iota"]
    assert iota and all(d.kind is Kind.NO_FLOAT for d in iota)


def test_decisions_are_frozen_and_their_sets_closed():
    d = Decision(Kind.OP, OpClass.ALLOW, Color.LOW, Reason(Why.POLICY_CLASS, "allow class"))
    with pytest.raises(AttributeError):
        d.color = Color.HIGH
    # an op class is not a color, as the strings "opaque", "skip", "keep" once were both
    assert {c.value for c in OpClass}.isdisjoint({c.value for c in Color})
    assert d.variant is Variant.COMPUTE and d.fused is Fused.NO and d.attention is None


@pytest.mark.parametrize(
    "backend, variant, why",
    [("cpu", Variant.FLOAT32, Why.BACKEND_KERNEL), ("gpu", Variant.COMPUTE, Why.POLICY_CLASS)],
)
def test_the_backend_limitation_is_decided_and_explained_in_one_place(backend, variant, why):
    a, b = jnp.ones((2, 32, 64)), jnp.ones((2, 64, 32))
    ((d,),) = [
        _by_prim(
            _plan(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b, backend=backend),
            "dot_general",
        )
    ]
    assert (d.color, d.variant, d.reason.why) == (Color.LOW, variant, why)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's batched dots")
def test_explain_says_what_ran_for_a_batched_dot_on_cpu():
    a, b = jnp.ones((2, 32, 64)), jnp.ones((2, 64, 32))
    f = lambda a, b: jnp.sum(jnp.einsum("bij,bjk->bik", a, b))  # noqa: E731
    ex = amp_jax.explain(f, a, b, grad=True)
    dots = [r for r in ex.rows if r.primitive == "dot_general"]
    assert dots and all(r.dtype == "float32" for r in dots)
    assert all(decision.KEPT[Why.BACKEND_KERNEL] in r.reason for r in dots), dots
    # ... and an unbatched dot beside it runs in bfloat16, and says so
    g = lambda a, b: jnp.sum(a[0] @ b[0])  # noqa: E731
    (row,) = [r for r in amp_jax.explain(g, a, b).rows if r.primitive == "dot_general"]
    assert row.dtype == "bfloat16" and row.reason.startswith("allow class")


def test_planning_asks_the_backend_record_which_dots_have_a_kernel():
    batched = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(
        jnp.ones((2, 32, 64)), jnp.ones((2, 64, 32))
    ).eqns[0]
    plain = jax.make_jaxpr(jnp.dot)(jnp.ones((32, 64)), jnp.ones((64, 32))).eqns[0]
    tanh = jax.make_jaxpr(jnp.tanh)(jnp.ones(3)).eqns[0]
    cpu, gpu = backend_for("cpu"), backend_for("gpu")
    assert not cpu.has_low_kernel(batched) and cpu.has_low_kernel(plain)
    assert gpu.has_low_kernel(batched) and cpu.has_low_kernel(tanh)


# -- what a parent's plan tells the plans of its sub-jaxprs (BodyHints), without tracing -----


def _higher_order(p, name, param):
    """``(eqn, decision, sub-jaxpr at param)`` of the one ``name`` eqn of plan ``p``."""
    ((eqn, d),) = [(e, d) for e, d in zip(p.jaxpr.eqns, p.decisions) if e.primitive.name == name]
    sub = eqn.params[param]
    return eqn, d, sub[0] if isinstance(sub, tuple) else sub


def _while_converging(x, w):
    def cond(c):
        z, z_prev, i = c
        return (jnp.max(jnp.abs(z - z_prev)) > 1e-3) & (i < 100)

    def body(c):
        z, _, i = c
        return jnp.tanh(z @ w), z, i + 1

    return lax.while_loop(cond, body, (x, x * 2, 0))[0]


def test_a_while_loop_tells_its_body_what_decides_its_exit():
    ctx = _ctx()
    x = jnp.ones((64, 64))
    p = planning.plan(ctx, jax.make_jaxpr(_while_converging)(x, x))
    eqn, d, body = _higher_order(p, "while", "body_jaxpr")
    # the exit test reads z and z_prev, z_prev is the last z: the whole carry decides it
    every = frozenset({0, 1, 2})
    assert dict(d.hints) == {
        "cond_jaxpr": BodyHints(decides=frozenset({0}), exits=frozenset({0})),
        "body_jaxpr": BodyHints(decides=every, exits=every, carries=every),
    }
    hints = body_hints(eqn, d, body)
    assert hints == dict(d.hints)["body_jaxpr"]
    (dot,) = _by_prim(planning.plan(ctx, body, hints), "dot_general")
    assert (dot.color, dot.reason.why) == (Color.ORIG, Why.DECIDES_EXIT)
    # the same body planned without its parent's hints would run the matmul low
    (dot,) = _by_prim(planning.plan(ctx, body), "dot_general")
    assert (dot.color, dot.reason.why) == (Color.LOW, Why.POLICY_CLASS)


def test_a_scan_tells_its_body_what_it_carries():
    ctx = _ctx(backend="gpu")  # where allow ops write bfloat16
    h, ws = jnp.ones((64, 64)), jnp.ones((3, 64, 64))
    step = lambda h, w: (h + jnp.tanh(h @ w), None)  # noqa: E731
    p = planning.plan(ctx, jax.make_jaxpr(lambda h, ws: lax.scan(step, h, ws)[0])(h, ws))
    eqn, d, body = _higher_order(p, "scan", "jaxpr")
    assert dict(d.hints) == {"jaxpr": BodyHints(carries=frozenset({0}))}
    planned = planning.plan(ctx, body, body_hints(eqn, d, body))
    (dot,) = _by_prim(planned, "dot_general")
    assert (dot.color, dot.out_dtype, dot.reason.why) == (Color.LOW, F32, Why.LOOP_CARRY)
    (dot,) = _by_prim(planning.plan(ctx, body), "dot_general")
    assert (dot.out_dtype, dot.reason.why) == (BF16, Why.POLICY_CLASS)


def test_a_cond_in_a_loop_body_hands_the_carry_to_its_branches():
    ctx = _ctx(backend="gpu")
    h, ws = jnp.ones((64, 64)), jnp.ones((3, 64, 64))

    def step(h, w):
        return lax.cond(jnp.sum(h) > 0, lambda a: a + a @ w, lambda a: a - 1.0, h), None

    p = planning.plan(ctx, jax.make_jaxpr(lambda h, ws: lax.scan(step, h, ws)[0])(h, ws))
    eqn, d, body = _higher_order(p, "scan", "jaxpr")
    assert dict(d.hints) == {"jaxpr": BodyHints(decides=frozenset({0}), carries=frozenset({0}))}
    body_plan = planning.plan(ctx, body, body_hints(eqn, d, body))
    eqn, d, branch = _higher_order(body_plan, "cond", "branches")
    carry = BodyHints(carries=frozenset({0}))
    assert dict(d.hints) == {"branches[0]": carry, "branches[1]": carry}
    # which branch is which is JAX's business: the one with the matmul keeps it float32
    branch = next(b for b in eqn.params["branches"] if "dot_general" in str(compat.jaxpr_of(b)))
    (dot,) = _by_prim(planning.plan(ctx, branch, body_hints(eqn, d, branch)), "dot_general")
    assert (dot.out_dtype, dot.reason.why) == (F32, Why.LOOP_CARRY)


def test_a_plan_prints_its_decisions_and_hints():
    x = jnp.ones((64, 64))
    text = str(planning.plan(_ctx(), jax.make_jaxpr(_while_converging)(x, x)))
    lines = text.splitlines()
    (line,) = [s for s in lines if s.split()[:2] == ["1", "while"]]
    assert line.split()[:4] == ["1", "while", "nested", "orig"] and "higher_order:" in line
    assert "cond_jaxpr: decides={0} exits={0}" in lines[lines.index(line) + 1]
    assert "body_jaxpr: decides={0, 1, 2} exits={0, 1, 2} carries={0, 1, 2}" in text
    dot = str(planning.plan(_ctx(), jax.make_jaxpr(jnp.dot)(x, x)))
    assert dot.split()[:5] == ["0", "dot_general", "allow", "low", "->"], dot
    assert dot.split()[5:7] == ["float32", "policy_class:"], dot


def test_the_context_is_one_frozen_record_and_linear_shares_the_trace_memo():
    ctx = _ctx()
    same = context.Context(amp_jax.get_policy("bfloat16"), backend_for("cpu"))
    assert ctx == same and {ctx: 1}[same] == 1 and ctx.memo is not same.memo  # memo: not data
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.vjp_rules = False
    linear = ctx.linear
    assert linear == dataclasses.replace(ctx, vjp_rules=False)
    assert linear.memo is ctx.memo and linear.linear is linear
    closed = jax.make_jaxpr(jnp.dot)(jnp.ones((64, 64)), jnp.ones((64, 64)))
    p = planning.plan(ctx, closed)
    assert planning.plan(ctx, closed) is p and planning.plan(linear, closed) is not p  # keyed apart
    assert planning.plan(ctx, closed, BodyHints(carries=frozenset({0}))) is not p
    with pytest.raises(TypeError, match=r"takes a context.Memo, got dict"):
        context.Context(amp_jax.get_policy("bfloat16"), backend_for("cpu"), memo={})
    with pytest.raises(TypeError, match=r"takes a backends.Backend record, got str 'cpu'"):
        context.Context(amp_jax.get_policy("bfloat16"), "cpu")
    # a context that only plans says how to get one that evaluates
    with pytest.raises(TypeError, match=r"evaluator=interpreter.EVALUATOR"):
        ctx.rewrite(p)


def test_a_plan_lists_its_attentions_and_the_trace_log_is_read_from_the_plans():
    q = jnp.ones((2, 16, 4, 8))

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    ctx = _ctx(Policy(jnp.bfloat16, attention="xla"))
    p = planning.plan(ctx, jax.make_jaxpr(attention)(q, q, q))
    ((line, impl, _),) = p.attentions
    assert impl == "xla" and "test_planning.py" in line
    assert f"attention at {line}: xla (" in str(p)
    assert ctx.memo.attention_log == list(p.attentions)
    assert planning.plan(_ctx(Policy(jnp.bfloat16, attention="off")), p.closed).attentions == ()


# -- the plan is a tree: each higher-order eqn's decision holds its bodies' plans ----------


def _scan_of_cond(h, ws):
    def step(h, w):
        return lax.cond(jnp.sum(h) > 0, lambda a: a + jnp.tanh(a @ w), lambda a: a - 1.0, h), None

    return jnp.sum(lax.scan(step, h, ws)[0] ** 2)


_H, _WS = jnp.ones((64, 64)), jnp.ones((3, 64, 64))


def test_format_plan_prints_the_bodies_of_a_scan_and_a_cond():
    p = planning.plan(_ctx(), jax.make_jaxpr(_scan_of_cond)(_H, _WS))
    text = plans.format_plan(p)
    lines = text.splitlines()
    (scan,) = [s for s in lines if s.split()[1:2] == ["scan"]]
    body = lines[lines.index(scan) + 1 :]
    assert body[0].strip() == "jaxpr: decides={0} carries={0}", text
    # the scan body's eqns, indented once; the cond's branches' eqns, twice
    indent = lambda s: len(s) - len(s.lstrip())  # noqa: E731
    (cond,) = [s for s in body if s.split()[1:2] == ["cond"]]
    (dot,) = [s for s in body if s.split()[1:2] == ["dot_general"]]
    assert indent(cond) == indent(scan) + 9 and indent(dot) == indent(scan) + 18, text
    assert dot.split()[2:4] == ["allow", "low"], text
    assert any(s.strip().startswith("branches[0]: carries={0}") for s in body), text


def test_the_plan_trees_scan_body_is_the_plan_of_that_body():
    ctx = _ctx(backend="gpu")
    p = planning.plan(ctx, jax.make_jaxpr(_scan_of_cond)(_H, _WS))
    eqn, d, body = _higher_order(p, "scan", "jaxpr")
    (held,) = [b for b in d.bodies if b.where == "jaxpr"]
    assert held.source is body and held.plan is decision.body_plan(d, body)
    # planned afresh, in a context of its own (no memo shared), it decides the same
    direct = planning.plan(_ctx(backend="gpu"), body, body_hints(eqn, d, body))
    assert plans.format_plan(held.plan) == plans.format_plan(direct)
    assert [dataclasses.replace(x, bodies=()) for x in held.plan.decisions] == [
        dataclasses.replace(x, bodies=()) for x in direct.decisions
    ]
    # and the cond inside holds its branches' plans too
    _, dc, branch = _higher_order(held.plan, "cond", "branches")
    assert decision.body_plan(dc, branch) is not None


def test_custom_derivative_rules_are_the_only_lazy_bodies():
    @jax.custom_vjp
    def f(x, w):
        return jnp.tanh(x @ w)

    f.defvjp(lambda x, w: (f(x, w), (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    p = _plan(lambda x, w: jnp.sum(f(x, w)), _H, _H)
    ((eqn, d),) = [(e, d) for e, d in zip(p.jaxpr.eqns, p.decisions) if d.bodies]
    lazy = {b.where for b in d.bodies if isinstance(b.plan, decision.LazyBody)}
    assert lazy == {"fwd_jaxpr_thunk", "bwd"}, d.bodies
    assert all(isinstance(b.plan, plans.Plan) for b in d.bodies if b.where not in lazy)
    assert "bwd: planned when traced (custom_vjp backward rule" in plans.format_plan(p)


def test_the_diagnostics_read_the_plan_tree_and_never_plan(monkeypatch):
    from amp_jax._src import transform
    from amp_jax._src.diagnostics import reasons

    entry, made, traces = [], [], []
    plan_, inner, trace = transform.plan, planning._plan, transform.AmpFunction._trace
    monkeypatch.setattr(transform, "plan", lambda *a, **k: entry.append(1) or plan_(*a, **k))
    monkeypatch.setattr(planning, "_plan", lambda *a, **k: made.append(1) or inner(*a, **k))
    monkeypatch.setattr(
        transform.AmpFunction, "_trace", lambda self, call: traces.append(1) or trace(self, call)
    )
    text = str(amp_jax.explain(_scan_of_cond, _H, _WS, grad=True))
    assert "dot_general" in text and traces and len(entry) == len(traces)
    entry.clear(), traces.clear()
    report = dtype_report(jax.grad(amp(_scan_of_cond)), _H, _WS)
    assert report and traces and len(entry) == len(traces)
    # reading the reasons of a trace, and printing its plan, plan nothing
    traced = transform.AmpFunction(_scan_of_cond, amp_jax.get_policy("bfloat16"))
    traced = traced.trace_for_inspection(_H, _WS)
    n = len(made)
    assert n > 1  # the top level and its bodies, planned with the trace
    reasons.decisions_of_traces([traced])
    plans.format_plan(traced.plan)
    assert len(made) == n
