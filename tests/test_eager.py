"""amp_jax.eager.scan_step: equivalence with the standard step, structure, memory, errors."""

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import eqns

import amp_jax
from amp_jax import optim
from workloads import models

L, D = 3, 8


embed, block, head = models.stack_embed, models.stack_block, models.stack_head


def make_params(dtype=jnp.float32, layers=L, width=D):
    return models.stack_params(jax.random.key(0), width, layers, dtype)


def abstract_params(width, layers):
    """Shapes of make_params at another size (for compile-only memory tests)."""
    return jax.eval_shape(lambda: make_params(layers=layers, width=width))


BATCH = jax.random.normal(jax.random.key(9), (4, D))

OPTS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
    # float32 parameters: the master copy must not alias the donated params
    "master_adam": lambda: optim.master_weights(optax.adam(1e-2)),
}


def standard(loss, tx):
    @jax.jit
    def step(p, s, x):
        l, g = jax.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    return step


def assert_states_match(std_state, eager_state, **tol):
    """Every standard-state leaf equals its eager counterpart (per part)."""
    parts = {
        p: {
            jax.tree_util.keystr(k): v
            for k, v in jax.tree_util.tree_flatten_with_path(getattr(eager_state, p))[0]
        }
        for p in ("embed", "blocks", "head")
    }
    n = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(std_state)[0]:
        key = jax.tree_util.keystr(path)
        hit = [p for p in parts if f"['{p}']" in key]
        if hit:
            got = parts[hit[0]][key.replace(f"['{hit[0]}']", "", 1)]
            np.testing.assert_allclose(
                np.asarray(got, np.float64), np.asarray(leaf, np.float64), **tol
            )
        else:  # a shared scalar (count): one per part, one per layer
            for p in parts:
                got = np.asarray(parts[p][key])
                assert np.all(got == np.asarray(leaf)), (key, p, got, leaf)
        n += 1
    assert n > 0


def run_both(tx_fn, remat, fns=(embed, block, head), steps=3, dtype=jnp.float32):
    tx = tx_fn()
    step = amp_jax.eager.scan_step(*fns, tx, remat=remat)
    p = make_params(dtype)
    s = step.init(p)
    ps, ss = make_params(dtype), tx.init(make_params(dtype))
    std = standard(step.loss, tx)
    for _ in range(steps):
        p, s, l = step(p, s, BATCH)
        ps, ss, ls = std(ps, ss, BATCH)
    return p, s, l, ps, ss, ls


# Tolerance: the gradients are bitwise equal (checked for SGD below); the
# optimizer arithmetic runs in a differently fused XLA computation (inside the
# loop body instead of one fusion over the whole tree), which moves results by
# ~1 float32 ulp (observed max 6e-8 on values of size ~0.3).
TOL = dict(rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize(
    "opt,remat", [(o, False) for o in sorted(OPTS)] + [("adamw", True), ("sgd_momentum", True)]
)
def test_matches_standard_step(opt, remat):
    p, s, l, ps, ss, ls = run_both(OPTS[opt], remat)
    np.testing.assert_allclose(l, ls, **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, ps)
    assert_states_match(ss, s, **TOL)


def test_plain_sgd_is_bitwise():
    p, _, l, ps, _, ls = run_both(lambda: optax.sgd(0.5), remat=False)
    assert l == ls
    jax.tree.map(np.testing.assert_array_equal, p, ps)


@pytest.mark.parametrize("remat", [False, True])
def test_under_amp_matches_standard_and_runs_bf16(remat):
    fns = (embed, amp_jax.amp(block), amp_jax.amp(head))
    p, s, l, ps, ss, ls = run_both(OPTS["adam"], remat, fns=fns)
    # Same amp functions in both steps, but the bf16 residuals are produced by
    # differently fused computations (stored vs recomputed under remat): results
    # differ by up to ~1e-3 relative (observed, remat=True), i.e. below one
    # bfloat16 ulp (7.8e-3); without remat by a few float32 ulps.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=8e-3, atol=1e-3), p, ps)
    step = amp_jax.eager.scan_step(*fns, optax.adam(1e-2), remat=remat)
    params = make_params()
    jaxpr = jax.make_jaxpr(step.update)(params, step.init(params), BATCH)
    in_scan = [e for e, path in eqns(jaxpr) if e.primitive.name == "dot_general" and "scan" in path]
    # forward and backward block matmuls (inside the scans) take bf16 operands
    assert len(in_scan) >= 4
    for e in in_scan:
        assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e


def test_low_precision_stacks_are_written_as_integers():
    """The loops write the block's bf16 residuals (forward) and the float8
    moment codes (backward) one layer at a time into stacks held as unsigned
    ints of their width: XLA:CPU has no dynamic-update-slice of a bf16 or
    float8 array and converts the whole stack to float32 and back around every
    row write (a float8 state stack made the step 10x slower). No
    dynamic-update-slice of the optimized step writes a bf16 or f8 stack."""
    layers, width = 6, 128
    params = abstract_params(width, layers)
    fns = (embed, amp_jax.amp(block), amp_jax.amp(head))
    tx = optim.adamw(1e-3, state_format="float8", min_quantized_size=0)
    step = amp_jax.eager.scan_step(*fns, tx)
    state = jax.eval_shape(step.init, params)
    quantized = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optim.QuantizedArray))
    codes = [q.codes.dtype for q in quantized if isinstance(q, optim.QuantizedArray)]
    assert codes and set(codes) == {np.dtype(jnp.uint8)}
    batch = jax.ShapeDtypeStruct((4, width), jnp.float32)
    text = (
        jax.jit(step.update, donate_argnums=(0, 1)).lower(params, state, batch).compile().as_text()
    )
    writes = [
        ln
        for ln in text.splitlines()
        if "dynamic-update-slice" in ln and re.search(rf"= \w+\[{layers},", ln)
    ]
    assert writes, "no layer stack written row by row: the pattern no longer matches"
    low = [ln for ln in writes if re.search(rf"= (bf16|f16|f8\w*)\[{layers},", ln)]
    assert not low, "\n".join(low)
    # the bf16 residuals are there, stored as their bits
    assert any(re.search(rf"= u16\[{layers},", ln) for ln in writes)


