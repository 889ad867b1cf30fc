"""``Policy(rules=...)``: matmuls by path, in every framework, forward and backward.

Each framework's model has four dense layers ``inp``, ``mid``, ``body`` and
``head``; its rules put ``head`` in float32 and ``mid`` in float16, the rest
runs in the policy's bfloat16. The checks read the rewritten program's
``dot_general`` operands (``jax.make_jaxpr(jax.grad(amp(loss)))``: the
forward products and the backward ones), the optimized HLO for Flax linen,
and ``explain`` / ``dtype_report``, which name the rule.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"  # before keras is imported anywhere

import collections
import re

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import amp_jax
from amp_jax import Policy, UnmatchedRuleWarning, amp
from amp_jax._src.paths import input_paths, matches, path_of
from tests._util import BF16, F16, F32

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (32, 64))
WIDTH = 64


def _dots(closed):
    """``[(operand dtypes, name stack)]`` of every dot_general, nested ones included."""
    out = []

    def walk(jaxpr, outer):
        for e in jaxpr.eqns:
            stack = "/".join(s for s in (outer, str(e.source_info.name_stack)) if s)
            if e.primitive.name == "dot_general":
                out.append((tuple(np.dtype(v.aval.dtype) for v in e.invars), stack))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub.jaxpr if hasattr(sub, "jaxpr") else sub, stack)

    walk(closed.jaxpr, "")
    return out


def _rule(stack):
    m = re.search(r"amp_rule\.(\d+)", stack)
    return None if m is None else int(m.group(1))


def check_dots(closed, expected, n_layers=4):
    """Every dot under rule ``i``'s scope reads ``expected[i]`` operands, every
    other one bfloat16; each rule's layer has its forward and weight-gradient
    products; no dtype appears outside the dots its rule decided."""
    dots = _dots(closed)
    by_rule = collections.defaultdict(list)
    for dtypes, stack in dots:
        by_rule[_rule(stack)].append(dtypes)
    assert set(by_rule) == {None, *expected}, by_rule.keys()
    for index, dtype in expected.items():
        assert len(by_rule[index]) >= 2, (index, by_rule[index])  # forward and backward
        assert all(d == (dtype, dtype) for d in by_rule[index]), (index, by_rule[index])
    assert all(d == (BF16, BF16) for d in by_rule[None]), by_rule[None]
    assert len(by_rule[None]) >= 2 * (n_layers - len(expected))
    counts = collections.Counter(d[0] for d, _ in dots)
    for index, dtype in expected.items():
        assert counts[dtype] == len(by_rule[index])


def check_explain(loss, args, policy, names):
    """``explain`` and ``dtype_report`` name each rule on its dots, forward and backward."""
    rows = [r for r in amp_jax.explain(loss, *args, policy=policy, grad=True).rows]
    dots = [r for r in rows if r.primitive == "dot_general"]
    for text, dtype in names.items():
        mine = [r for r in dots if text in r.reason]
        assert {r.backward for r in mine} == {False, True}, (text, dots)
        assert all(dtype in r.dtype for r in mine), mine
    assert any("rule" not in r.reason and "16" in r.dtype for r in dots)
    report = amp_jax.dtype_report(loss, *args, policy=policy, grad=True)
    for text, dtype in names.items():
        mine = [r for r in report if r[0] == "dot_general" and text in r[5]]
        assert mine and all(dtype in r[1] for r in mine), (text, report)


# -- the frameworks ---------------------------------------------------------------------


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for name in ("inp", "mid", "body"):
            x = nn.gelu(nn.Dense(WIDTH, name=name)(x))
        return nn.Dense(WIDTH, name="head")(x)


def linen_case():
    model = LinenModel()
    variables = model.init(KEY, X)

    def loss(v, x):
        return jnp.mean(model.apply(v, x) ** 2)

    # one rule by parameter path, one by the module's named scope
    return loss, (variables, X), {"params/head": "float32", "*/mid": "float16"}


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(64, WIDTH, rngs=rngs)
        self.mid = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.body = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        for layer in (self.inp, self.mid, self.body):
            x = nnx.gelu(layer(x))
        return self.head(x)


def nnx_case():
    graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)))

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    return loss, (state, X), {"head": "float32", "mid/kernel": "float16"}


def equinox_case():
    model = eqx.nn.MLP(64, WIDTH, WIDTH, 3, activation=jax.nn.gelu, key=KEY)
    arrays, static = eqx.partition(model, eqx.is_array)

    def loss(arrays, x):
        return jnp.mean(jax.vmap(eqx.combine(arrays, static))(x) ** 2)

    return loss, (arrays, X), {"layers/3": "float32", "layers/1/weight": "float16"}


def haiku_case():
    def forward(x):
        for name in ("inp", "mid", "body"):
            x = jax.nn.gelu(hk.Linear(WIDTH, name=name)(x))
        return hk.Linear(WIDTH, name="head")(x)

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(KEY, X)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    return loss, (params, X), {"head/w": "float32", "mid": "float16"}


def keras_case():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(WIDTH, activation="gelu", name=n) for n in ("inp", "mid", "body")]
        + [keras.layers.Dense(WIDTH, name="head")]
    )
    trainable = [v.value for v in model.trainable_variables]

    def loss(trainable, x):
        out, _ = model.stateless_call(trainable, [], x)
        return jnp.mean(out**2)

    return loss, (trainable, X), {"head": "float32", "mid": "float16"}


CASES = {
    "flax_linen": linen_case,
    "flax_nnx": nnx_case,
    "equinox": equinox_case,
    "haiku": haiku_case,
    "keras": keras_case,
}


@pytest.mark.parametrize("name", CASES)
def test_rules_put_each_layer_in_its_dtype_forward_and_backward(name):
    loss, args, rules = CASES[name]()
    policy = Policy("bfloat16", rules=rules)
    closed = jax.make_jaxpr(jax.grad(amp(loss, policy=policy)))(*args)
    check_dots(closed, {0: F32, 1: F16})
    (p32, _), (p16, _) = rules.items()
    check_explain(
        loss, args, policy, {f"rule {p32!r} -> float32": "32", f"rule {p16!r} -> float16": "16"}
    )
    # and the values: the float32 model's gradient, to the dtypes' precision
    got = jax.grad(amp(loss, policy=policy))(*args)
    want = jax.grad(loss)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0.1, atol=0.1 * float(jnp.max(jnp.abs(w))) + 1e-6)


def test_without_rules_every_layer_is_bfloat16():
    """The same check fails without the rules (the test can fail)."""
    loss, args, _ = linen_case()
    closed = jax.make_jaxpr(jax.grad(amp(loss, policy="bfloat16")))(*args)
    with pytest.raises(AssertionError):
        check_dots(closed, {0: F32, 1: F16})


def _hlo_dots(hlo):
    """``[(lhs type, rhs type, op_name)]`` of the optimized HLO's dots."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    out = []
    for m in re.finditer(r"\bdot\(%([\w.\-]+), %([\w.\-]+)\)[^\n]*op_name=\"([^\"]+)\"", hlo):
        out.append((types.get(m.group(1)), types.get(m.group(2)), m.group(3)))
    return out


