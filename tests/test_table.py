"""The rule table of the core: which rule binds each eqn, what it reads low,
the one casting rule, and the public ``register_rule``."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import amp_jax
from amp_jax._src import compat, context, planning
from amp_jax._src.backends import backend_for
from amp_jax._src.decision import Color, OpClass, Variant
from amp_jax._src.painting import LOW, ORIG
from amp_jax._src.rules import base, table

ALLOW, FOLLOW = OpClass.ALLOW, OpClass.FOLLOW


def _eqns(fn, *args):
    return compat.jaxpr_of(jax.make_jaxpr(fn)(*args)).eqns


def _rule_name(eqn, cls=FOLLOW):
    return type(table.rule_for(eqn, cls)).__name__


def test_every_eqn_is_bound_through_the_rule_of_its_primitive():
    x = jnp.ones((4, 8))
    w = jnp.ones((8, 8))

    def fn(x, w):
        y = x @ w  # dot_general
        y = y + jnp.ones((1, 8))  # broadcasting add
        y = jax.nn.relu(y)  # custom_jvp_call
        y = jnp.tanh(y)  # plain
        c, _ = lax.scan(lambda c, _: (c * 2.0, None), y, None, length=2)  # scan
        return lax.cond(c.sum() > 0, lambda a: a, lambda a: -a, c)  # cond

    names = {e.primitive.name: _rule_name(e) for e in _eqns(fn, x, w)}
    assert names["dot_general"] == "DotRule"  # float8 is one of its variants
    assert Variant.FLOAT8 in table.rule_for(_eqns(fn, x, w)[0], ALLOW).variants
    assert names["add"] == "BroadcastRule"
    assert names["custom_jvp_call"] == "CustomJvpRule"
    assert names["tanh"] == "EqnRule"
    assert names["scan"] == "ScanRule"
    assert names["cond"] == "HigherOrderRule"  # the generic rule of higher-order primitives
    conv = _eqns(
        lambda a, k: lax.conv(a, k, (1, 1), "SAME"), jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))
    )
    assert [_rule_name(e, ALLOW) for e in conv] == ["AllowRule"]


def test_an_unknown_primitive_in_the_allow_class_gets_the_default_allow_rule():
    (eqn,) = _eqns(jnp.tanh, jnp.ones(3))
    assert type(table.rule_for(eqn, ALLOW)) is base.AllowRule
    assert type(table.rule_for(eqn, FOLLOW)) is base.EqnRule


def _ctx(backend="cpu", policy="bfloat16"):
    return context.Context(amp_jax.get_policy(policy), backend_for(backend))


def _decisions(ctx, fn, *args):
    """The plan's decisions for ``fn``'s eqns under ``ctx``."""
    return planning.plan(ctx, jax.make_jaxpr(fn)(*args)).decisions


def test_rules_say_which_operands_they_read_low():
    ctx = _ctx()
    args = (jnp.ones((2, 32, 64)), jnp.ones((2, 64, 32)))
    batched = _eqns(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), *args)
    (i,) = [i for i, e in enumerate(batched) if e.primitive.name == "dot_general"]
    bdot = batched[i]
    rule = table.rule_for(bdot, ALLOW)
    # XLA:CPU has no batched bf16 dot: the plan runs it in float32 there, with the reason
    cpu = _decisions(ctx, lambda a, b: jnp.einsum("bij,bjk->bik", a, b), *args)[i]
    gpu = _decisions(_ctx("gpu"), lambda a, b: jnp.einsum("bij,bjk->bik", a, b), *args)[i]
    assert (cpu.color, cpu.variant, cpu.reason.why.value) == (
        LOW,
        Variant.FLOAT32,
        "backend_kernel",
    )
    assert not rule.reads_low(ctx, bdot, cpu, bdot.invars[0])
    assert (gpu.color, gpu.variant) == (LOW, Variant.COMPUTE)
    assert rule.reads_low(ctx, bdot, gpu, bdot.invars[0])
    assert not rule.reads_low(ctx, bdot, dataclasses.replace(gpu, color=ORIG), bdot.invars[0])

    bf16 = jnp.bfloat16
    (add,) = _eqns(lambda a, b: a + b, jnp.ones((4, 8), bf16), jnp.ones((1, 8), bf16))
    low = dataclasses.replace(gpu, op_class=FOLLOW, variant=Variant.COMPUTE)
    brule = table.rule_for(add, FOLLOW)
    assert brule.reads_low(ctx, add, low, add.invars[0])  # same shape as the output
    assert not brule.reads_low(ctx, add, low, add.invars[1])  # broadcast first
    # a float32 operand makes a low elementwise op compute in float32 (widest input)
    (add32,) = _eqns(lambda a, b: a + b, jnp.ones((4, 8)), jnp.ones((4, 8)))
    assert not brule.reads_low(ctx, add32, low, add32.invars[0])

    cond = [e for e in _eqns(lambda p, a: lax.cond(p, jnp.sin, jnp.cos, a), True, jnp.ones(3))]
    (c,) = [e for e in cond if e.primitive.name == "cond"]
    orig = dataclasses.replace(low, color=Color.ORIG)
    assert not table.rule_for(c, None).reads_low(ctx, c, orig, c.invars[1])


def test_register_rule_binds_a_new_allow_primitive(monkeypatch):
    calls = []

    def tanh_rule(eqn, invals, compute_dtype, out_dtype):
        calls.append((np.dtype(invals[0].dtype), np.dtype(compute_dtype), np.dtype(out_dtype)))
        (x,) = invals
        return [jnp.tanh(x.astype(compute_dtype)).astype(out_dtype)]

    monkeypatch.delitem(table.TABLE, "tanh", raising=False)  # restored after the test
    amp_jax.register_rule("tanh", tanh_rule)
    pol = amp_jax.Policy(overrides={"tanh": "allow"})
    x = jnp.linspace(-2, 2, 16)
    out = amp_jax.amp(jnp.tanh, policy=pol)(x)
    assert calls and calls[0][:2] == (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
    expected = jnp.tanh(x.astype(jnp.bfloat16)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    # in the default policy tanh is not allow: the rule is not used
    calls.clear()
    amp_jax.amp(jnp.tanh)(x)
    assert not calls


def test_register_rule_refuses_structural_primitives_and_bad_arguments():
    with pytest.raises(ValueError, match="'scan'.*structural rule"):
        amp_jax.register_rule("scan", lambda *a: None)
    with pytest.raises(TypeError, match="primitive_name must be a str"):
        amp_jax.register_rule(lax.tanh_p, lambda *a: None)
    with pytest.raises(TypeError, match="rule must be a function"):
        amp_jax.register_rule("tanh", 3)


def test_backend_comes_from_the_context_not_the_process():
    """The plan's batched-dot fallback and the dot rule's CPU layouts follow ctx.backend."""
    a, b = jnp.ones((2, 16, 32)), jnp.ones((2, 32, 16))
    (eqn,) = _eqns(lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), a, b)

    def dtypes_of(backend):
        ctx = _ctx(backend)
        (d,) = _decisions(
            ctx, lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), a, b
        )

        def fn(a, b):  # a reader of the operands, as the interpreter's CastingEnv
            env = types.SimpleNamespace(read=lambda v, _: (a, b)[eqn.invars.index(v)], layouts={})
            return table.TABLE["dot_general"].evaluate(ctx, eqn, d, env)

        return str(jax.make_jaxpr(fn)(a, b))  # (with the custom_vjp's inner jaxpr)

    assert "bf16" not in dtypes_of("cpu")  # batched bf16 dot: float32 on XLA:CPU
    assert "bf16[2,16,32]" in dtypes_of("gpu")
