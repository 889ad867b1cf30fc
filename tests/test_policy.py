import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import amp_jax
from amp_jax import Policy, amp, get_policy
from amp_jax._src.backends import backend_for
from amp_jax._src.classify import effective_class


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("bfloat16", jnp.bfloat16),
        ("float16", jnp.float16),
        ("float32", jnp.float32),
        ("bf16", jnp.bfloat16),
    ],
)
def test_presets(name, dtype):
    assert get_policy(name).compute_dtype == np.dtype(dtype)


def test_policy_is_frozen_and_hashable():
    p = Policy(jnp.bfloat16)
    assert hash(p) == hash(Policy("bfloat16"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = jnp.float16  # type: ignore[misc]


def test_bad_policy_string_lists_choices():
    with pytest.raises(ValueError, match="'bfloat16'.*'float16'.*'float32'"):
        amp(lambda x: x, policy="bf17")


@pytest.mark.parametrize("bad", [jnp.int32, jnp.float64, jnp.complex64, bool])
def test_non_float_compute_dtype_rejected(bad):
    with pytest.raises(ValueError, match="compute_dtype|policy"):
        amp(lambda x: x, policy=bad)


def test_non_callable_fn_rejected():
    with pytest.raises(TypeError, match="callable"):
        amp(3)


def test_overrides_and_table():
    p = Policy(jnp.float16, overrides={"tanh": "deny"})
    assert p.class_of("tanh") == "deny"
    assert p.class_of("dot_general") == "allow"
    assert ("tanh", "deny") in p.table()
    with pytest.raises(ValueError, match="op class"):
        Policy(overrides={"tanh": "sometimes"})
    with pytest.raises(TypeError, match="tuple"):
        Policy(allow="dot_general")


def test_classification_is_public_data():
    assert "dot_general" in amp_jax.DEFAULT_ALLOW
    assert "exp" in amp_jax.DEFAULT_DENY and "reduce_sum" in amp_jax.DEFAULT_DENY
    assert "convert_element_type" in amp_jax.DEFAULT_NEVER
    classes = [
        amp_jax.DEFAULT_ALLOW,
        amp_jax.DEFAULT_DENY,
        amp_jax.DEFAULT_FOLLOW,
        amp_jax.DEFAULT_CLEAR,
        amp_jax.DEFAULT_NEVER,
    ]
    for i, a in enumerate(classes):
        for b in classes[i + 1 :]:
            assert not (a & b), a & b


def test_backend_aware_conv_on_cpu():
    p = Policy()
    cpu, gpu = backend_for("cpu"), backend_for("gpu")
    assert effective_class(p, "conv_general_dilated", cpu) == "never"
    assert effective_class(p, "conv_general_dilated", gpu) == "allow"
    assert effective_class(Policy(backend_aware=False), "conv_general_dilated", cpu) == "allow"


def test_overlapping_lists_rejected_and_table_agrees_with_class_of():
    from amp_jax import DEFAULT_DENY

    with pytest.raises(
        ValueError, match=r"both `allow` and `deny`.*overrides=\{'dot_general': 'deny'\}"
    ):
        Policy(jnp.bfloat16, deny=DEFAULT_DENY | {"dot_general"})
    p = Policy(jnp.bfloat16, overrides={"dot_general": "deny", "my_prim": "follow"})
    assert dict(p.table()) == {n: p.class_of(n) for n, _ in p.table()}
    assert dict(p.table())["dot_general"] == "deny" and dict(p.table())["my_prim"] == "follow"


# -- policy names from jmp and Keras mean the preset they name ------------------------------


@pytest.mark.parametrize(
    "name, preset",
    [
        ("p=f32,c=bf16,o=f32", "bfloat16"),
        ("params=float32,compute=float16,output=float32", "float16"),
        ("p=f32, c=f16", "float16"),
        ("c=bf16", "bfloat16"),
        ("mixed_bfloat16", "bfloat16"),
        ("mixed_float16", "float16"),
        ("Mixed_Float16", "float16"),
    ],
)
def test_jmp_and_keras_policy_names_are_their_presets(name, preset):
    assert get_policy(name) == get_policy(preset)


@pytest.mark.parametrize(
    "name, match",
    [
        ("p=bf16,c=bf16,o=bf16", r"amp leaves parameters in the dtype.*policy='bfloat16'"),
        ("p=f32,c=bf16,o=bf16", r"Cast the output yourself.*policy='bfloat16'"),
        ("p=f32,q=bf16", r"unknown key 'q'.*p=/c=/o="),
        ("p=f32,c=int8", r"'int8' is not a dtype amp computes in"),
    ],
)
def test_jmp_policy_without_an_equivalent_says_what_to_write(name, match):
    with pytest.raises(ValueError, match=match):
        get_policy(name)


def test_policy_repr_shows_what_differs_from_the_defaults():
    assert repr(Policy()) == "Policy(compute_dtype=bfloat16)"
    assert repr(get_policy("float8")) == "Policy(compute_dtype=bfloat16, float8='tensorwise')"
    p = Policy(jnp.float16, allow=(*Policy().allow, "my_mm"), deny=Policy().deny - {"exp"})
    assert repr(p) == (
        "Policy(compute_dtype=float16, allow=DEFAULT_ALLOW | {'my_mm'}, "
        "deny=DEFAULT_DENY - {'exp'})"
    )


@pytest.mark.parametrize(
    "name",
    [
        "bfloat16",
        "bf16",
        "float16",
        "half",
        "float32",
        "float8",
        "fp8_rowwise",
        "mixed_bfloat16",
        "mixed_float16",
        "p=f32,c=bf16,o=f32",
        "params=float32,compute=float16,output=float32",
    ],
)
def test_policy_takes_every_name_amp_takes(name):
    # Policy(name) is the policy amp(f, policy=name) runs under
    assert amp_jax.Policy(name) == amp_jax.get_policy(name)
    assert amp_jax.amp(lambda x: x, policy=name).policy == amp_jax.Policy(name)


def test_an_unknown_policy_name_lists_the_keras_and_jmp_forms():
    with pytest.raises(ValueError, match="mixed_bfloat16.*p=f32,c=bf16,o=f32") as e:
        amp_jax.Policy("mixed_bf16")
    assert "Policy(compute_dtype)='mixed_bf16'" in str(e.value)
    with pytest.raises(ValueError, match="policy='mixed_bf16' is not a known policy"):
        amp_jax.get_policy("mixed_bf16")


def test_scope_in_matches_whole_names_once_per_stack_and_scopes():
    # planning asks every eqn's name stack: the answer is cached by the stack
    # and the scopes, so another policy's scopes get their own answer
    from amp_jax._src.policy import scope_in

    scope_in.cache_clear()
    stack = "transpose(jvp(model/head))/amp_full_precision/softmax"
    for _ in range(3):
        assert scope_in(stack, ("amp_full_precision",)) == "amp_full_precision"
    assert scope_in.cache_info().hits == 2 and scope_in.cache_info().misses == 1
    assert scope_in(stack, ("head",)) == "head"
    assert scope_in(stack, ("model/head",)) == "model/head"
    assert scope_in(stack, ("ead",)) is None  # a whole name, not a substring
    assert scope_in("multihead_attention", ("head",)) is None
    assert scope_in.cache_info().misses == 5