def test_update_runs_inside_backward_scan_without_full_gradient():
    step = amp_jax.eager.scan_step(embed, block, head, optax.adam(1e-2))
    params = make_params()
    jaxpr = jax.make_jaxpr(step.update)(params, step.init(params), BATCH)
    # adam's sqrt(nu) for the block parameters runs inside the (backward) scan,
    sqrt_in_scan = [e for e, path in eqns(jaxpr) if e.primitive.name == "sqrt" and "scan" in path]
    assert any(e.outvars[0].aval.shape == (D, D) for e in sqrt_in_scan)
    # and no top-level value has the shape of a stacked gradient of w1/w2
    # except the parameter and state stacks themselves (inputs and the outputs
    # of the backward scan, which are the updated stacks).
    top = [
        v
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name != "scan"
        for v in e.outvars
        if v.aval.shape == (L, D, D)
    ]
    assert not top, top
    # The scans output exactly the updated stacks of w1 and w2 (param, mu, nu):
    # no stacked gradient, and no stored copy of the weights.
    scan_outs = [
        v
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "scan"
        for v in e.outvars
        if v.aval.shape == (L, D, D)
    ]
    assert len(scan_outs) == 6, [str(v.aval) for v in scan_outs]


@pytest.mark.parametrize(
    "tx,width,layers",
    [
        (optax.sgd(1e-2, momentum=0.9), 64, 8),
        # 8-bit AdamW states (blocks of 256: wide enough for quantized layers)
        (optim.adamw(1e-3, state_format="8bit"), 128, 6),
    ],
    ids=["sgd_momentum", "adamw_8bit"],
)
def test_compiled_peak_below_standard(tx, width, layers):
    params = abstract_params(width, layers)
    batch = jax.ShapeDtypeStruct((1, width), jnp.float32)
    step = amp_jax.eager.scan_step(embed, block, head, tx)

    def peak(fn, s):
        m = jax.jit(fn, donate_argnums=(0, 1)).lower(params, s, batch).compile().memory_analysis()
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    std = peak(standard(step.loss, tx), jax.eval_shape(tx.init, params))
    eag = peak(step.update, jax.eval_shape(step.init, params))
    block_bytes = optim.state_bytes(params["blocks"])
    # eager saves at least half of the full block gradient
    assert eag < std - block_bytes // 2, (eag, std, block_bytes)


