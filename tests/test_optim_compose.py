"""Composition with optax, jit, cond, tree.map, shard_map; public API docs."""

import doctest
import functools
import importlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import optim

# These tests feed hand-scaled gradients to (often jitted) updates, with the
# scale read outside the trace: the unscaled-gradient check does not apply.
_dls = functools.partial(optim.dynamic_loss_scale, check_scaled=False)
_sls = functools.partial(optim.static_loss_scale, check_scaled=False)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _params(dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (4, 3)).astype(dtype), "b": jnp.zeros((3,), dtype)}


WRAPPERS = {
    "dynamic_loss_scale": lambda: _dls(optax.adam(1e-2), init_scale=8.0, growth_interval=2),
    "static_loss_scale": lambda: _sls(optax.adam(1e-2), 8.0),
    "master_weights": lambda: optim.master_weights(optax.adam(1e-2)),
    "kahan_summation": lambda: optim.kahan_summation(optax.adam(1e-2)),
    "stochastic_rounding": lambda: optim.stochastic_rounding(optax.adam(1e-2), jax.random.key(1)),
    "adamw": lambda: optim.adamw(
        1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.bfloat16, kahan=True, weight_decay=1e-3
    ),
}


def _grads(params, i):
    return jax.tree.map(
        lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(7), i), p.shape).astype(
            p.dtype
        ),
        params,
    )


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_state_round_trips_and_is_stable_under_jit_and_cond(name):
    tx = WRAPPERS[name]()
    params = _params()
    state = tx.init(params)
    fields = type(state)._fields if hasattr(type(state), "_fields") else None
    # jit identity and tree.map keep the type, every field and every dtype.
    for rt in (jax.jit(lambda s: s)(state), jax.tree.map(lambda x: x, state)):
        assert type(rt) is type(state)
        assert getattr(type(rt), "_fields", None) == fields
        _assert_same(rt, state)
    leaves, treedef = jax.tree.flatten(state)
    _assert_same(jax.tree.unflatten(treedef, leaves), state)

    # A step under jit inside lax.cond: both branches must agree exactly on the
    # state's structure and dtypes (no weak types, no dtype drift).
    @jax.jit
    def step(params, state, grads, pred):
        def do(operand):
            return tx.update(grads, operand, params)

        def skip(operand):
            return jax.tree.map(jnp.zeros_like, do(operand)[0]), operand

        return jax.lax.cond(pred, do, skip, state)

    updates, new_state = step(params, state, _grads(params, 0), True)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.shape == b.shape
    _, same = step(params, state, _grads(params, 0), False)
    _assert_same(same, state)
    new_params = optax.apply_updates(params, updates)
    assert jax.tree.map(lambda p: p.dtype, new_params) == jax.tree.map(lambda p: p.dtype, params)
    assert any(
        not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params))
    )


def test_clipping_inside_sees_unscaled_gradients():
    params = {"w": jnp.zeros(4)}
    g = {"w": jnp.array([0.1, -0.2, 0.1, 0.05])}  # global norm < 1
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = _dls(inner, init_scale=2.0**12)
    state = tx.init(params)
    scaled = jax.tree.map(lambda x: x * optim.loss_scale(state), g)
    updates, _ = jax.jit(tx.update)(scaled, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -np.asarray(g["w"]), rtol=1e-6)
    # Clipping *outside* the wrapper would have seen the scaled gradients.
    outside = optax.chain(optax.clip_by_global_norm(1.0), _dls(optax.sgd(1.0), init_scale=2.0**12))
    s2 = outside.init(params)
    u2, _ = outside.update(scaled, s2, params)
    assert np.abs(np.asarray(u2["w"])).sum() < 0.01


def test_chain_and_inject_hyperparams_schedule_match_plain_optimizer():
    sched = optax.exponential_decay(1e-2, 3, 0.5)
    params = _params(jnp.float32)
    plain = optax.inject_hyperparams(optax.adamw)(learning_rate=sched)
    wrapped = optax.chain(
        _dls(
            optax.inject_hyperparams(optim.adamw)(learning_rate=sched, weight_decay=1e-4),
            init_scale=2.0**10,
            growth_interval=3,
        ),
        optax.identity(),
    )
    sp, sw = plain.init(params), wrapped.init(params)
    pp = pw = params
    for i in range(6):
        g = _grads(params, i)
        # Both under jit: eager op-by-op and fused code may round differently
        # (XLA:GPU contracts a*b+c into one FMA).
        up, sp = jax.jit(plain.update)(g, sp, pp)
        pp = optax.apply_updates(pp, up)
        scale = optim.loss_scale(sw)
        uw, sw = jax.jit(wrapped.update)(jax.tree.map(lambda x: x * scale, g), sw, pw)
        pw = optax.apply_updates(pw, uw)
    # The scale is a power of two, so scaling and unscaling is exact.
    _assert_same(pw, pp)
    assert float(optim.loss_scale(sw)) == 2.0**12


