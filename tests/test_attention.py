"""Attention written out is recognised and run fused (amp_jax/_src/attention/).

On CPU there is no cuDNN: ``Policy(attention="xla")`` forces the rewrite with
JAX's XLA implementation, which checks the recognition, the layouts, masks,
scales and gradients. The cuDNN tests run where a GPU is the default backend
(``python tools/accelerator_suite.py``).
"""

import functools
import math
import re

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, eqns

from amp_jax import Policy, amp, full_precision
from amp_jax._src import decision

B, T, N, H = 2, 16, 4, 8
KQ, KK, KV, KX = jax.random.split(jax.random.PRNGKey(0), 4)
Q = jax.random.normal(KQ, (B, T, N, H))
K = jax.random.normal(KK, (B, T, N, H))
V = jax.random.normal(KV, (B, T, N, H))
CAUSAL = jnp.tril(jnp.ones((T, T), bool))
XLA = Policy(jnp.bfloat16, attention="xla")
GPU = jax.default_backend() == "gpu"


def einsum_attention(q, k, v, *, mask=None, fill=-1e9, scale="div", layout="bthd"):
    if layout == "bhtd":  # heads before positions
        q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    else:
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = s / math.sqrt(H) if scale == "div" else s * (1 / math.sqrt(H)) if scale == "mul" else s
    if mask is not None:
        s = jnp.where(mask, s, fill)
    p = jax.nn.softmax(s, axis=-1)
    if layout == "bhtd":
        return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", p, v), 1, 2)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _log(fn):
    (traced,) = fn._cache.values()
    return traced.ctx.memo.attention_log


def _fused(jaxpr):
    """Whether the rewritten program has the softmax of dot_product_attention on bf16 q/k.

    The XLA implementation of jax.nn.dot_product_attention computes its scores
    with a bf16 x bf16 dot_general on 5-D (grouped) operands; a hand-written
    attention in float32 has 4-D float32 ones.
    """
    dots = [e for e, _ in eqns(jaxpr) if e.primitive.name == "dot_general"]
    return any(e.invars[0].aval.ndim == 5 and e.invars[0].aval.dtype == BF16 for e in dots)


def _check_close(fn, ref, *args, atol_rel=3e-2):
    out, want = fn(*args), ref(*args)
    assert out.dtype == want.dtype and out.shape == want.shape
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(out, want, rtol=0, atol=atol_rel * scale)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    grads = jax.grad(loss(fn), argnums=(0, 1, 2))(*args)
    wants = jax.grad(loss(ref), argnums=(0, 1, 2))(*args)
    for g, w in zip(grads, wants):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=0, atol=2 * atol_rel * float(jnp.max(jnp.abs(w))))


CASES = {
    "causal-const-div": functools.partial(einsum_attention, mask=CAUSAL),
    "causal-inf-mul": functools.partial(einsum_attention, mask=CAUSAL, fill=-jnp.inf, scale="mul"),
    "no-mask-no-scale": functools.partial(einsum_attention, scale=None),
    "heads-first": functools.partial(einsum_attention, mask=CAUSAL, layout="bhtd"),
    "finfo-min-fill": functools.partial(
        einsum_attention, mask=CAUSAL, fill=jnp.finfo(jnp.float32).min
    ),
    "jax.nn causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "jax.nn plain": lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
    "hand-cast bf16": lambda q, k, v: _hand_cast_bf16(q, k, v),
}