@pytest.mark.parametrize(
    "name,tx",
    [
        ("sgd_momentum", optax.sgd(1e-2, momentum=0.9)),
        ("adam", optax.adam(1e-3)),
        ("kahan_adam", optim.kahan_summation(optax.adam(1e-3))),
    ],
)
def test_compiled_temp_holds_no_layer_of_optimizer_state(name, tx):
    """The backward loop's temporaries are the layer's parameter slice (carried:
    the vjp needs it) and the next one, not a slice of the optimizer state:
    each state stack is read and written in place, one at a time. Holding the
    state slice (as the step did before) costs one layer per state leaf per
    parameter: 3.08 / 4.08 / 6.08 layers here for sgd momentum / adam /
    kahan(adam), against 2.08 / 2.08 / 2.58 now (XLA CPU, JAX 0.10.2)."""
    width, layers = 128, 6
    params = abstract_params(width, layers)
    step = amp_jax.eager.scan_step(embed, block, head, tx)
    batch = jax.ShapeDtypeStruct((1, width), jnp.float32)
    compiled = (
        jax.jit(step.update, donate_argnums=(0, 1))
        .lower(params, jax.eval_shape(step.init, params), batch)
        .compile()
    )
    layer = optim.state_bytes(params["blocks"]) / layers
    temp = compiled.memory_analysis().temp_size_in_bytes / layer
    assert temp < 2.75, f"{name}: temporaries are {temp:.2f} layers of parameters"


def test_state_rows_are_read_before_any_is_written():
    """A state leaf whose update reads another state leaf gets the old value,
    although the step writes the state stacks one after the other."""

    class S(NamedTuple):
        a: optax.Updates
        b: optax.Updates

    def update(g, s, p=None):
        a = jax.tree.map(lambda a, g: 0.5 * a + g, s.a, g)
        b = jax.tree.map(lambda b, a_old: b + a_old, s.b, s.a)  # reads a before its update
        u = jax.tree.map(lambda a, b: -1e-2 * (a + 0.1 * b), a, b)
        return u, S(a, b)

    init = lambda p: S(jax.tree.map(jnp.ones_like, p), jax.tree.map(jnp.zeros_like, p))
    p, s, l, ps, ss, ls = run_both(
        lambda: optax.GradientTransformation(init, update), remat=False, steps=3
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, ps)
    assert_states_match(ss, s, **TOL)


def test_kahan_bf16_matches_standard_and_static_loss_scale_is_exact():
    p, s, l, ps, ss, ls = run_both(
        lambda: optim.kahan_summation(optax.adam(1e-2)), False, dtype=jnp.bfloat16
    )
    assert p["blocks"]["w1"].dtype == jnp.bfloat16
    assert s.blocks.compensation["w1"].shape == (L, D, D)
    # bf16 parameters: a differently fused update may round a value to the
    # neighbouring bf16 number (one ulp, 2**-8 relative); the compensation
    # buffers hold what each rounding lost, so they carry the same tolerance
    # relative to the parameters' scale.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=2**-9
        ),
        p,
        ps,
    )
    assert_states_match(ss, s, rtol=2**-7, atol=2**-9)
    # static loss scaling: the backward pass is seeded with the scale and every
    # part unscales, so the result equals the unscaled step.
    a = amp_jax.eager.scan_step(embed, block, head, optax.sgd(0.5))
    b = amp_jax.eager.scan_step(embed, block, head, optim.static_loss_scale(optax.sgd(0.5), 2.0**8))
    pa, pb = make_params(), make_params()
    pa = a(pa, a.init(pa), BATCH)[0]
    pb = b(pb, b.init(pb), BATCH)[0]
    jax.tree.map(np.testing.assert_array_equal, pa, pb)


def test_stochastic_rounding_keys_differ_per_layer():
    tx = optim.stochastic_rounding(optax.sgd(1e-2), 0)
    step = amp_jax.eager.scan_step(embed, block, head, tx)
    s = step.init(make_params(jnp.bfloat16))
    keys = np.asarray(s.blocks.key)
    assert keys.shape[0] == L and len({tuple(k) for k in keys}) == L
    others = {tuple(np.asarray(s.embed.key)), tuple(np.asarray(s.head.key))}
    assert len(others) == 2 and not others & {tuple(k) for k in keys}