def test_multisteps_accumulates_and_skips_whole_step():
    params = _params(jnp.float32)
    ms = optax.MultiSteps(_dls(optax.adam(1e-2), init_scale=4.0), 2)
    ref = optax.MultiSteps(optax.adam(1e-2), 2)
    sm, sr = ms.init(params), ref.init(params)
    pm = pr = params
    ms_update, ref_update = jax.jit(ms.update), jax.jit(ref.update)
    for i in range(4):
        g = _grads(params, i)
        um, sm = ms_update(jax.tree.map(lambda x: x * 4.0, g), sm, pm)
        ur, sr = ref_update(g, sr, pr)
        pm, pr = optax.apply_updates(pm, um), optax.apply_updates(pr, ur)
    _assert_same(pm, pr)
    assert int(sm.gradient_step) == 2
    # One non-finite micro-batch poisons the accumulated step: it is skipped.
    bad = jax.tree.map(lambda x: x.at[0].set(jnp.inf), _grads(params, 9))
    _, sm = ms_update(bad, sm, pm)
    before = sm.inner_opt_state.inner_state
    um, sm = ms_update(_grads(params, 10), sm, pm)
    assert int(sm.inner_opt_state.skipped_steps) == 1
    assert float(optim.loss_scale(sm)) == 2.0
    for u in jax.tree.leaves(um):
        np.testing.assert_array_equal(np.asarray(u), 0.0)
    _assert_same(sm.inner_opt_state.inner_state, before)


def test_loss_scale_around_multisteps_drops_only_the_bad_micro_batch():
    # Recommended order: each micro-batch is unscaled and checked on its own; a
    # non-finite one is dropped without touching the accumulator.
    params = _params(jnp.float32)
    tx = _dls(optax.MultiSteps(optax.sgd(1.0), 2), init_scale=4.0)
    state = tx.init(params)
    bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), _grads(params, 0))
    g1, g2 = _grads(params, 1), _grads(params, 2)
    update = jax.jit(tx.update)
    _, state = update(jax.tree.map(lambda x: x * 4.0, g1), state, params)
    _, state = update(bad, state, params)
    assert int(state.skipped_steps) == 1 and float(state.scale) == 2.0
    assert int(state.inner_state.mini_step) == 1
    u, state = update(jax.tree.map(lambda x: x * 2.0, g2), state, params)
    assert int(state.inner_state.gradient_step) == 1
    expected = jax.tree.map(lambda a, b: -(a + b) / 2, g1, g2)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_full_recipe_loss_scale_master_weights_float16():
    params = _params(jnp.float16)
    tx = _dls(
        optim.master_weights(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))),
        init_scale=2.0**15,
    )
    state = tx.init(params)

    def loss_fn(p, x):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)

    @jax.jit
    def step(params, state, x):
        loss, grads = optim.scaled_value_and_grad(loss_fn, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    x = jax.random.normal(jax.random.key(3), (8, 4), jnp.float16)
    losses = []
    for _ in range(10):
        params, state, loss = step(params, state, x)
        assert loss.dtype == jnp.float16
        losses.append(float(loss))
        master = optim.master_params(state)
        for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(master)):
            assert p.dtype == jnp.float16 and m.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(p.dtype)))
    assert losses[-1] < losses[0]


_SHARD_MAP_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import json
    import jax, jax.numpy as jnp, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from amp_jax import optim
    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("d",))
    out = {}
    for axis in ["d", None]:
      tx = optim.dynamic_loss_scale(optax.adam(0.1), init_scale=4.0, check_scaled=False,
                                    axis_name=axis)
      def body(g, params, state):
        u, s = tx.update(g[0], state, params)
        return (u[None], s.scale[None], s.skipped_steps[None],
                s.inner_state[0].count[None])
      f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P()),
                                out_specs=(P("d"),) * 4))
      rep = NamedSharding(mesh, P())
      params = jax.device_put(jnp.ones(3), rep)
      state = jax.device_put(tx.init(params), rep)
      for name, g in [("finite", jnp.ones((4, 3))),
                      ("inf_on_device_2", jnp.ones((4, 3)).at[2, 1].set(jnp.inf))]:
        g = jax.device_put(g, NamedSharding(mesh, P("d")))
        u, scale, skipped, count = f(g, params, state)
        out[f"{axis}/{name}"] = dict(u=u.tolist(), scale=scale.tolist(),
                                     skipped=skipped.tolist(),
                                     count=count.tolist())
    print("RESULT" + json.dumps(out))
