"""``explain`` on whole models and on third-party modules (Flax, Equinox): its
counts agree with the jaxpr and the HLO, its rows fit the terminal. The units
of explain are tested in tests/test_explain.py."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import eqns_run, ode_loss

import amp_jax
from amp_jax import amp


def _dot_flops_by_dtype(jaxpr):
    """An independent count: dot_general FLOPs per operand dtype, scan bodies x length."""
    acc = {}
    for e, _, times in eqns_run(jaxpr):
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            lhs, out = e.invars[0].aval, e.outvars[0].aval
            n = 2 * int(np.prod(out.shape)) * int(np.prod([lhs.shape[i] for i in lc]))
            d = str(lhs.dtype)
            acc[d] = acc.get(d, 0) + times * n
    return acc


def test_explain_demo_step_consistent_with_jaxpr_and_hlo():
    from amp_jax.demo import _model

    cfg = _model.Config(d_model=32, layers=1, heads=2, seq=16, batch=2)
    params = _model.init_params(jax.random.PRNGKey(0), cfg)
    x = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    ex = amp_jax.explain(_model.loss_fn, params, x, x, cfg.heads, policy="bfloat16", grad=True)
    loss = amp(_model.loss_fn, policy="bfloat16")
    grad_fn = jax.value_and_grad(lambda p: loss(p, x, x, cfg.heads))
    expected = _dot_flops_by_dtype(jax.make_jaxpr(grad_fn)(params).jaxpr)
    assert ex.summary.matmul_flops_by_dtype == expected
    assert ex.summary.matmul_flops_by_dtype.get("bfloat16", 0) > 0
    # dtype_report sees the same dot dtypes
    rows = amp_jax.dtype_report(grad_fn, params)
    report_dots = {r[1].split(",")[0] for r in rows if r[0] == "dot_general"}
    assert report_dots == set(expected)
    # the lowered StableHLO has as many bf16 dots as explain counts (one layer: scan length 1)
    hlo = jax.jit(grad_fn).lower(params).as_text()
    hlo_dots = re.findall(r"stablehlo\.dot_general.*?: \(tensor<[^>]*x(\w+)>", hlo)
    n_bf16 = sum(r.count for r in ex.rows if r.primitive == "dot_general" and r.dtype == "bfloat16")
    assert hlo_dots.count("bf16") == n_bf16 > 0


def test_explain_equinox_module():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.PRNGKey(0))
    ex = amp_jax.explain(lambda m, x: m(x), mlp, jnp.ones(8), grad=True)
    assert ex.summary.matmul_flops_by_dtype.get("bfloat16", 0) > 0
    assert ex.summary.casts_inserted > 0


def test_explain_rows_fit_120_columns_with_short_paths():
    # a model from a package (Flax): its source lines live in site-packages
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(
        nnx.Linear(64, 256, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(256, 64, rngs=nnx.Rngs(1))
    )

    def loss(model, x):
        with jax.named_scope("a_rather_long_scope_name_for_the_model_body"):
            return jnp.mean(model(x) ** 2)

    ex = amp_jax.explain(loss, model, jnp.ones((8, 64)), grad=True)
    lines = str(ex).splitlines()
    table = lines[: lines.index("")]
    assert max(map(len, table)) <= 120, max(table, key=len)
    assert not any("site-packages" in l or l.startswith("/") for l in table)
    assert any(l.startswith("flax/") for l in table)  # a package's path from the package on
    assert not any("amp_" in l for l in table)  # amp's own scope names only with verbose
    full = ex.format(verbose=True).splitlines()
    assert any("site-packages" in l for l in full) and max(map(len, full)) > 120
    assert len(ex.format(width=None).splitlines()[0]) <= max(map(len, full))


@pytest.mark.parametrize("wrap", [False, True], ids=["module", "amp_module"])
def test_explain_an_equinox_module_as_the_function(wrap):
    # the module is the function: its arrays are arguments, as amp(model) traces them
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(64, 64, key=jax.random.PRNGKey(0))
    ex = amp_jax.explain(amp(model) if wrap else model, jnp.ones((64,)))
    dots = {(r.dtype, r.reason) for r in ex.rows if r.primitive == "dot_general"}
    assert [d for d, _ in dots] == ["bfloat16"], dots
    assert "no amp decision" not in next(iter(dots))[1]


# --- every row's reason is the rule that gave it the dtype shown --------------------

#: explain's short names of primitives -> their names in dtype_report
_PRIMITIVE = {"convert": "convert_element_type", "barrier": "optimization_barrier"}
_STATED = re.compile(r"\bruns? in (bfloat16|float16|float32|float64)\b")
_FLOATS = {"bfloat16", "float16", "float32", "float64"}


def _stated(reason):
    """The dtype a reason says its op runs in, read independently of amp's code:
    ``runs in X``, or the compute dtype for a painting; None when it names none."""
    m = _STATED.search(reason)
    if m:
        return m.group(1)
    return "bfloat16" if "painting:" in reason else None


#: reasons that say amp did not lower an op (read independently of amp's code)
_NOT_LOWERED = (
    "kept in the carry's dtype",
    "explicit precision",
    "too small to pay",
    "no amp decision",
    "float64/complex operand",
    "decides control flow",
    "decides when a while loop stops",
    "a factorization or solve",
    "full_precision scope",
    "no low-precision kernel",
    "left as written",
)
_LOW = {"bfloat16", "float16"}


def _contradiction(dtypes, reason, primitive=None):
    """What is wrong with a row that ran in ``dtypes`` for ``reason``, or None.
    A matmul row (``primitive``) whose operands are low must say why they are
    low, and one whose operands are float32 must not say they run low."""
    floats = [d for d in dtypes if d in _FLOATS]
    if floats and "no floating operand" in reason:
        return "a float op said to have no floating operand"
    if primitive in ("dot_general", "conv_general_dilated") and floats:
        # the part of the reason about the operands (before "; writes float32: ...")
        operands = reason.removeprefix("backward of: ").split("; writes float32", 1)[0]
        if set(floats) & _LOW and any(p in operands for p in _NOT_LOWERED):
            return "low operands said not to be lowered"
        if set(floats) & _LOW and "writes float32" in reason and "runs in" not in operands:
            return "low operands, the reason only about the result"
        if not set(floats) & _LOW and re.search(r"runs in b?float16", reason):
            return "float32 operands said to run low"
    stated = _stated(reason)
    if floats and stated is not None and stated not in floats:
        return f"said to run in {stated}"
    return None


def _library_models():
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    linen = pytest.importorskip("flax.linen")
    key = jax.random.PRNGKey(0)
    x = jnp.ones((16, 32))
    mlp = eqx.nn.MLP(32, 10, 64, 2, key=key)  # relu: a custom_jvp between the matmuls
    seq = nnx.Sequential(
        nnx.Linear(32, 64, rngs=nnx.Rngs(0)),
        nnx.gelu,
        nnx.LayerNorm(64, rngs=nnx.Rngs(0)),
        nnx.Linear(64, 10, rngs=nnx.Rngs(1)),
    )

    class Mlp(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(10)(linen.LayerNorm()(jax.nn.silu(linen.Dense(64)(x))))

    linen_params = Mlp().init(key, x)
    return [
        ("eqx.nn.MLP", lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), (mlp, x)),
        ("nnx.Sequential", lambda m, x: jnp.mean(m(x) ** 2), (seq, x)),
        ("linen", lambda p, x: jnp.mean(Mlp().apply(p, x) ** 2), (linen_params, x)),
    ]


def _loop_programs():
    """A scan RNN, a fori_loop fixed point and a diffrax adaptive solve (issue 56):
    their matmuls run low inside loops, carried by the loop or inside a library's
    custom derivatives."""
    pytest.importorskip("diffrax")
    k = jax.random.split(jax.random.PRNGKey(0), 4)

    def rnn(p, xs):
        wx, wh, wo = p

        def step(h, x):
            h = jnp.tanh(x @ wx + h @ wh)
            return h, h @ wo

        h, ys = jax.lax.scan(step, jnp.zeros((16, 128)), xs)
        return jnp.mean(ys**2) + jnp.mean(h**2)

    def fixed_point(w, x):
        z = jax.lax.fori_loop(0, 20, lambda i, z: jnp.tanh(z @ w + x), jnp.zeros_like(x))
        return jnp.mean(z**2)

    ode = ode_loss(lambda a, b: a @ b, "Dopri5")

    n = jax.random.normal
    return [
        (
            "rnn",
            rnn,
            ((n(k[0], (64, 128)), n(k[1], (128, 128)), n(k[2], (128, 32))), n(k[3], (10, 16, 64))),
        ),
        ("fixed_point", fixed_point, (n(k[0], (128, 128)) / 24, n(k[1], (32, 128)))),
        ("diffrax", ode, (n(k[0], (32, 64)) / 6, n(k[1], (64, 32)) / 8, n(k[2], (16, 32)))),
    ]


_LOOPS = ("rnn", "fixed_point", "diffrax")
#: what ``inside`` may not show: wrappers JAX adds that the user did not write
_WRAPPERS = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "closed_call"}


def _workload_models():
    from workloads import models

    key = jax.random.PRNGKey(0)
    out = []
    for make in (models.mlp, models.gpt, models.cnn):
        m = make(small=True)
        out.append((m.name, m.loss, (m.init(key), *m.batch(key))))
    return out


def test_every_reason_agrees_with_its_dtype_on_models():
    """explain and dtype_report over the workloads' models, three library models and
    three loops (`_loop_programs`): no row's reason names a dtype other than the one
    the row ran in, no matmul row's reason disagrees with its operands' dtypes
    (issue 56: a bf16 dot said "kept in the carry's dtype" or "no amp decision"), and
    ``inside`` shows no wrapper JAX added; on the models also: dtype_report's
    ``why`` is filled for every float op amp decided; amp's own barriers are folded
    into the row of the op they serve; the byte line says what the extra bytes are."""
    bad = []
    for name, loss, args in [*_workload_models(), *_library_models(), *_loop_programs()]:
        ex = amp_jax.explain(loss, *args, grad=True)
        for r in ex.all_rows:
            problem = _contradiction(r.dtype.split(","), r.reason, r.primitive)
            if "->" not in r.dtype and problem:
                bad.append(f"{name} explain {r.primitive} ({r.dtype}): {problem}: {r.reason}")
        if name in _LOOPS:
            low = [r for r in ex.rows if r.primitive == "dot_general" and r.dtype == "bfloat16"]
            assert low, name
        else:
            _check_model_summary(name, ex)
        said = collections.defaultdict(set)  # explain's reasons, by primitive
        for r in ex.all_rows:
            said[_PRIMITIVE.get(r.primitive, r.primitive)].add(r.reason)
        for prim, ins, outs, inside, _, why in amp_jax.dtype_report(
            loss, *args, grad=True, policy="bfloat16"
        ):
            if set(inside.split("/")) & _WRAPPERS:
                bad.append(f"{name} dtype_report {prim}: inside shows JAX's wrappers: {inside}")
            ran = ins.split(",") if any(d in _FLOATS for d in ins.split(",")) else outs.split(",")
            if prim != "convert_element_type" and (problem := _contradiction(ran, why, prim)):
                bad.append(f"{name} dtype_report {prim} ({ins} -> {outs}): {problem}: {why}")
            if name in _LOOPS:  # (below: what the models hold; the loops: their dot rows)
                continue
            float_cast = prim == "convert_element_type" and ins in _FLOATS and outs in _FLOATS
            if float_cast and not why.startswith("cast"):
                bad.append(f"{name} dtype_report cast ({ins} -> {outs}) said to run: {why}")
            if any(d in _FLOATS for d in ran) and not why:
                bad.append(f"{name} dtype_report {prim} ({ins} -> {outs}): no why")
            # the two tables give an op the same reason
            if why and why not in said[prim]:
                bad.append(f"{name} dtype_report {prim} ({ins} -> {outs}) not in explain: {why}")
            if prim == "optimization_barrier" and why.startswith("derived by JAX"):
                bad.append(f"{name} dtype_report: amp's own barrier said derived by JAX: {why}")
    assert not bad, "\n".join(bad)


def _check_model_summary(name, ex):
    """A model's explain: amp's barriers folded into the rows of the ops they
    serve, and the byte line says what the extra bytes are."""
    assert not any(r.primitive == "optimization_barrier" for r in ex.rows), name
    assert any(r.primitive == "optimization_barrier" for r in ex.all_rows), name
    assert sum(r.bytes for r in ex.rows) == sum(r.bytes for r in ex.all_rows), name
    summary = "\n".join(ex.summary_lines())
    assert "the casts amp inserted +" in summary and "barriers and layout copies +" in summary
    assert ex.summary.cast_bytes > 0 and ex.summary.own_bytes > 0, name


@pytest.mark.usefixtures("low_elementwise")  # (a painted-low add: XLA:CPU keeps it float32)
def test_the_equinox_mlp_rows_say_what_ran():
    # the case a user met: a bias add promoted to float32 by its float32 bias said
    # it ran low; relu's max said bfloat16 on a float32 row
    (name, loss, args), *_ = _library_models()
    ex = amp_jax.explain(loss, *args, grad=True)
    (add,) = [r for r in ex.rows if r.primitive == "add" and not r.backward]
    assert add.dtype == "float32" and add.reason.startswith("runs in float32: painted bfloat16")
    for r in ex.rows:
        if r.primitive == "max" and not r.backward:
            assert "no amp decision" not in r.reason
            assert r.dtype == "bfloat16" or "unused" in r.reason, r


def test_a_vmapped_matvec_counts_the_dots_that_run_at_their_own_line():
    # Equinox's Linear is a per-example matvec under vmap: amp writes the dot with
    # its operands swapped at the transpose vmap adds where the bias add reads it
    # (the next line); the dot as written is left for XLA to remove
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(32, 10, 64, 2, key=jax.random.PRNGKey(0))
    x = jnp.ones((16, 32))
    params, static = eqx.partition(mlp, eqx.is_array)

    def loss(p, x):
        return jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2)

    ex = amp_jax.explain(loss, params, x, grad=True)
    # the FLOPs of the dots that run: as many as the float32 program's
    expected = sum(_dot_flops_by_dtype(jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr).values())
    assert sum(ex.summary.matmul_flops_by_dtype.values()) == expected
    dots = [r for r in ex.all_rows if r.primitive == "dot_general"]
    f32 = amp_jax.explain(loss, params, x, grad=True, policy="float32")  # (the program as is)
    written = {r.where for r in f32.all_rows if r.primitive == "dot_general"}
    assert len(written) == 1 and {r.where for r in dots} == written, dots
    for r in dots:  # the dots XLA removes: said so, no FLOPs
        assert ("unused" in r.reason) == (r.flops == 0), r
    assert any("unused" in r.reason for r in dots)