def _hand_cast_bf16(q, k, v):
    """bf16 attention as Flax and hand-written code write it: the scores cast to
    float32 for the softmax, the probabilities cast back to bf16 for P.V."""
    q, k, v = (a.astype(BF16) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(H)
    p = jax.nn.softmax(jnp.where(CAUSAL, s, -1e9), axis=-1).astype(BF16)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(jnp.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_recognised_and_close_to_float32(name):
    fn = CASES[name]
    a = amp(fn, policy=XLA)
    _check_close(a, fn, Q, K, V)
    (log,) = _log(a)
    assert log[1] == "xla", log
    assert _fused(jax.make_jaxpr(a)(Q, K, V))
    assert not _fused(jax.make_jaxpr(fn)(Q, K, V))


# -- additive bias, grouped-query attention ---------------------------------------------

HKV = 2  # kv heads of the grouped cases (N query heads)
BIAS = jax.random.normal(jax.random.PRNGKey(7), (1, N, T, T))
PAD = jnp.arange(T)[None, :] < jnp.array([[T], [T // 2]])  # [B, Tk] valid keys
K2, V2 = K[:, :, :HKV], V[:, :, :HKV]


def _scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(H)


def _out(s, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _grouped(q, k, v, bias=None):
    """GQA as jax.nn's XLA path writes it: q as [B, T, Hkv, G, D], a grouped einsum."""
    qg = q.reshape(B, T, HKV, N // HKV, H)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k) / math.sqrt(H)
    s = jnp.where(CAUSAL, s if bias is None else s + bias, -1e9)
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(B, T, N, H)


def _repeated(q, k, v):
    """GQA with the kv heads repeated (jnp.repeat along the heads)."""
    k, v = (jnp.repeat(a, N // HKV, axis=2) for a in (k, v))
    return einsum_attention(q, k, v, mask=CAUSAL)


def _repeat_kv_heads_first(q, k, v):
    """GQA as ports of PyTorch code write it: [B, H, T, D], kv heads expanded."""
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    k, v = (
        jnp.broadcast_to(a[:, :, None], (B, HKV, N // HKV, T, H)).reshape(B, N, T, H)
        for a in (k, v)
    )
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(H)
    return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v), 1, 2)


def _mqa(q, k, v):
    """Multi-query attention: one kv head, written without a heads dim."""
    s = jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / math.sqrt(H)
    return jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, axis=-1), v[:, :, 0])


# name: (fn, args, Match.kind)
BIAS_GQA = {
    "bias [1,N,T,S]": (lambda q, k, v, b: _out(_scores(q, k) + b, v), (Q, K, V, BIAS), "bias"),
    "bias [N,T,S] before the scale": (
        lambda q, k, v, b: _out((jnp.einsum("bqhd,bkhd->bhqk", q, k) + b[0]) * 0.3, v),
        (Q, K, V, BIAS),
        "bias",
    ),
    "bias + causal mask": (
        lambda q, k, v, b: _out(jnp.where(CAUSAL, _scores(q, k) + b, -1e9), v),
        (Q, K, V, BIAS),
        "causal+bias",
    ),
    "jax.nn bias": (
        lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
        (Q, K, V, BIAS),
        "bias",
    ),
    "padding mask as a -1e9 bias": (
        lambda q, k, v, pad: _out(_scores(q, k) + jnp.where(pad[:, None, None, :], 0.0, -1e9), v),
        (Q, K, V, PAD),
        "mask",
    ),
    "causal mask as a -inf bias": (
        lambda q, k, v: _out(_scores(q, k) + jnp.where(CAUSAL, 0.0, -jnp.inf), v),
        (Q, K, V),
        "causal",
    ),
    "gqa jnp.repeat": (_repeated, (Q, K2, V2), "causal+gqa"),
    "gqa heads-first broadcast_to": (_repeat_kv_heads_first, (Q, K2, V2), "gqa"),
    "gqa grouped einsum": (_grouped, (Q, K2, V2), "causal+gqa"),
    "gqa grouped einsum + per-kv-head bias": (
        lambda q, k, v, b: _grouped(q, k, v, b[:, :HKV, None]),
        (Q, K2, V2, BIAS),
        "causal+bias+gqa",
    ),
    "gqa jax.nn": (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        (Q, K2, V2),
        "causal+gqa",
    ),
    "mqa einsum": (_mqa, (Q, K2, V2), "gqa"),
}


WITH_GRADS = ("bias [1,N,T,S]", "padding mask as a -1e9 bias", "gqa jnp.repeat", "mqa einsum")


def _match_of(fn, *args):
    from amp_jax._src import attention, compat
    from amp_jax._src.context import inline_jits

    closed = inline_jits(jax.make_jaxpr(fn)(*args))
    jaxpr = compat.jaxpr_of(closed)
    (m,) = attention.find(jaxpr, dict(zip(jaxpr.constvars, compat.consts_of(closed)))).values()
    return m


@pytest.mark.parametrize("name", list(BIAS_GQA))
def test_bias_and_grouped_heads_recognised_and_close_to_float32(name):
    fn, args, kind = BIAS_GQA[name]
    assert _match_of(fn, *args).kind == kind
    a = amp(fn, policy=XLA)
    jaxpr = jax.make_jaxpr(a)(*args)
    assert [impl for _, impl, _ in _log(a)] == ["xla"], _log(a)
    assert _fused(jaxpr) and not _fused(jax.make_jaxpr(fn)(*args))
    dots = [e for e, _ in eqns(jaxpr) if e.primitive.name == "dot_general"]
    if "gqa" in kind:  # the kv heads are not repeated: q.k reads k with its HKV heads
        k_heads = {e.invars[1].aval.shape for e in dots if e.invars[0].aval.ndim == 5}
        assert k_heads == {(B, T, 1 if name.startswith("mqa") else HKV, H)}, k_heads
        assert not any(
            e.primitive.name == "broadcast_in_dim"
            and e.outvars[0].aval.shape[2:4] == (HKV, N // HKV)
            for e, _ in eqns(jaxpr)
        )
    # values and gradients (also of the bias) within the bf16 floor
    out, want = jax.jit(a)(*args), fn(*args)
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-2 * float(jnp.max(jnp.abs(want))))
    if name not in WITH_GRADS:  # (compiling every gradient would double the test's time)
        return
    argnums = tuple(i for i, x in enumerate(args) if x.dtype == jnp.float32)
    loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))  # noqa: E731
    grads = jax.jit(jax.grad(loss(a), argnums))(*args)
    wants = jax.grad(loss(fn), argnums)(*args)
    for g, w in zip(grads, wants):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=6e-2 * float(jnp.max(jnp.abs(w))))


def test_constant_causal_mask_becomes_is_causal_and_a_padding_mask_is_passed():
    from amp_jax._src import attention, compat
    from amp_jax._src.context import inline_jits

    pad = jnp.arange(T)[None, :] < jnp.array([[T], [T // 2]])  # [B, Tk] valid keys

    def padded(q, k, v, pad):
        return einsum_attention(q, k, v, mask=pad[:, None, None, :])

    for fn, args, causal in [
        (CASES["causal-const-div"], (Q, K, V), True),
        (padded, (Q, K, V, pad), False),
    ]:
        closed = inline_jits(jax.make_jaxpr(fn)(*args))
        jaxpr = compat.jaxpr_of(closed)
        (m,) = attention.find(jaxpr, dict(zip(jaxpr.constvars, compat.consts_of(closed)))).values()
        assert m.causal_const is causal and m.pred is not None
        assert math.isclose(m.scale, 1 / math.sqrt(H), rel_tol=1e-6)
    a = amp(padded, policy=XLA)
    out = a(Q, K, V, pad)
    np.testing.assert_allclose(out, padded(Q, K, V, pad), atol=3e-2 * float(jnp.max(jnp.abs(out))))
    assert _log(a)[0][1] == "xla"


def _near_misses():
    def no_softmax(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.tanh(s), v)

    def softmax_wrong_axis(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-2), v)

    def mask_from_values(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(s > 0, s, -1e9)  # depends on the scores
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    def mask_from_inputs(q, k, v):
        mask = (q[:, :, 0, 0] > 0)[:, None, :, None]  # computed from q's values
        return einsum_attention(q, k, v, mask=mask)

    def dropout_between(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(s, axis=-1)
        keep = jax.random.bernoulli(jax.random.PRNGKey(3), 0.9, p.shape)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / 0.9, 0.0), v)

    def probs_also_returned(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v) + jnp.sum(p)

    def small_fill(q, k, v):
        return einsum_attention(q, k, v, mask=CAUSAL, fill=-10.0)

    return {
        f.__name__: f
        for f in (
            no_softmax,
            softmax_wrong_axis,
            mask_from_values,
            mask_from_inputs,
            dropout_between,
            probs_also_returned,
            small_fill,
        )
    }


NEAR_MISS_REASONS = {
    "no_softmax": None,  # not attention at all: nothing logged
    "softmax_wrong_axis": "softmax not over the key axis",
    "mask_from_values": "scores are also used outside",
    "mask_from_inputs": "mask computed from the values",
    "dropout_between": "dropout on the probabilities",
    "probs_also_returned": "probabilities are also used outside",
    "small_fill": "soft mask",
}


def _is_dot(e):
    """A dot_general, or a call whose body is one dot_general (amp's lowered dot)."""
    if e.primitive.name == "dot_general":
        return True
    subs = [s for s in jex_core.jaxprs_in_params(e.params)]
    inner = [x.primitive.name for s in subs for x in getattr(s, "jaxpr", s).eqns]
    return "dot_general" in inner and e.primitive.name.startswith("custom_")


@pytest.mark.parametrize("name", list(_near_misses()))
def test_near_misses_are_left_alone_with_a_reason(name):
    fn = _near_misses()[name]
    a = amp(fn, policy=XLA)
    jaxpr = jax.make_jaxpr(a)(Q, K, V)
    assert not _fused(jaxpr)
    want = NEAR_MISS_REASONS[name]
    if want is None:
        assert not _log(a)
        assert not any("amp_attention" in str(e.source_info.name_stack) for e, _ in eqns(jaxpr))
    else:
        ((_, impl, why),) = _log(a)
        assert impl is None and want in why, why
        # the ops as written carry the reason in their name stack (dtype_report's "why")
        # (a lowered dot is a custom_vjp around its dot_general where it runs low,
        # e.g. on a GPU; the scope is on the call)
        scoped = [
            "dot_general" if _is_dot(e) else e.primitive.name
            for e, _ in eqns(jaxpr)
            if f"amp_attention[xla: {why}]" in str(e.source_info.name_stack)
        ]
        assert "exp" in scoped and "dot_general" in scoped, scoped
    np.testing.assert_allclose(
        a(Q, K, V), fn(Q, K, V), atol=5e-2 * float(jnp.max(jnp.abs(fn(Q, K, V))))
    )


@pytest.mark.parametrize(
    "policy, reason",
    [
        (Policy(jnp.bfloat16, attention="off"), "off"),
        (Policy(jnp.float16, attention="auto"), None),
    ],
)
def test_off_and_auto_without_a_gpu_leave_it_as_written(policy, reason):
    fn = CASES["causal-const-div"]
    a = amp(fn, policy=policy)
    jaxpr = jax.make_jaxpr(a)(Q, K, V)
    if GPU and reason is None:
        pytest.skip("auto fuses on GPU")
    assert not _fused(jaxpr)
    if reason == "off":  # not even looked for
        assert _log(a) == []
        return
    ((_, impl, why),) = _log(a)
    assert impl is None and jax.default_backend() in why


def test_float32_policy_and_full_precision_are_untouched():
    fn = CASES["causal-const-div"]
    f32 = amp(fn, policy="float32")
    np.testing.assert_array_equal(f32(Q, K, V), fn(Q, K, V))
    a = amp(full_precision(fn), policy=XLA)
    np.testing.assert_array_equal(a(Q, K, V), fn(Q, K, V))
    ((_, impl, why),) = _log(a)
    assert impl is None and "full_precision" in why


def test_bad_attention_option_names_the_choices():
    with pytest.raises(ValueError, match="attention='flash'.*'auto'"):
        Policy(attention="flash")


def test_real_layers_are_recognised():
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    from workloads import models as M

    x = jax.random.normal(KX, (B, T, 32))
    linen = nn.MultiHeadDotProductAttention(num_heads=4)
    variables = linen.init(jax.random.PRNGKey(0), x)
    causal = nn.make_causal_mask(jnp.ones((B, T)))
    mha = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0))
    emha = eqx.nn.MultiheadAttention(4, 32, key=jax.random.PRNGKey(0))
    gpt = M.gpt(small=True)
    gp, gb = gpt.init(jax.random.PRNGKey(0)), gpt.batch(jax.random.PRNGKey(1))
    cases = {
        "flax linen + causal mask": (lambda v, x: linen.apply(v, x, mask=causal), (variables, x)),
        "flax nnx": (lambda x: mha(x), (x,)),
        "equinox under vmap": (lambda m, x: jax.vmap(lambda xi: m(xi, xi, xi))(x), (emha, x)),
        "scanned GPT (benchmarks)": (gpt.loss, (gp, *gb)),
    }
    for name, (fn, args) in cases.items():
        a = amp(fn, policy=XLA)
        out, want = a(*args), fn(*args)
        np.testing.assert_allclose(
            out, want, rtol=0, atol=3e-2 * float(jnp.max(jnp.abs(want))), err_msg=name
        )
        # (the scanned GPT's layer body twice: as the plan tree holds it, the mask a
        # bias, and as its scan's rule plans it with the mask's value, a LazyBody)
        want_log = ["xla", "xla"] if name.startswith("scanned") else ["xla"]
        assert [impl for _, impl, _ in _log(a)] == want_log, (name, _log(a))


# -- planning for a GPU (runs without one) ------------------------------------------------


def _plan(fn, *args, backend="gpu", mode="auto", dtype=jnp.bfloat16):
    """attention.plan_attention of ``fn``'s jaxpr as amp makes it on ``backend``."""
    from amp_jax._src import attention, compat
    from amp_jax._src.backends import backend_for
    from amp_jax._src.context import inline_jits

    closed = inline_jits(jax.make_jaxpr(fn)(*args))
    jaxpr = compat.jaxpr_of(closed)
    consts = dict(zip(jaxpr.constvars, compat.consts_of(closed)))
    target = backend_for(backend)
    return attention.plan_attention(jaxpr, consts, mode=mode, backend=target, compute_dtype=dtype)


def _planned_cases():
    """name: (fn, args, implementation, reason fragment, Match.kind or None)."""
    import flax.linen as nn

    t, d = 8, 16
    normal = np.random.default_rng(0).standard_normal  # (no new jax.random compilations)
    x = jnp.asarray(normal((B, t, d)), jnp.float32)
    causal = nn.make_causal_mask(jnp.ones((B, t)))
    bias = jnp.asarray(normal((1, 2, t, t)), jnp.float32)
    q12 = jnp.asarray(normal((B, t, 2, 12)), jnp.float32)
    return {**_layer_cases(x, causal), **_function_cases(x, causal, bias, q12)}


def _layer_cases(x, causal):
    """Attention layers of flax (linen, nnx) and Equinox, as `_planned_cases`."""
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    d = x.shape[-1]
    linen = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=d)
    # abstract parameters (shapes only): tracing is all a plan needs, and it is fast
    variables = jax.eval_shape(linen.init, jax.random.PRNGKey(0), x)

    def nnx_abstract(**kw):  # (graph, abstract state): a module without initialising it
        return nnx.split(
            nnx.eval_shape(
                lambda: nnx.MultiHeadAttention(
                    num_heads=2, in_features=d, decode=False, rngs=nnx.Rngs(0), **kw
                )
            )
        )

    nnx_graph, nnx_state = nnx_abstract()
    drop_graph, drop_state = nnx_abstract(dropout_rate=0.1)
    eqx_mha = eqx.filter_eval_shape(
        eqx.nn.MultiheadAttention, 2, d, qk_size=8, vo_size=16, key=jax.random.PRNGKey(0)
    )
    eqx_params, eqx_static = eqx.partition(eqx_mha, lambda a: isinstance(a, jax.ShapeDtypeStruct))

    def eqx_apply(p, x):
        m = eqx.combine(p, eqx_static)
        return jax.vmap(lambda xi: m(xi, xi, xi))(x)

    flash = ("cudnn", "cuDNN flash attention")
    return {
        "linen MultiHeadDotProductAttention": (
            lambda v, x: linen.apply(v, x, mask=causal),
            (variables, x),
            *flash,
            "causal",
        ),
        "nnx MultiHeadAttention": (
            lambda st, x: nnx.merge(nnx_graph, st)(x, mask=causal),
            (nnx_state, x),
            *flash,
            "causal",
        ),
        "equinox qk_size 8, vo_size 16": (eqx_apply, (eqx_params, x), *flash, "mla"),
        "nnx dropout": (
            lambda st, x: nnx.merge(drop_graph, st)(x, deterministic=False, rngs=nnx.Rngs(1)),
            (drop_state, x),
            None,
            "dropout on the probabilities",
            None,
        ),
    }


def _function_cases(x, causal, bias, q12):
    """Attention functions (flax's, jax.nn's, written out) at the limits, as `_planned_cases`."""
    import flax.linen as nn

    qh = x.reshape(B, x.shape[1], 2, 8)
    pad = jnp.arange(7)[None, :] < jnp.array([[7], [3]])
    q7 = Q[:, :7]
    flash = ("cudnn", "cuDNN flash attention")
    return {
        "linen dot_product_attention bias+mask": (
            lambda q, b: nn.dot_product_attention(q, q, q, bias=b, mask=causal),
            (qh, bias),
            *flash,
            "causal+bias",
        ),
        "jax.nn gqa": (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
            (Q, K2, V2),
            *flash,
            "causal+gqa",
        ),
        "head dim 12": (
            lambda q: jax.nn.dot_product_attention(q, q, q),
            (q12,),
            None,
            "head dim 12: cuDNN needs a multiple of 8",
            "plain",
        ),
        "odd length with a padding mask": (
            lambda q, k, v, pad: einsum_attention(q, k, v, mask=pad[:, None, None, :]),
            (q7, q7, q7, pad),
            None,
            "odd length (Tq=7, Tk=7) with a mask or bias",
            "mask",
        ),
        "odd length causal (no bias needed)": (
            lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True),
            (q7,),
            *flash,
            "causal",
        ),
    }


#: cases whose plan on a real GPU depends on the cuDNN version there
CUDNN_VERSION_DEPENDENT = {"odd length causal (no bias needed)"}


def test_real_layers_and_limits_planned_for_a_gpu():
    """What amp decides on a GPU for each attention, decided here without one."""
    for name, (fn, args, impl, why, kind) in _planned_cases().items():
        plan = _plan(fn, *args)
        ((_, got, reason),) = plan.log
        if GPU and name in CUDNN_VERSION_DEPENDENT and "cuDNN refused it" in reason:
            # on a GPU the plan asks cuDNN itself; cuDNN 9.x on an H100 refuses an
            # odd sequence length also without a bias (JAX 0.11.2): left as written
            impl, why, kind = None, "Unsupported sequence length", kind
        assert got == impl and why in reason, (name, plan.log)
        kinds = [m.kind for m, _ in plan.fused.values()]
        assert kinds == ([kind] if impl else []), (name, kinds)
        scopes = {decision.attention_scope(p) for p in plan.paths.values()}
        assert scopes == {"amp_attention[cudnn]" if impl else f"amp_attention[xla: {reason}]"}
        if kind and not impl:  # recognised, then refused: the reason is cuDNN's limit
            assert "dropout" not in reason


def test_backend_dtype_and_off_decide_before_the_gpu_limits():
    fn = CASES["causal-const-div"]
    ((_, impl, why),) = _plan(fn, Q, K, V, backend="cpu").log
    assert impl is None and why == "no fused attention kernel on cpu: left as written"
    ((_, impl, why),) = _plan(fn, Q, K, V, dtype=jnp.float32).log
    assert impl is None and why.startswith("compute dtype float32")
    ((_, impl, why),) = _plan(fn, Q, K, V, dtype=jnp.float16).log
    assert impl == "cudnn"
    if not GPU:  # forced cuDNN where there is none: left as written, not a crash
        a = amp(fn, policy=Policy(jnp.bfloat16, attention="cudnn"))
        np.testing.assert_allclose(
            a(Q, K, V), fn(Q, K, V), atol=3e-2 * float(jnp.max(jnp.abs(fn(Q, K, V))))
        )
        assert [(impl, why) for _, impl, why in _log(a)] == [
            (None, f"no cuDNN on {jax.default_backend()}: left as written")
        ]
    off = _plan(fn, Q, K, V, mode="off")
    assert off.log == [] and off.fused == {} and off.paths == {}


def test_equinox_with_unequal_head_dims_runs_fused():
    """qk_size != vo_size: the smaller head dim is zero-padded for the fused call."""
    import equinox as eqx

    normal = np.random.default_rng(1).standard_normal  # (no new jax.random compilations)
    x = jnp.asarray(normal((B, 8, 16)), jnp.float32)
    shapes = eqx.filter_eval_shape(
        eqx.nn.MultiheadAttention, 2, 16, qk_size=8, vo_size=16, key=jax.random.PRNGKey(0)
    )
    mha = jax.tree.map(
        lambda a: (
            jnp.asarray(0.3 * normal(a.shape), a.dtype)
            if isinstance(a, jax.ShapeDtypeStruct)
            else a
        ),
        shapes,
    )
    fn = lambda m, x: jax.vmap(lambda xi: m(xi, xi, xi))(x)  # noqa: E731
    a = amp(fn, policy=XLA)
    out, want = a(mha, x), fn(mha, x)
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-2 * float(jnp.max(jnp.abs(want))))
    assert [impl for _, impl, _ in _log(a)] == ["xla"]
    jaxpr = jax.make_jaxpr(lambda x: a(mha, x))(x)
    pads = [e for e, _ in eqns(jaxpr) if e.primitive.name == "pad"]
    assert pads and all(e.outvars[0].aval.shape[-1] == 16 for e in pads)


def test_dtype_report_and_explain_say_which_path_each_attention_took():
    from amp_jax import dtype_report, explain

    fn = CASES["causal-const-div"]
    why = {r[0]: r[5] for r in dtype_report(amp(fn, policy=XLA), Q, K, V) if r[0] == "exp"}
    assert why == {"exp": "attention: fused, xla implementation"}
    drop = _near_misses()["dropout_between"]
    rows = dtype_report(amp(drop, policy=XLA), Q, K, V)
    # left as written: the rule of each op's dtype, then the attention's path (as explain)
    whys = {r[0]: r[5] for r in rows if r[0] in ("exp", "reduce_max")}
    assert set(whys) == {"exp", "reduce_max"}, whys
    for why in whys.values():
        assert why.endswith("; attention left as written (xla: dropout on the probabilities)")
    assert whys["exp"].startswith("deny class: numerically sensitive, runs in float32"), whys
    ex = explain(fn, Q, K, V, policy=XLA)
    reasons = {r.reason for r in ex.rows if r.primitive == "dot_general"}
    assert reasons == {"attention: fused, xla implementation"}, reasons
    # left as written: the dtype reason stays, the attention's path is added
    ex = explain(drop, Q, K, V, policy=XLA)
    reasons = {r.reason for r in ex.rows if r.primitive == "exp"}
    assert len(reasons) == 1 and reasons.pop().endswith(
        "; attention left as written (xla: dropout on the probabilities)"
    )


# -- on a GPU: cuDNN flash attention -----------------------------------------------------


def _fmha_calls(hlo: str) -> tuple[list[str], list[str]]:
    """(forward, backward) cuDNN fused-attention custom-call targets in optimized HLO."""
    targets = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', hlo)
    return [t for t in targets if "Backward" not in t], [t for t in targets if "Backward" in t]


def _gpu_case(name):
    """(fn, args) at a size cuDNN takes: T=128, head dim 64."""
    ks = jax.random.split(KX, 4)
    q, k, v = (jax.random.normal(kk, (2, 128, 4, 64)) for kk in ks[:3])
    mask = jnp.tril(jnp.ones((128, 128), bool))
    bias = jax.random.normal(ks[3], (1, 4, 128, 128))
    k2, v2 = k[:, :, :2], v[:, :, :2]

    def gqa_repeat(q, k, v):
        k, v = (jnp.repeat(a, 2, axis=2) for a in (k, v))
        return _scaled(q, k, v, mask)

    def biased(q, k, v, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0 + b
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    return {
        "causal-const-div": (lambda q, k, v: _scaled(q, k, v, mask), (q, k, v)),
        "jax.nn causal": (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
            (q, k, v),
        ),
        "heads-first": (lambda q, k, v: _scaled(q, k, v, mask, heads_first=True), (q, k, v)),
        "bias": (biased, (q, k, v, bias)),
        "gqa jnp.repeat": (gqa_repeat, (q, k2, v2)),
        "gqa jax.nn": (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
            (q, k2, v2),
        ),
    }[name]


@pytest.mark.skipif(not GPU, reason="cuDNN fused attention needs a GPU")
@pytest.mark.parametrize(
    "name",
    ["causal-const-div", "jax.nn causal", "heads-first", "bias", "gqa jnp.repeat", "gqa jax.nn"],
)
def test_cudnn_flash_attention_on_gpu(name):
    fn, args = _gpu_case(name)
    a = amp(fn, policy="bfloat16")
    # values and gradients of every float argument (the bias too) within the bf16 floor
    out, want = jax.jit(a)(*args), fn(*args)
    assert out.dtype == want.dtype and out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-2 * float(jnp.max(jnp.abs(want))))
    argnums = tuple(range(len(args)))
    loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))  # noqa: E731
    grads = jax.jit(jax.grad(loss(a), argnums))(*args)
    with jax.default_matmul_precision("highest"):
        wants = jax.jit(jax.grad(loss(fn), argnums))(*args)
    for g, w in zip(grads, wants):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=0, atol=6e-2 * float(jnp.max(jnp.abs(w))))
    assert [impl for _, impl, _ in _log(a)] == ["cudnn"], _log(a)
    hlo = jax.jit(jax.value_and_grad(loss(a), argnums)).lower(*args).compile().as_text()
    fwd, bwd = _fmha_calls(hlo)
    assert fwd and bwd, (fwd, bwd)
    if name == "bias":
        assert all("Bias" in t for t in fwd + bwd), (fwd, bwd)
    if name.startswith("gqa"):  # cuDNN reads k and v with their 2 heads, not repeated
        calls = [ln for ln in hlo.splitlines() if "__cudnn$fmha" in ln]
        assert all("bf16[2,128,2,64]" in ln for ln in calls), calls