def test_stochastic_rounding_per_layer_is_reproducible_and_differs_per_layer():
    """Every layer gets the same gradient (blocks are h + b) and the same bf16
    bias: only the per-layer rounding key can make the layers' results differ."""

    def emb(p, x):
        return x @ p["w"]

    def blk(p, h):
        return h + p["b"].astype(h.dtype)

    def hd(p, h, x):
        return jnp.mean((h @ p["w"] - x) ** 2)

    def params():
        return {
            "embed": {"w": jnp.ones((D, 64)) / 8},
            "blocks": {"b": jnp.ones((L, 64), jnp.bfloat16)},
            "head": {"w": jnp.ones((64, D)) / 8},
        }

    x = jax.random.normal(jax.random.key(3), (4, D))
    tx = optim.stochastic_rounding(optax.sgd(0.3), 7)
    step = amp_jax.eager.scan_step(emb, blk, hd, tx)
    g = jax.grad(step.loss)(params(), x)["blocks"]["b"]
    np.testing.assert_array_equal(g[0], g[1])  # identical per-layer gradients

    def run():
        p = params()
        s = step.init(p)
        for _ in range(2):
            p, s, _ = step(p, s, x)
        return np.asarray(p["blocks"]["b"], np.float32), np.asarray(s.blocks.key)

    b1, k1 = run()
    b2, k2 = run()
    np.testing.assert_array_equal(b1, b2)  # reproducible
    np.testing.assert_array_equal(k1, k2)
    assert len({r.tobytes() for r in b1}) == L  # every layer rounded differently


class _NoisyState(NamedTuple):
    seed: jax.Array  # raw uint32 key data
    other: jax.Array

    raw_key_fields = ("seed",)  # the per-copy key protocol (optim._tree.salt_keys)


class _PlainState(NamedTuple):
    seed: jax.Array
    other: jax.Array


@pytest.mark.parametrize("cls,distinct", [(_NoisyState, True), (_PlainState, False)])
def test_raw_key_protocol_salts_declared_fields_only(cls, distinct):
    """No special case for stochastic rounding: any state that declares
    `raw_key_fields` gets per-layer keys; undeclared fields are left alone."""
    tx = optax.GradientTransformation(
        lambda p: cls(jax.random.key_data(jax.random.key(0)), jnp.zeros(2, jnp.uint32)),
        lambda g, s, p=None: (g, s),
    )
    step = amp_jax.eager.scan_step(embed, block, head, tx)
    s = step.init(make_params())
    seeds = {np.asarray(k).tobytes() for k in s.blocks.seed}
    seeds |= {np.asarray(getattr(s, q).seed).tobytes() for q in ("embed", "head")}
    assert len(seeds) == (L + 2 if distinct else 1)
    assert not np.asarray(s.blocks.other).any()  # other uint32 leaves untouched
    assert isinstance(s.blocks, cls)


def test_typed_prng_keys_differ_per_layer_and_part():
    """optax.add_noise keeps a typed key: vmap(init) would copy it to every layer."""
    step = amp_jax.eager.scan_step(embed, block, head, optax.add_noise(0.1, 0.55, 0))
    s = step.init(make_params())
    data = {tuple(np.asarray(k)) for k in jax.random.key_data(s.blocks.rng_key)}
    data |= {
        tuple(np.asarray(jax.random.key_data(getattr(s, p).rng_key))) for p in ("embed", "head")
    }
    assert len(data) == L + 2


@pytest.mark.parametrize(
    "tx,match",
    [
        (
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            "depends on the gradient or value of",
        ),
        (optax.apply_if_finite(optax.sgd(1e-3), 3), "depends on the gradient or value of"),
        (optax.MultiSteps(optax.sgd(1e-3), 4), "MultiSteps"),
        (
            optax.chain(optim.dynamic_loss_scale(optax.sgd(1e-3))),
            "dynamic_loss_scale nested inside another transformation",
        ),
        (
            optax.GradientTransformation(  # a global statistic kept in the state
                lambda p: jnp.zeros(()),
                lambda g, s, p=None: (g, 0.9 * s + 0.1 * optax.tree.norm(g)),
            ),
            r"keeps state.*together",
        ),
    ],
)
def test_refused_optimizers(tx, match):
    step = amp_jax.eager.scan_step(embed, block, head, tx)
    with pytest.raises(ValueError, match=match) as e:
        step.init(make_params())
    assert "`optimizer`" in str(e.value)


def test_bad_params():
    step = amp_jax.eager.scan_step(embed, block, head, optax.sgd(1.0))
    p = make_params()
    with pytest.raises(ValueError, match="`params` must be a dict"):
        step.init({"embed": p["embed"], "blocks": p["blocks"]})
    p["blocks"]["w2"] = p["blocks"]["w2"][:2]
    with pytest.raises(ValueError, match="disagree on the leading"):
        step.init(p)
    with pytest.raises(TypeError, match="`optimizer`"):
        amp_jax.eager.scan_step(embed, block, head, "adam")
    with pytest.raises(ValueError, match="`block_fn` must return"):
        bad = amp_jax.eager.scan_step(embed, lambda p, h: h[:, :2], head, optax.sgd(1.0))
        q = make_params()
        bad.update(q, bad.init(q), BATCH)