# (Equinox's: the float32 rule's backward products lose the rule's scope in the HLO's
# op_name under vmap's transpose, so they cannot be told from the others by name; its
# rewritten jaxpr is checked above)
@pytest.mark.parametrize("name", ["flax_linen", "flax_nnx", "haiku", "keras"])
def test_rules_in_the_optimized_hlo(name):
    """The compiled training step: the float32 rule's products read f32, the
    other layers' bf16; the float16 layer's operands are rounded to f16 (XLA:CPU
    has no f16 dot: it converts them back and multiplies in f32, which the
    lowered program, before XLA's CPU passes, shows as f16 dots)."""
    loss, args, rules = CASES[name]()
    policy = Policy("bfloat16", rules=rules)
    lowered = jax.jit(jax.grad(amp(loss, policy=policy))).lower(*args)
    dots = _hlo_dots(lowered.compile().as_text())
    by_rule = collections.defaultdict(set)
    for lhs, rhs, op in dots:
        by_rule[_rule(op)].add((lhs, rhs))
    assert by_rule[0] == {("f32", "f32")}, dots
    assert by_rule[None] == {("bf16", "bf16")}, dots
    assert by_rule[1] and all(t in ("f16", "f32") for pair in by_rule[1] for t in pair)
    text = lowered.as_text(debug_info=True)
    f16_dots = re.findall(
        r"stablehlo\.dot_general[^\n]*tensor<[\dx]+xf16>, tensor<[\dx]+xf16>", text
    )
    assert len(f16_dots) >= 2  # the float16 layer's forward and backward products
    if jax.default_backend() == "cpu":
        assert re.search(r"f16\[[^\n]*amp_rule\.1", lowered.compile().as_text())