def _scaled(q, k, v, mask, heads_first=False):
    d = q.shape[-1]
    if heads_first:
        q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    else:
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
    if heads_first:
        return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", p, v), 1, 2)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.skipif(not GPU, reason="cuDNN limits are checked on a GPU")
def test_cudnn_refusal_falls_back_with_a_reason():
    q = jax.random.normal(KQ, (2, 16, 2, 12))  # head dim 12: not a multiple of 8
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    a = amp(fn, policy="bfloat16")
    _check_close(a, fn, q, q, q)
    ((_, impl, why),) = _log(a)
    assert impl is None and "head dim 12" in why


def _fused_kinds(fn):
    """The kinds of the attentions amp fused in every (sub-)jaxpr it planned for
    ``fn``, in the order it planned them (the plan tree's, then the lazy bodies')."""
    (traced,) = fn._cache.values()
    return [m.kind for p in traced.ctx.memo.plans for m, _ in p.fused.values()]


def test_causal_mask_closed_over_by_a_scanned_layer_becomes_is_causal():
    """A GPT's layers under lax.scan read the model's causal mask as a loop
    constant: amp gives the loop body its value, so the attention is fused as
    causal (cuDNN skips the masked blocks) rather than with the mask as a bias."""
    b, t, h, d = Q.shape
    mask = jnp.tril(jnp.ones((t, t), bool))

    def model(x, ws):
        def layer(x, w):
            q = (x @ w).reshape(b, t, h, d)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, q) / math.sqrt(d)
            p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
            return x + jnp.einsum("bhqk,bkhd->bqhd", p, q).reshape(x.shape) @ w, None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    x = Q.reshape(b, t, h * d)
    ws = jax.random.normal(jax.random.PRNGKey(7), (2, h * d, h * d)) * (h * d) ** -0.5
    a = amp(model, policy=XLA)
    np.testing.assert_allclose(a(x, ws), model(x, ws), rtol=3e-2)
    # the plan tree holds the body as traced (the mask's value is a fact of the
    # call: a bias); the scan's rule, which has the value, plans the body with
    # it (a LazyBody) and evaluates that plan: fused as causal
    assert _fused_kinds(a) == ["mask", "causal"]
    g = jax.grad(amp(model, policy=XLA), argnums=1)(x, ws)
    np.testing.assert_allclose(
        g, jax.grad(model, argnums=1)(x, ws), rtol=0.1, atol=0.05 * float(jnp.max(jnp.abs(g)))
    )