# -- float16 + dynamic loss scaling (check-first) ----------------------------


def dynamic_std(loss, tx):
    @jax.jit
    def step(p, s, x):
        l, g = optim.scaled_value_and_grad(loss, s)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    return step


BAD = BATCH.at[0, 0].set(jnp.inf)  # every gradient becomes non-finite


def run_dynamic(fns, dtype, batches, form="wrapper", **kw):
    tx = optim.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2, **kw)
    if form == "rule":  # the rule passed explicitly beside the inner optimizer
        step = amp_jax.eager.scan_step(*fns, tx.inner, loss_scale=tx.rule)
    else:
        step = amp_jax.eager.scan_step(*fns, tx)
    p, ps = make_params(dtype), make_params(dtype)
    s, ss = step.init(p), tx.init(ps)
    std = dynamic_std(step.loss, tx)
    out = []
    for x in batches:
        before = jax.tree.map(np.asarray, p)
        p, s, l = step(p, s, x)
        ps, ss, ls = std(ps, ss, x)
        snap = lambda t: jax.tree.map(np.asarray, t)  # p and s are donated next step
        out.append((before, snap(p), snap(s), l, ps, ss, ls))
    return step, out


@pytest.mark.parametrize("form", ["wrapper", "rule"])
def test_dynamic_loss_scale_matches_standard_and_skips_overflow(form):
    batches = [BATCH, BATCH, BAD, BATCH, BATCH]
    step, out = run_dynamic((embed, block, head), jnp.float32, batches, form=form)
    assert isinstance(step.loss_scale, optim.LossScaleRule)
    stats = [optim.loss_scale_stats(o[2]) for o in out]
    # growth after 2 good steps, backoff on the overflow step, growth again
    assert [float(t["scale"]) for t in stats] == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
    assert [int(t["skipped_steps"]) for t in stats] == [0, 0, 1, 1, 1]
    assert int(stats[-1]["last_skipped_step"]) == 3
    for _, p, s, l, ps, ss, ls in out:
        np.testing.assert_allclose(l, ls, **TOL)
        assert isinstance(s, optim.DynamicLossScaleState)
        assert isinstance(s.inner_state, amp_jax.eager.ScanStepState)
        for k in ("scale", "good_steps", "skipped_steps", "steps", "last_skipped_step"):
            assert np.asarray(getattr(s, k)) == np.asarray(getattr(ss, k)), k
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, ps)
        assert_states_match(ss.inner_state, s.inner_state, **TOL)
    # the skipped step wrote nothing: parameters bitwise unchanged, counts not bumped
    before, p, s, *_ = out[2]
    jax.tree.map(np.testing.assert_array_equal, p, before)
    assert np.all(np.asarray(s.inner_state.blocks[0].count) == 2)
    assert int(s.inner_state.head[0].count) == 2 and int(s.inner_state.embed[0].count) == 2


def test_dynamic_loss_scale_nan_in_one_layer_skips_every_part():
    """A non-finite gradient only in layer 0 (the last the backward walk reaches)
    must still keep the head and the later layers unchanged: the skip is decided
    before any layer is written."""

    def blk(p, h):  # d/dc of 0 * sqrt(c) at c = 0 is 0 * inf = nan; forward finite
        return block(p, h) + 0.0 * jnp.sqrt(p["c"])

    tx = optim.dynamic_loss_scale(optax.sgd(1e-2), init_scale=4.0)
    step = amp_jax.eager.scan_step(embed, blk, head, tx)
    p = make_params()
    p["blocks"]["c"] = jnp.ones((L,)).at[0].set(0.0)
    before = jax.tree.map(np.asarray, p)
    g = jax.grad(step.loss)(p, BATCH)
    assert np.isnan(g["blocks"]["c"][0]) and np.isfinite(g["blocks"]["c"][1:]).all()
    assert all(np.isfinite(x).all() for k, x in g["blocks"].items() if k != "c")
    p, s, _ = step(p, step.init(p), BATCH)
    jax.tree.map(np.testing.assert_array_equal, p, before)
    assert int(s.skipped_steps) == 1 and float(s.scale) == 2.0
    # a finite step with the same state does write
    p["blocks"]["c"] = jnp.ones((L,))
    q, s, _ = step(p, s, BATCH)
    assert int(s.skipped_steps) == 1 and not np.array_equal(q["head"]["w"], before["head"]["w"])