# -- float8: the first and last matmul out of it -----------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_float8_except_first_and_last(name):
    loss, args, _ = CASES[name]()
    policy = Policy("float8", float8_min_flops=0, rules=amp_jax.float8_except_first_and_last())
    closed = jax.make_jaxpr(jax.grad(amp(loss, policy=policy)))(*args)
    dots = _dots(closed)
    first = [d for d, s in dots if _rule(s) == 0]
    last = [d for d, s in dots if _rule(s) == 1]
    assert len(first) >= 2 and len(last) >= 3  # forward, and its gradients (the input's: none)
    assert all(d == (BF16, BF16) for d in first + last)
    scoped = {s for _, s in dots if _rule(s) in (0, 1)}
    assert not any("amp_float8" in s for s in scoped)
    # the two middle layers run the fp8 rule (forward and backward), the ends do not
    fp8 = [s for _, s in dots if "amp_float8" in s]
    assert fp8 and all(_rule(s) is None for s in fp8)
    rows = amp_jax.explain(loss, *args, policy=policy, grad=True).rows
    assert any("rule '@first' -> bfloat16" in r.reason for r in rows)
    assert any("rule '@last' -> bfloat16" in r.reason for r in rows)
    # without the rules, every dense layer is fp8
    plain = _dots(jax.make_jaxpr(jax.grad(amp(loss, policy=policy.replace(rules=()))))(*args))
    assert len([s for _, s in plain if "amp_float8" in s]) > len(fp8)


def test_float8_rule_in_a_bfloat16_policy():
    loss, args, _ = linen_case()
    policy = Policy("bfloat16", float8_min_flops=0, rules={"*/body": "float8_rowwise"})
    dots = _dots(jax.make_jaxpr(jax.grad(amp(loss, policy=policy)))(*args))
    fp8 = [s for _, s in dots if "amp_float8" in s]
    assert fp8 and all("amp_float8.rowwise" in s and _rule(s) == 0 for s in fp8)
    rows = amp_jax.explain(loss, *args, policy=policy).rows
    assert any(r.reason.startswith("rule '*/body' -> float8_rowwise: float8 rowwise") for r in rows)


# -- paths through loops, jits and casts ------------------------------------------------------


