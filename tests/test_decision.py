"""The typed record of a plan (``amp_jax._src.decision``): `Decision`, `Reason`,
`Why`, and the named scopes a reason travels in through ``jax.grad``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from amp_jax import full_precision
from amp_jax._src import decision
from amp_jax._src.backends import backend_for
from amp_jax._src.decision import (
    KEPT,
    AttentionPath,
    Color,
    Decision,
    Fused,
    Kind,
    OpClass,
    Reason,
    Variant,
    Why,
)

CPU, GPU = backend_for("cpu"), backend_for("gpu")


def test_kept_reasons_are_the_closed_set_with_their_words():
    assert set(KEPT) <= set(Why)
    for why in Why:
        if why in KEPT:
            r = Reason.kept(why)
            assert r == Reason(why, KEPT[why]) and r.keeps_high and r.text
        else:
            assert not Reason(why, "x").keeps_high
            with pytest.raises(KeyError):
                Reason.kept(why)


def test_a_decision_is_frozen_data_with_defaults():
    d = Decision(Kind.OP, OpClass.ALLOW, Color.LOW, Reason(Why.POLICY_CLASS, "allow"))
    assert (d.out_dtype, d.variant, d.attention, d.fused) == (None, Variant.COMPUTE, None, Fused.NO)
    assert d.lowered
    assert not Decision(Kind.OP, OpClass.ALLOW, Color.HIGH, d.reason).lowered
    assert not Decision(Kind.OP, OpClass.FOLLOW, Color.LOW, d.reason).lowered
    with pytest.raises(AttributeError):
        d.color = Color.HIGH
    assert d == Decision(Kind.OP, OpClass.ALLOW, Color.LOW, Reason(Why.POLICY_CLASS, "allow"))


def test_scopes_carry_kept_reasons_and_attention_paths():
    plain = Decision(Kind.OP, OpClass.ALLOW, Color.LOW, Reason(Why.POLICY_CLASS, "allow"))
    assert decision.scopes(plain) == []  # a lowered op carries no scope
    kept = Decision(Kind.OP, OpClass.ALLOW, Color.ORIG, Reason.kept(Why.TOO_SMALL))
    assert decision.scopes(kept) == ["amp_keep_f32.too_small"]
    fused = AttentionPath("xla", "fused")
    inside = Decision(
        Kind.OP, OpClass.ALLOW, Color.LOW, plain.reason, attention=fused, fused=Fused.INSIDE
    )
    here = Decision(
        Kind.OP, OpClass.ALLOW, Color.LOW, plain.reason, attention=fused, fused=Fused.HERE
    )
    assert decision.scopes(inside) == []  # not bound: the fused attention computes it
    assert decision.scopes(here) == ["amp_attention[xla-fused]"]
    as_written = AttentionPath(None, "a mask it cannot fuse")
    left = Decision(Kind.OP, OpClass.ALLOW, Color.LOW, plain.reason, attention=as_written)
    assert decision.scopes(left) == ["amp_attention[xla: a mask it cannot fuse]"]


@pytest.mark.parametrize("why", sorted(decision.KEPT, key=lambda w: w.value))
def test_a_kept_reason_travels_through_its_scope_and_back(why):
    d = Decision(Kind.OP, OpClass.NEVER, Color.ORIG, Reason.kept(why))
    (scope,) = decision.scopes(d)
    stack = f"transpose(jvp({scope}))"  # as the backward ops of grad carry it
    assert decision.from_stack(stack, CPU) == Reason.kept(why)


def test_attention_paths_travel_through_their_scope_and_back():
    for path in (
        decision.AttentionPath("cudnn", "cuDNN flash attention"),
        decision.AttentionPath("xla", "fused"),
        decision.AttentionPath(None, "head dim 12: cuDNN needs [a multiple of 8]/at most 128"),
    ):
        back = decision.attention_from_stack(f"layer/{decision.attention_scope(path)}/x")
        assert back.impl == path.impl and back.text == path.text


def test_an_attention_reason_cannot_break_its_name_stack():
    # a name stack splits at "/" and the scope ends at the first "]"
    scope = decision.attention_scope(AttentionPath(None, "mask [b, 1]/bias"))
    assert "/" not in scope and scope.count("]") == 1 and scope.endswith("]")


def test_float8_and_full_precision_scopes_are_read_back():
    assert decision.float8_scope("rowwise", backward=True) == "amp_float8.rowwise.backward"
    r = decision.from_stack(f"jvp({decision.float8_scope('rowwise')})", CPU)
    assert r.why is Why.FLOAT8 and "float8 rowwise" in r.text and "emulated on cpu" in r.text
    r = decision.from_stack(decision.float8_scope("tensorwise"), CPU)
    assert "tensorwise" in r.text and "per-tensor" in r.text
    assert decision.from_stack("model/layer_0/dense", CPU) is None
    # a full_precision region: its scope is what amp reads back
    f = full_precision(lambda x: jnp.sin(x))
    eqns = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
    stacks = [str(e.source_info.name_stack) for e in eqns]
    assert any(decision.from_stack(s, CPU) for s in stacks), stacks
    (r,) = {decision.from_stack(s, CPU) for s in stacks} - {None}
    assert r.why is Why.FULL_PRECISION


def test_a_kept_reason_wins_over_the_scopes_around_it():
    stack = f"amp_full_precision/{decision.attention_scope(AttentionPath('cudnn', ''))}"
    stack += "/amp_keep_f32.loop_carry"
    assert decision.from_stack(stack, GPU) == Reason.kept(Why.LOOP_CARRY)