@pytest.mark.parametrize("remat", [False, True])
def test_float16_amp_dynamic_loss_scale_matches_standard(remat):
    """float16 compute (amp policy) and float16 gradients, forced overflow."""
    blk = amp_jax.amp(block, policy="float16")
    tx = optim.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2)
    step = amp_jax.eager.scan_step(embed, blk, head, tx, remat=remat)
    p, ps = make_params(), make_params()
    s, ss = step.init(p), tx.init(ps)
    std = dynamic_std(step.loss, tx)
    for x in [BATCH, BAD, BATCH, BATCH]:
        p, s, l = step(p, s, x)
        ps, ss, ls = std(ps, ss, x)
        assert float(s.scale) == float(ss.scale)
        assert int(s.skipped_steps) == int(ss.skipped_steps)
    assert int(s.skipped_steps) == 1 and float(s.scale) == 2.0**10
    np.testing.assert_allclose(l, ls, rtol=1e-6)
    # same gradients up to float16 fusion differences (1e-3 relative), amplified
    # by adam's normalisation of tiny gradients
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4), p, ps)
    jaxpr = str(jax.make_jaxpr(step.update)(make_params(), step.init(make_params()), BATCH))
    assert "f16" in jaxpr


def test_loss_scale_argument_errors_name_the_fix():
    tx = optim.dynamic_loss_scale(optax.sgd(1e-2))
    with pytest.raises(TypeError, match=r"tx.inner, loss_scale=tx.rule"):
        amp_jax.eager.scan_step(embed, block, head, tx, loss_scale=tx.rule)
    with pytest.raises(TypeError, match=r"LossScaleRule .*got float"):
        amp_jax.eager.scan_step(embed, block, head, optax.sgd(1e-2), loss_scale=2.0**10)


def test_dynamic_loss_scale_bad_state():
    tx = optim.dynamic_loss_scale(optax.sgd(1e-2))
    step = amp_jax.eager.scan_step(embed, block, head, tx)
    p = make_params()
    with pytest.raises(ValueError, match=r"DynamicLossScaleState\(inner_state=ScanStepState"):
        step.update(p, step.init(p).inner_state, BATCH)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "float8"])
def test_quantized_adamw_states_match_standard_step(fmt):
    """optim.adamw(state_format=...) inside the backward scan: each layer's
    moments are quantized block-wise on their own (blocks run along the last
    axis, so a layer's slice of the stacked codes is that layer's codes) and
    the step tracks the standard one. Not bitwise: the float32 Adam
    arithmetic differs by ~1 ulp (see TOL), which can move a value across a
    code's midpoint."""
    tx_fn = lambda: optim.adamw(1e-2, state_format=fmt, min_quantized_size=0)  # noqa: E731
    p, s, l, ps, ss, ls = run_both(tx_fn, remat=False)
    np.testing.assert_allclose(l, ls, rtol=1e-4)
    moved = max(
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(ps), jax.tree.leaves(make_params()))
    )
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ps)):
        assert float(jnp.abs(a - b).max()) < 0.05 * moved
    assert len(optim._tree.find_states(s, optim.QuantizedArray)) == 2 * 5  # mu, nu each
    parts = {
        part: dict(
            (jax.tree_util.keystr(k), v)
            for k, v in jax.tree_util.tree_flatten_with_path(getattr(s, part))[0]
        )
        for part in ("embed", "blocks", "head")
    }
    n_codes = 0
    for path, want in jax.tree_util.tree_flatten_with_path(ss)[0]:
        key = jax.tree_util.keystr(path)
        part = next((q for q in parts if f"['{q}']" in key), None)
        if part is None or not key.endswith((".codes", ".absmax")):
            continue
        got = parts[part][key.replace(f"['{part}']", "", 1)]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if key.endswith(".absmax"):
            np.testing.assert_allclose(got, want, rtol=1e-3)
        else:
            assert np.mean(_bytes(got) == _bytes(want)) > 0.9, key
            n_codes += 1
    assert n_codes == 2 * 5


def _bytes(x):
    return np.asarray(x).reshape(-1).view(np.uint8)