def test_parameter_paths_through_scan_jit_and_casts():
    """A stacked parameter scanned over, and one read through a jit, a cast and a transpose."""

    @jax.jit
    def project(w, x):
        return x @ w.astype(jnp.float32).T

    def loss(params, x):
        def block(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(block, x, params["blocks"]["w"])
        return jnp.mean(project(params["out"], h) ** 2) + jnp.mean(h @ params["free"])

    params = {
        "blocks": {"w": jnp.ones((3, 64, 64)) * 0.01},
        "out": jnp.ones((64, 64)),
        "free": jnp.ones((64, 64)),
    }
    policy = Policy("bfloat16", rules=[("blocks/w", "float16"), ("out", "float32")])
    closed = jax.make_jaxpr(jax.grad(amp(loss, policy=policy)))(params, X)
    check_dots(closed, {0: F16, 1: F32}, n_layers=3)
    assert any("scan" in str(e.primitive) for e in closed.jaxpr.eqns)


def test_named_scope_rules():
    def loss(w, x):
        with jax.named_scope("encoder"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("decoder"):
            with jax.named_scope("proj"):
                return jnp.mean((h @ w) ** 2)

    w = jnp.ones((64, 64)) * 0.01
    for pattern in ("decoder/proj", "decoder", "re:proj$", "*/proj"):
        policy = Policy("bfloat16", rules={pattern: "float32"})
        dots = _dots(jax.make_jaxpr(amp(loss, policy=policy))(w, X))
        assert sorted((d[0].name, _rule(s)) for d, s in dots) == [
            ("bfloat16", None),
            ("float32", 0),
        ], pattern


def test_first_matching_rule_wins():
    def loss(w, x):
        with jax.named_scope("head"):
            return jnp.mean((jnp.tanh(x @ w) @ w) ** 2)

    w = jnp.ones((64, 64)) * 0.01
    policy = Policy("bfloat16", rules=[("head", "float16"), ("w", "float32")])
    with pytest.warns(UnmatchedRuleWarning, match="'w'"):  # (it decides nothing: shadowed)
        dots = _dots(jax.make_jaxpr(amp(loss, policy=policy))(w, X))
    assert {d for d, _ in dots} == {(F16, F16)} and {_rule(s) for _, s in dots} == {0}
    policy = Policy("bfloat16", rules=[("w", "float32"), ("head", "float16")])
    with pytest.warns(UnmatchedRuleWarning, match="'head'"):
        dots = _dots(jax.make_jaxpr(amp(loss, policy=policy))(w, X))
    assert {d for d, _ in dots} == {(F32, F32)}


# -- reporting a rule that matches nothing, bad input -------------------------------------------


def test_unmatched_rule_warns_with_pattern_and_paths():
    loss, args, _ = linen_case()
    policy = Policy("bfloat16", rules={"params/haed": "float32", "*/mid": "float16"})
    with pytest.warns(UnmatchedRuleWarning, match=r"'params/haed'.*'params/head/kernel'"):
        jax.grad(amp(loss, policy=policy))(*args)
    with pytest.raises(ValueError, match=r"'params/haed'.*matched no matmul"):
        jax.grad(amp(loss, policy=policy.replace(strict=True)))(*args)


@pytest.mark.parametrize(
    "rules, match",
    [
        ({"head": "int8"}, r"rules\['head'\]='int8'.*'float32', 'bfloat16', 'float16', 'float8'"),
        ({3: "float32"}, r"rules: pattern 3 must be a non-empty str"),
        ({"re:(": "float32"}, r"not a regular expression"),
        ({"@middle": "float32"}, r"'@first' and '@last'"),
        ("head", r"rules='head' must map path patterns"),
        ([("head",)], r"must map path patterns to targets"),
    ],
)
def test_bad_rules_raise_naming_rules_and_the_targets(rules, match):
    with pytest.raises(ValueError, match=match):
        Policy("bfloat16", rules=rules)


def test_rules_need_a_low_precision_policy():
    with pytest.raises(ValueError, match="rules=.*needs a low-precision compute_dtype"):
        Policy("float32", rules={"head": "float16"})


def test_rules_are_part_of_the_policy_key_and_repr():
    a = Policy("bfloat16", rules={"head": "float32", "mid": "fp16"})
    b = Policy("bfloat16", rules=[("head", "float32"), ("mid", "float16")])
    c = Policy("bfloat16", rules=[("mid", "float16"), ("head", "float32")])  # order matters
    assert a == b and hash(a) == hash(b) and a != c
    assert a.rules == (("head", "float32"), ("mid", "float16"))
    assert "rules=(('head', 'float32'), ('mid', 'float16'))" in repr(a)
    assert "rules" not in repr(Policy("bfloat16"))

    def f(w, x):
        return jnp.mean(x @ w)

    w = jnp.ones((64, 64))
    first = jax.make_jaxpr(amp(f, policy=Policy("bfloat16")))(w, X)
    ruled = jax.make_jaxpr(amp(f, policy=Policy("bfloat16", rules={"w": "float16"})))(w, X)
    assert {d for d, _ in _dots(first)} == {(BF16, BF16)}
    assert {d for d, _ in _dots(ruled)} == {(F16, F16)}


def test_path_format():
    tree = {"params": {"Dense_0": {"kernel": 1}}, "layers": [{"w": 2}]}
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert sorted(path_of(k) for k, _ in flat) == ["layers/0/w", "params/Dense_0/kernel"]
    # an argument that is an array is named by its parameter
    assert input_paths((jnp.ones(2), tree), {}, ("w", "p"), (True, True, True)) == (
        "w",
        "layers/0/w",
        "params/Dense_0/kernel",
    )
    assert matches("params/Dense_0", "params/Dense_0/kernel")
    assert matches("*/kernel", "params/Dense_0/kernel")
    assert not matches("Dense_0", "params/Dense_0/kernel")
    assert matches("re:Dense_\\d", "params/Dense_0/kernel")
    # NNX state: a variable's trailing ``value`` is left out
    state = nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))[1]
    keys = jax.tree_util.tree_flatten_with_path(state)[0]
    assert sorted(path_of(k) for k, _ in keys) == ["bias", "kernel"]


def test_float32_embeddings_head_routers_preset():
    ((pattern, target),) = amp_jax.float32_embeddings_head_routers()
    assert target == "float32"
    for path in ("params/lm_head/kernel", "embed/embedding", "layers/3/moe/router/w", "head/w"):
        assert matches(pattern, path), path
    for path in ("layers/0/mlp/gate_proj/kernel", "blocks/attn/multihead/w", "params/Dense_0"):
        assert not matches(pattern, path), path
