"""Structure and values of amp(fn): dtypes in the rewritten jaxpr, composition, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F16, F32, allow_out_dtype, check_dots_low, eqns, prim_dtypes
from jax import lax

from amp_jax import Policy, amp, full_precision
from amp_jax._src.backends import backend_for
from amp_jax._src.rules.dots.outputs import allow_output_dtype

KEY = jax.random.PRNGKey(0)


def _mlp_params(sizes=(16, 32, 32, 8)):
    ks = jax.random.split(KEY, len(sizes))
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.full((b,), 0.1))
        for k, a, b in zip(ks, sizes[:-1], sizes[1:])
    ]


def mlp_loss(params, x):
    h = x
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    return jnp.mean(jax.nn.log_softmax(h @ w + b) ** 2)


X = jax.random.normal(jax.random.PRNGKey(1), (8, 16))


def test_dots_low_precision_with_f32_accumulation():
    # (the result dtype is the backend's: float32 on CPU, bf16 on GPU; the
    # accumulation is float32 inside the kernel either way)
    jaxpr = jax.make_jaxpr(amp(mlp_loss))(_mlp_params(), X)
    dots = prim_dtypes(jaxpr, "dot_general")
    assert len(dots) == 3
    for ins, outs, _ in dots:
        assert ins == (BF16, BF16) and outs == (allow_out_dtype(),)


def test_sensitive_ops_stay_float32():
    jaxpr = jax.make_jaxpr(amp(mlp_loss))(_mlp_params(), X)
    for name in ("exp", "log", "reduce_sum"):
        found = prim_dtypes(jaxpr, name)
        assert found, name
        for ins, outs, _ in found:
            assert all(d == F32 for d in ins + outs), (name, ins, outs)
    check_dots_low(jaxpr, min_low=3)  # and the matmuls beside them run low


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_followers_between_dots_are_low_and_no_cancelling_converts():
    jaxpr = jax.make_jaxpr(amp(mlp_loss))(_mlp_params(), X)
    tanhs = prim_dtypes(jaxpr, "tanh")
    # two hidden gelus between dots run in bf16; the last one feeds the f32 softmax
    assert [i for i, _, _ in tanhs].count((BF16,)) == 2
    # no convert whose input is itself a convert back to the same dtype
    producer = {}
    for e, _ in eqns(jaxpr):
        for v in e.outvars:
            producer[v] = e
    for e, _ in eqns(jaxpr):
        if e.primitive.name == "convert_element_type":
            src = producer.get(e.invars[0])
            if src is not None and src.primitive.name == "convert_element_type":
                assert np.dtype(src.invars[0].aval.dtype) != np.dtype(e.outvars[0].aval.dtype)


def test_values_within_bf16_tolerance():
    p = _mlp_params()
    # (what ran low: 3 forward, 3 dW, 2 dx -- none for the undifferentiated input)
    check_dots_low(jax.make_jaxpr(jax.grad(amp(mlp_loss)))(p, X), min_low=8)
    np.testing.assert_allclose(amp(mlp_loss)(p, X), mlp_loss(p, X), rtol=2e-2)
    g, g0 = jax.grad(amp(mlp_loss))(p, X), jax.grad(mlp_loss)(p, X)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        assert a.dtype == b.dtype == jnp.float32
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 3e-2


def test_float32_policy_is_bitwise_identity():
    p = _mlp_params()
    f = amp(mlp_loss, policy="float32")
    assert np.array_equal(f(p, X), mlp_loss(p, X))
    for a, b in zip(jax.tree.leaves(jax.grad(f)(p, X)), jax.tree.leaves(jax.grad(mlp_loss)(p, X))):
        assert np.array_equal(a, b)
    assert np.array_equal(jax.jit(f)(p, X), jax.jit(mlp_loss)(p, X))


def test_backward_dots_have_no_mixed_operands():
    jaxpr = jax.make_jaxpr(jax.grad(amp(mlp_loss)))(_mlp_params(), X)
    dots = prim_dtypes(jaxpr, "dot_general")
    # forward, then dW per layer and dx per layer but the first (the input X is
    # not differentiated: no product for it, even before DCE)
    assert len(dots) == 3 + 3 + 2
    for ins, outs, _ in dots:
        assert ins == (BF16, BF16), ins
        assert outs == (allow_out_dtype(),)


def test_gradients_in_parameter_dtypes():
    p = [(w.astype(jnp.bfloat16), b) for w, b in _mlp_params()]
    g = jax.grad(amp(mlp_loss))(p, X)
    check_dots_low(
        jax.make_jaxpr(jax.grad(amp(mlp_loss)))(p, X), min_low=8
    )  # (no dx for the input)
    for (gw, gb), (w, b) in zip(g, p):
        assert gw.dtype == w.dtype and gb.dtype == b.dtype


# -- higher-order primitives, nested ----------------------------------------------


def nested(w, x):
    ws = jnp.stack([w, 0.5 * w])

    def body(c, wi):
        h = lax.cond(c.sum() > 0, lambda h: jnp.tanh(h @ wi), lambda h: h @ wi.T, c)
        return h, jnp.sum(h)

    h, ys = jax.jit(lambda x: lax.scan(body, x, ws))(x)
    h = jax.checkpoint(lambda h: jax.nn.relu(h @ w))(h)
    h = h + lax.stop_gradient(
        lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)), (0, h))[1]
    )

    @jax.custom_vjp
    def g(a, w):
        return a @ w

    g.defvjp(lambda a, w: (a @ w, (a, w)), lambda r, ct: (ct @ r[1].T, r[0].T @ ct))

    @jax.custom_jvp
    def k(a, w):
        return jnp.tanh(a @ w)

    # (closing over w in the rule would fail under grad(jit) in plain JAX too)
    k.defjvp(lambda p, t: (k(*p), (1 - k(*p) ** 2) * (t[0] @ p[1] + p[0] @ t[1])))
    return jnp.sum(g(k(h, w), w) ** 2) + ys.sum()


W8 = jax.random.normal(KEY, (8, 8)) * 0.3
X8 = jax.random.normal(jax.random.PRNGKey(2), (4, 8))


def test_every_higher_order_primitive_rewritten():
    jaxpr = jax.make_jaxpr(amp(nested))(W8, X8)
    dots = prim_dtypes(jaxpr, "dot_general")
    paths = {p for _, _, p in dots}
    for ins, _, p in dots:
        assert all(d == BF16 for d in ins), (ins, p)
    joined = [" ".join(p) for p in paths]
    assert any("scan" in p and "cond" in p for p in joined), joined  # jit inlined; cond in scan
    assert any("remat" in p or "checkpoint" in p for p in joined), joined
    assert any("while" in p for p in joined), joined
    assert any("custom_jvp_call" in p for p in joined), joined
    assert any("custom_vjp_call" in p for p in joined), joined


def test_loop_carries_and_branch_outputs_keep_dtypes():
    jaxpr = jax.make_jaxpr(amp(nested))(W8, X8)
    check_dots_low(jaxpr, min_low=5)  # the dots inside the loops and branches run low
    for e, _ in eqns(jaxpr):
        if e.primitive.name in ("scan", "while", "cond"):
            for v in e.outvars:
                assert np.dtype(v.aval.dtype) in (F32, np.dtype(np.int32)), (
                    e.primitive.name,
                    v.aval,
                )


def test_nested_values_and_grads():
    check_dots_low(jax.make_jaxpr(amp(nested))(W8, X8), min_low=5)
    np.testing.assert_allclose(amp(nested)(W8, X8), nested(W8, X8), rtol=3e-2)
    g, g0 = jax.grad(amp(nested))(W8, X8), jax.grad(nested)(W8, X8)
    assert float(jnp.linalg.norm(g - g0) / jnp.linalg.norm(g0)) < 5e-2


def test_custom_vjp_forward_rewritten_under_grad():
    jaxpr = jax.make_jaxpr(jax.grad(amp(nested)))(W8, X8)
    fwd_dots = [(i, p) for i, _, p in prim_dtypes(jaxpr, "dot_general")]
    assert fwd_dots and all(
        all(d == BF16 for d in i) for i, p in fwd_dots if "scan" in p or "while" in p
    )
    # the user's bwd rule runs under the policy too (as the forward it may
    # recompute): its ``ct @ w.T`` is bf16; only ``a.T @ ct``, a contraction
    # of 4 (too small to pay), stays float32
    f32_dots = [i for i, _ in fwd_dots if i == (F32, F32)]
    assert len(f32_dots) == 1, fwd_dots


def test_dot_inside_cond_inside_scan_inside_jit_two_levels():
    def f(w, xs):
        def body(c, x):
            return lax.cond(x.sum() > 0, lambda: c @ w, lambda: c @ w.T), None

        return jax.jit(lambda: lax.scan(body, xs[0], xs)[0])()

    # (an 8-vector times an 8x8 matrix is below the size thresholds: lower everything)
    jaxpr = jax.make_jaxpr(amp(f, policy=Policy(min_low_contraction=0, min_low_flops=0)))(W8, X8)
    dots = prim_dtypes(jaxpr, "dot_general")
    assert len(dots) == 2
    assert all(i == (BF16, BF16) and ("scan" in p and "cond" in p) for i, _, p in dots)


# -- composition ---------------------------------------------------------------


def test_compositions():
    p = _mlp_params()
    ref = jax.grad(mlp_loss)(p, X)
    f = amp(mlp_loss)
    outs = {
        "jit(amp)": jax.jit(f)(p, X),
        "grad(amp)": jax.grad(f)(p, X),
        "jit(grad(amp))": jax.jit(jax.grad(f))(p, X),
        "amp(grad)": amp(jax.grad(mlp_loss))(p, X),
        "amp(amp)": amp(amp(mlp_loss))(p, X),
        "checkpoint(amp)": jax.grad(jax.checkpoint(f))(p, X),
        "amp(checkpoint)": jax.grad(amp(jax.checkpoint(mlp_loss)))(p, X),
    }
    with_aux = amp(lambda p, x: (mlp_loss(p, x), {"h": x @ p[0][0]}))
    (v, aux), g = jax.value_and_grad(with_aux, has_aux=True)(p, X)
    assert aux["h"].dtype == F32  # computed by a bf16 dot, returned in its original dtype
    np.testing.assert_allclose(aux["h"], X @ p[0][0], rtol=2e-2, atol=2e-2)
    outs["value_and_grad(amp, has_aux)"] = g
    for name in (
        "grad(amp)",
        "jit(grad(amp))",
        "amp(grad)",
        "checkpoint(amp)",
        "amp(checkpoint)",
        "value_and_grad(amp, has_aux)",
    ):
        for a, b in zip(jax.tree.leaves(outs[name]), jax.tree.leaves(ref)):
            assert a.dtype == b.dtype
            assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 3e-2, name
    np.testing.assert_allclose(outs["jit(amp)"], mlp_loss(p, X), rtol=2e-2)
    np.testing.assert_allclose(outs["amp(amp)"], outs["jit(amp)"], rtol=1e-6)
    # vmap both ways
    xs = X.reshape(2, 4, 16)
    np.testing.assert_allclose(
        jax.vmap(f, in_axes=(None, 0))(p, xs),
        jax.vmap(mlp_loss, in_axes=(None, 0))(p, xs),
        rtol=2e-2,
    )
    np.testing.assert_allclose(
        amp(jax.vmap(mlp_loss, in_axes=(None, 0)))(p, xs),
        jax.vmap(mlp_loss, in_axes=(None, 0))(p, xs),
        rtol=2e-2,
    )
    check_dots_low(jax.make_jaxpr(jax.vmap(f, in_axes=(None, 0)))(p, xs), min_low=3)
    check_dots_low(jax.make_jaxpr(amp(jax.vmap(mlp_loss, in_axes=(None, 0))))(p, xs), min_low=3)


def test_amp_of_grad_runs_backward_dots_low():
    jaxpr = jax.make_jaxpr(amp(jax.grad(mlp_loss)))(_mlp_params(), X)
    # 3 forward dots, 3 weight gradients, 2 input gradients: all bf16
    check_dots_low(jaxpr, min_low=8)


def test_amp_is_idempotent_structurally():
    j1 = jax.make_jaxpr(amp(mlp_loss))(_mlp_params(), X)
    j2 = jax.make_jaxpr(amp(amp(mlp_loss)))(_mlp_params(), X)
    assert len(prim_dtypes(j1, "dot_general")) == len(prim_dtypes(j2, "dot_general"))
    assert prim_dtypes(j2, "dot_general")[0][0] == (BF16, BF16)


def test_shard_map_over_forced_host_devices():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cpus = jax.devices("cpu")  # the forced host devices, also where a GPU is the default
    n = len(cpus)
    assert n >= 2, "conftest forces 8 host devices"
    mesh = jax.make_mesh((n,), ("d",), devices=cpus)
    sm = jax.jit(
        jax.shard_map(
            lambda x, w: lax.psum(jnp.sum(jnp.tanh(x @ w)), "d"),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=P(),
        )
    )
    x = jax.device_put(jax.random.normal(KEY, (n * 2, 8)), NamedSharding(mesh, P("d")))
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(amp(sm)(x, W8), sm(x, W8), rtol=2e-2)
        g, g0 = jax.grad(amp(sm), argnums=1)(x, W8), jax.grad(sm, argnums=1)(x, W8)
        assert float(jnp.linalg.norm(g - g0) / jnp.linalg.norm(g0)) < 3e-2
        jaxpr = jax.make_jaxpr(jax.grad(amp(sm), argnums=1))(x, W8)
    dots = prim_dtypes(jaxpr, "dot_general")
    # forward and the weight gradient (x is not differentiated: no product for it)
    assert len(dots) == 2 and all(i == (BF16, BF16) and "shard_map" in p for i, _, p in dots)


# -- arguments, outputs, caching, errors -----------------------------------------------


def test_pytrees_kwargs_and_static_leaves():
    @amp
    def f(params, x, *, act=jnp.tanh, name="layer", scale=2.0, extra=None):
        assert isinstance(name, str) and isinstance(scale, float) and extra is None
        return {"y": act(x @ params["w"]) * scale, "n": x.shape[0]}

    out = f({"w": W8}, X8, act=jax.nn.relu, name="l1", scale=3.0)
    assert out["y"].dtype == jnp.float32 and out["y"].shape == (4, 8)
    assert int(out["n"]) == 4
    jaxpr = jax.make_jaxpr(lambda p, x: f(p, x, act=jax.nn.relu, name="l1", scale=3.0))
    assert prim_dtypes(jaxpr({"w": W8}, X8), "dot_general")[0][0] == (BF16, BF16)
    np.testing.assert_allclose(out["y"], jax.nn.relu(X8 @ W8) * 3.0, rtol=2e-2, atol=2e-2)
    assert f.__name__ == "f"


def test_decorator_forms():
    @amp(policy="float16")
    def f(a, b):
        return a @ b

    j = jax.make_jaxpr(f)(W8, W8)
    assert prim_dtypes(j, "dot_general")[0][0] == (F16, F16)
    g = amp(lambda a, b: a @ b, policy=Policy(jnp.float16))
    assert prim_dtypes(jax.make_jaxpr(g)(W8, W8), "dot_general")[0][0] == (F16, F16)


def test_trace_cached_per_signature():
    # (a function of its own: amp(mlp_loss) shares the traces other tests made)
    f = amp(lambda p, x: mlp_loss(p, x))
    p = _mlp_params()
    f(p, X)
    f(p, X + 1.0)
    assert f.trace_count == 1
    f(p, X[:4])
    assert f.trace_count == 2
    jax.jit(f)(p, X)
    assert f.trace_count == 2  # same avals: cache hit under jit too


def test_a_token_is_returned_and_passed_as_jit_returns_and_takes_it():
    # a token (effects ordering) is no array: amp once tried to make it one
    # on the way out, and took one passed in for a plain object holding arrays
    tok = lax.create_token()
    _, out = amp(lambda x: (x @ W8, tok))(X8)
    assert isinstance(out, type(tok))
    assert isinstance(amp(lambda x: (x @ W8, lax.create_token()))(X8)[1], type(tok))
    for f in (amp(lambda t, x: (t, x @ W8)), jax.jit(amp(lambda t, x: (t, x @ W8)))):
        t, y = f(tok, X8)
        assert isinstance(t, type(tok))
        np.testing.assert_allclose(y, X8 @ W8, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fn", [jnp.asarray, lambda x: x, lambda x: (x, 2 * x)])
def test_an_argument_returned_as_it_is_comes_back_an_array_under_jvp(fn):
    # jax.jvp of a Python float hands a function a tracer of that float: an
    # input returned untouched came back as the float (jnp.asarray's jaxpr has
    # no eqn), where jax.jvp(jnp.asarray) and jax.jvp(jax.jit(fn)) give Arrays
    want = jax.jvp(jax.jit(fn), (1.0,), (2.0,))
    got = jax.jvp(amp(fn), (1.0,), (2.0,))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(g, jax.Array), got
        assert (g.dtype, g.weak_type, float(g)) == (w.dtype, w.weak_type, float(w))


def test_never_touched_values():
    def f(x, i, key):
        y = x.astype(jnp.bfloat16).astype(jnp.float32)  # user-written casts
        r = jax.random.normal(key, x.shape)
        return y @ x.T, i * 2, r, y - x

    i = jnp.arange(4, dtype=jnp.int32)
    outs = amp(f)(X8, i, KEY)
    refs = f(X8, i, KEY)
    assert [o.dtype for o in outs] == [r.dtype for r in refs]
    assert prim_dtypes(jax.make_jaxpr(amp(f))(X8, i, KEY), "dot_general")[0][0] == (BF16, BF16)
    assert np.array_equal(outs[1], refs[1]) and np.array_equal(outs[2], refs[2])
    # the user's round trip through bf16 is kept exactly (not cancelled, not moved)
    assert float(jnp.abs(refs[3]).max()) > 0
    np.testing.assert_array_equal(outs[3], refs[3])
    converts = [
        (i, o)
        for i, o, _ in prim_dtypes(jax.make_jaxpr(amp(f))(X8, i, KEY), "convert_element_type")
    ]
    assert ((F32,), (BF16,)) in converts and ((BF16,), (F32,)) in converts


def test_strict_mode_names_primitive():
    f = amp(lambda x: x @ x.T, policy=Policy(jnp.bfloat16, clear=()), strict=True)
    with pytest.raises(NotImplementedError, match="transpose"):
        f(X8)


def test_full_precision_region():
    @full_precision
    def sensitive(a, b):
        return a @ b

    f = amp(lambda a, b: sensitive(a, b) + a @ b)
    dots = prim_dtypes(jax.make_jaxpr(f)(W8, W8), "dot_general")
    assert sorted(i for i, _, _ in dots) == sorted([(F32, F32), (BF16, BF16)])
    gdots = prim_dtypes(jax.make_jaxpr(jax.grad(lambda a: f(a, W8).sum()))(W8), "dot_general")
    assert (F32, F32) in [i for i, _, _ in gdots]


def test_named_scope_selection():
    def f(a, b):
        with jax.named_scope("head"):
            y = a @ b
        return y + a @ b

    pol = Policy(jnp.bfloat16, full_precision_scopes=("head",))
    dots = prim_dtypes(jax.make_jaxpr(amp(f, policy=pol))(W8, W8), "dot_general")
    assert sorted(i for i, _, _ in dots) == sorted([(F32, F32), (BF16, BF16)])


def test_conv_backend_aware_and_forced():
    x = jax.random.normal(KEY, (2, 8, 8, 3))
    w = jax.random.normal(KEY, (3, 3, 3, 4)) * 0.2
    conv = functools.partial(
        lax.conv_general_dilated,
        window_strides=(1, 1),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    j = jax.make_jaxpr(amp(conv))(x, w)
    expected = F32 if jax.default_backend() == "cpu" else BF16
    assert prim_dtypes(j, "conv_general_dilated")[0][0] == (expected, expected)
    forced = amp(conv, policy=Policy(jnp.bfloat16, backend_aware=False))
    j = jax.make_jaxpr(jax.grad(lambda x, w: forced(x, w).sum(), argnums=(0, 1)))(x, w)
    convs = prim_dtypes(j, "conv_general_dilated")
    assert len(convs) == 3 and all(i == (BF16, BF16) for i, _, _ in convs)
    g = jax.grad(lambda x, w: forced(x, w).sum(), argnums=1)(x, w)
    g0 = jax.grad(lambda x, w: conv(x, w).sum(), argnums=1)(x, w)
    assert float(jnp.linalg.norm(g - g0) / jnp.linalg.norm(g0)) < 2e-2


# -- custom_jvp calls with only follow/clear ops are transparent -------------------


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_custom_jvp_follow_body_runs_low_and_keeps_its_rule():
    @jax.custom_jvp
    def ste_round(h):  # a straight-through estimator: only follow/clear ops
        return jnp.round(h * 4) / 4

    ste_round.defjvp(lambda p, t: (ste_round(*p), 0.5 * t[0]))

    def f(w, x):
        return jnp.sum(ste_round(jax.nn.relu(x @ w)) @ w)

    jaxpr = jax.make_jaxpr(amp(f))(W8, X8)
    for name in ("round", "max"):  # ste_round's and relu's bodies
        assert {o[0] for _, o, p in prim_dtypes(jaxpr, name) if "custom_jvp_call" in p} == {BF16}
    check_dots_low(jax.make_jaxpr(jax.grad(amp(f)))(W8, X8), min_low=3)
    # The user's rule (slope 0.5) and relu's (slope 0 at 0) still define the gradient.
    g, g32 = jax.grad(amp(f))(W8, X8), jax.grad(f)(W8, X8)
    np.testing.assert_allclose(g, g32, rtol=5e-2, atol=5e-2 * float(jnp.abs(g32).max()))
    z = jnp.zeros_like(X8)
    np.testing.assert_array_equal(jax.grad(amp(f), argnums=1)(W8, z), jax.grad(f, argnums=1)(W8, z))


def test_custom_jvp_with_sensitive_body_stays_a_boundary():
    @jax.custom_jvp
    def soft(h):
        return jnp.log1p(jnp.exp(h))

    soft.defjvp(lambda p, t: (soft(*p), jax.nn.sigmoid(p[0]) * t[0]))
    jaxpr = jax.make_jaxpr(amp(lambda w, x: soft(x @ w) @ w))(W8, X8)
    assert {i[0] for i, _, p in prim_dtypes(jaxpr, "exp") if "custom_jvp_call" in p} == {F32}
    check_dots_low(jaxpr, min_low=2)  # the matmuls around it run low


# -- regressions: caching, full_precision with shared sub-jaxprs, clear ops ---------------


def _br_low(x):
    return jnp.tanh(x @ W8)


def _br_other(x):
    return jnp.sin(x @ W8)


@pytest.mark.parametrize("scoped_first", [False, True])
def test_full_precision_with_a_branch_jaxpr_shared_outside(scoped_first):
    """JAX reuses one branch jaxpr for both conds; the scope must still hold."""

    def plain(x):
        return lax.cond(x.sum() > 0, _br_low, _br_other, x)

    scoped = full_precision(plain)
    f = amp(lambda x: (scoped(x) - plain(x)) if scoped_first else (-plain(x) + scoped(x)))
    ins = [i for i, _, p in prim_dtypes(jax.make_jaxpr(f)(X8), "dot_general")]
    assert sorted(ins) == sorted([(F32, F32)] * 2 + [(BF16, BF16)] * 2), ins


def test_repeated_calls_reuse_the_rewrite():
    """Eager and grad calls after the first build nothing new (no retrace, no leak)."""

    @jax.custom_jvp
    def soft(h):
        return jnp.log1p(jnp.exp(h))  # not transparent: an opaque custom_jvp_call

    soft.defjvp(lambda p, t: (soft(*p), jax.nn.sigmoid(p[0]) * t[0]))
    ws = jnp.stack([W8, 0.5 * W8])

    def loss(ws, x):
        h = lax.scan(lambda c, w: (jax.nn.relu(c @ w), None), x, ws)[0]
        return jnp.sum(soft(h @ W8))

    from amp_jax._src import compat

    traces = []
    trace = compat.trace_to_closed_jaxpr

    def counting(fn, avals):
        traces.append(fn)
        return trace(fn, avals)

    f = amp(loss)
    g = jax.grad(f)
    sizes, counts = [], []
    compat.trace_to_closed_jaxpr = counting
    try:
        for _ in range(3):
            f(ws, X8)
            g(ws, X8)
            (traced,) = f._cache.values()
            sizes.append(len(traced.ctx.memo.table))
            counts.append(len(traces))
    finally:
        compat.trace_to_closed_jaxpr = trace
    assert f.trace_count == 1  # grad hits the same trace (same avals)
    assert sizes[0] == sizes[1] == sizes[2] > 0, sizes
    # the sub-jaxprs (scan body, custom_jvp rule) were rewritten on the first
    # round only: later calls trace nothing
    assert counts[0] > 0 and counts[0] == counts[1] == counts[2], counts


def test_clear_op_feeding_a_dot_and_a_deny_op_stays_float32():
    def f(x, w):
        t = x.T
        return jnp.sum(jnp.log(jnp.abs(t) + 1.0)), t @ w

    jaxpr = jax.make_jaxpr(amp(f))(X, W8)
    # (the user's transpose: the dot rule's own layout copies sit inside its custom_vjp)
    assert {o[0] for _, o, p in prim_dtypes(jaxpr, "transpose") if not p} == {F32}
    assert {i[0] for i, _, _ in prim_dtypes(jaxpr, "log")} == {F32}
    check_dots_low(jaxpr)  # while the matmul it feeds runs low
    np.testing.assert_allclose(jax.jit(amp(f))(X, W8)[0], jax.jit(f)(X, W8)[0], rtol=1e-6)


# -- the dtype allow ops write ----------------------------------------------------------


@pytest.mark.parametrize("outputs, want", [("compute", BF16), ("float32", F32)])
def test_allow_outputs_sets_the_dot_result_dtype_forward_and_backward(outputs, want):
    params = _mlp_params()
    pol = Policy(jnp.bfloat16, allow_outputs=outputs)
    jaxpr = jax.make_jaxpr(jax.grad(amp(mlp_loss, policy=pol)))(params, X)
    dots = prim_dtypes(jaxpr, "dot_general")
    assert len(dots) == 8  # 3 forward, 5 backward (no dx for the input X)
    assert all(ins == (BF16, BF16) and outs == (want,) for ins, outs, _ in dots), dots
    g, g32 = jax.grad(amp(mlp_loss, policy=pol))(params, X), jax.grad(mlp_loss)(params, X)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g32)):
        assert a.dtype == F32
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * float(jnp.max(jnp.abs(b))))


def test_allow_outputs_auto_is_per_backend():
    pol = Policy(jnp.bfloat16)
    assert pol.allow_outputs == "auto"
    cpu, gpu, tpu = (backend_for(n) for n in ("cpu", "gpu", "tpu"))
    assert allow_output_dtype(pol, gpu) == BF16
    assert allow_output_dtype(pol, cpu) == F32 and allow_output_dtype(pol, tpu) == F32
    assert allow_output_dtype(Policy(jnp.float16, allow_outputs="compute"), cpu) == F16
    with pytest.raises(ValueError, match="allow_outputs='bf16'.*'auto'"):
        Policy(allow_outputs="bf16")


# -- tests that pin two structural features (tools/mutants.py kills them here) -----------


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_bias_gradient_is_reduced_in_float32():
    # The bias is broadcast *before* its cast to bf16, so the transpose of the
    # broadcast -- the sum over the batch -- runs in float32.
    def f(w, b, w2, x):
        return jnp.sum((jnp.tanh(x @ w + b) @ w2) ** 2)

    x, w, b, w2 = jnp.ones((8, 16)), jnp.ones((16, 32)) * 0.1, jnp.ones(32), jnp.ones((32, 4))
    jaxpr = jax.make_jaxpr(jax.grad(amp(f), argnums=1))(w, b, w2, x)
    sums = prim_dtypes(jaxpr, "reduce_sum")
    assert sums and all(ins == (F32,) for ins, _, _ in sums), sums
    # The add reads the matmul's float32 result and the float32 bias: it
    # computes in float32 and writes bf16 for the tanh.
    assert prim_dtypes(jaxpr, "add")[0][0] == (F32, F32)
    assert prim_dtypes(jaxpr, "tanh")[0][0] == (BF16,)


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_size_one_operand_of_a_low_add_is_broadcast_before_its_cast():
    # An add between two matmuls runs low; its [1, n] operand (a dot written in
    # bf16, allow_outputs="compute" as on GPU) is broadcast in float32 and
    # then cast, so the transpose of the broadcast -- the sum over the batch
    # -- runs in float32, not in bf16.
    def f(w, w2, v, x):
        return jnp.sum(jnp.tanh((x @ w + v @ w2) @ w2.T) ** 2)

    x, v = jnp.ones((8, 16)), jnp.ones((1, 16))
    w, w2 = jnp.ones((16, 32)) * 0.1, jnp.ones((16, 32)) * 0.1
    fn = amp(f, policy=Policy(allow_outputs="compute"))
    adds = [ins for ins, _, _ in prim_dtypes(jax.make_jaxpr(fn)(w, w2, v, x), "add")]
    assert adds == [(BF16, BF16)], adds
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=1))(w, w2, v, x)
    sums = [ins for ins, _, _ in prim_dtypes(jaxpr, "reduce_sum")]
    assert (F32,) in sums and (BF16,) not in sums, sums


def test_scanned_weights_are_cast_once_outside_the_loop():
    def f(ws, x):
        return jnp.sum(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0])

    ws, x = jnp.ones((3, 16, 16)) * 0.1, jnp.ones((4, 16))
    fwd = amp(f)
    for fn in (fwd, jax.grad(fwd)):
        jaxpr = jax.make_jaxpr(fn)(ws, x)
        scans = [e for e, _ in eqns(jaxpr) if e.primitive.name == "scan"]
        # the stacked weights enter the (forward) scan already in bf16
        assert any(v.aval.shape == (3, 16, 16) and v.aval.dtype == BF16 for v in scans[0].invars), (
            scans[0]
        )
        if fn is not fwd:  # (in the backward loop, dW is cast to the bf16 input's dtype)
            continue
        body_converts = [
            e
            for e, path in eqns(jaxpr)
            if "scan" in path
            and e.primitive.name == "convert_element_type"
            and e.invars[0].aval.shape == (16, 16)
        ]
        assert not body_converts  # no per-layer cast of the weights inside the loop