""")


def test_shard_map_with_axis_name_skips_on_every_device(tmp_path):
    script = tmp_path / "shard_map_check.py"
    script.write_text(_SHARD_MAP_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"  # forced host devices: pin the CPU platform (not a GPU)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    out = json.loads(line[len("RESULT") :])
    fin = out["d/finite"]
    assert fin["scale"] == [4.0] * 4 and fin["skipped"] == [0] * 4
    assert fin["count"] == [1] * 4
    bad = out["d/inf_on_device_2"]
    assert bad["scale"] == [2.0] * 4 and bad["skipped"] == [1] * 4
    assert bad["count"] == [0] * 4
    assert np.all(np.asarray(bad["u"]) == 0.0)
    # Without axis_name the devices disagree: only device 2 skips.
    local = out["None/inf_on_device_2"]
    assert local["skipped"] == [0, 0, 1, 0] and local["scale"] == [4, 4, 2, 4]


def test_every_public_symbol_is_documented_and_doctests_pass():
    for name in optim.__all__:
        obj = getattr(optim, name)
        doc = inspect.getdoc(obj)
        assert doc, f"{name} has no docstring"
        if inspect.isfunction(obj):
            for section in ("Args:", "Returns:", "Examples:", "References:"):
                assert section in doc, f"{name} docstring lacks {section}"
        else:
            assert "Attributes:" in doc, f"{name} docstring lacks Attributes:"
    failures = 0
    for mod in ("_loss_scale", "_master", "_kahan", "_stochastic", "_adamw", "_tree"):
        module = importlib.import_module(f"amp_jax.optim.{mod}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        failures += result.failed
    assert failures == 0


def test_docs_bytes_table_matches_the_script():
    from benchmarks import optim_bytes as module

    table = module.markdown_table()
    assert table in (ROOT / "docs" / "optim.md").read_text()
    totals = {name: w + g + s for name, w, g, s in module.rows(4096)}
    assert totals["float32 AdamW"] == pytest.approx(16.0, abs=0.01)
    assert totals["pure bf16 + Kahan (bf16 moments, bf16 compensation)"] == (
        pytest.approx(10.0, abs=0.01)
    )
    assert totals["pure bf16 + stochastic rounding (bf16 moments)"] == (
        pytest.approx(8.0, abs=0.01)
    )


_AIF = {
    "apply_if_finite(adamw)": lambda: optax.apply_if_finite(optim.adamw(1e-2), 3),
    "apply_if_finite(adamw kahan)": lambda: optax.apply_if_finite(optim.adamw(1e-2, kahan=True), 3),
    "apply_if_finite(master_weights(adam))": lambda: optax.apply_if_finite(
        optim.master_weights(optax.adam(1e-2)), 3
    ),
    "apply_if_finite(kahan_summation(adam))": lambda: optax.apply_if_finite(
        optim.kahan_summation(optax.adam(1e-2)), 3
    ),
    "apply_if_finite(stochastic_rounding(adam))": lambda: optax.apply_if_finite(
        optim.stochastic_rounding(optax.adam(1e-2), key=0), 3
    ),
    "static_loss_scale(apply_if_finite(adam))": lambda: _sls(
        optax.apply_if_finite(optax.adam(1e-2), 3), 4.0
    ),
    "dynamic_loss_scale(apply_if_finite(adam))": lambda: _dls(
        optax.apply_if_finite(optax.adam(1e-2), 3), init_scale=4.0
    ),
}


@pytest.mark.parametrize("name", list(_AIF))
@pytest.mark.parametrize("pdtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("gdtype", ["params", jnp.float32])
def test_apply_if_finite_compositions_on_low_precision_parameters(name, pdtype, gdtype):
    # optax.apply_if_finite's lax.cond needs the updates in the gradients' dtype and
    # the inner state's dtypes unchanged; a non-finite step is skipped.
    if gdtype == jnp.float32 and "(adam))" in name and "loss_scale" in name:
        pytest.skip("optax.adam promotes bfloat16 moments given float32 gradients (optax's own)")
    tx = _AIF[name]()
    params = {"w": jnp.ones((4, 4), pdtype)}
    gd = pdtype if gdtype == "params" else gdtype
    state = tx.init(params)
    step = jax.jit(tx.update)
    u, new = step({"w": jnp.full((4, 4), 0.5, gd)}, state, params)
    assert u["w"].dtype == gd
    assert jax.tree.structure(new) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert float(jnp.max(jnp.abs(u["w"].astype(jnp.float32)))) > 0
    u, _ = step({"w": jnp.full((4, 4), jnp.inf, gd)}, new, params)
    np.testing.assert_array_equal(np.asarray(u["w"], np.float32), 0.0)
