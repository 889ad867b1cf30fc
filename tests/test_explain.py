"""``explain``: the rows and reasons of a program's ops, the summary, the text
(fitted to 120 columns unless verbose) and HTML views."""

import functools

import jax
import jax.numpy as jnp
import pytest
from _util import marked_line, shown_path

import amp_jax
from amp_jax import amp, full_precision

BF16_F32OUT = amp_jax.Policy(jnp.bfloat16, allow_outputs="float32")
# how explain and first_nonfinite name this file
THIS = shown_path(__file__)
_line = functools.partial(marked_line, __file__)


def small(w, x):
    y = x @ w  # MARK-DOT
    z = jnp.exp(y)  # MARK-EXP
    return jnp.sum(full_precision(lambda a: a @ w)(z))  # MARK-FP


def test_explain_reasons_dtypes_and_casts():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    ex = amp_jax.explain(small, w, x, policy=BF16_F32OUT)
    by = {(int(r.where.split(":")[1]), r.primitive): r for r in ex.rows if r.where.startswith(THIS)}
    dot = by[(_line("MARK-DOT"), "dot_general")]
    assert (
        dot.dtype == "bfloat16"
        and dot.reason.startswith("allow class")
        and dot.flops == 2 * 4 * 8 * 8
    )
    exp = by[(_line("MARK-EXP"), "exp")]
    assert exp.dtype == "float32" and exp.reason.startswith("deny class")
    fp = by[(_line("MARK-FP"), "dot_general")]
    assert fp.dtype == "float32" and "full_precision" in fp.reason
    casts = by[(_line("MARK-DOT"), "convert_element_type")]
    assert (
        casts.dtype == "float32->bfloat16"
        and casts.reason == "cast inserted by amp"
        and casts.count == 2
    )
    s = ex.summary
    assert s.casts_inserted == 2 and s.matmul_flops_by_dtype == {"bfloat16": 512, "float32": 512}
    assert s.low_matmul_flop_share == 0.5
    text = str(ex)
    assert "allow: runs in bfloat16" in text and "50.0% of matmul/conv FLOPs" in text
    assert "allow class: runs in bfloat16" in ex.format(verbose=True)
    html = ex._repr_html_()
    assert "<table>" in html and "cast inserted by amp" in html
    ident = amp_jax.explain(small, w, x, policy="float32")
    assert ident.summary.casts_inserted == 0 and ident.summary.low_flop_share == 0.0
    assert ident.summary.bytes_saved == 0


def test_explain_scan_multiplies_and_grad_has_backward_rows():
    def f(w, xs):
        def body(c, x):
            with jax.named_scope("layer"):
                return jnp.tanh(c @ w) + x, None

        c, _ = jax.lax.scan(body, xs[0], xs)
        return jnp.sum(c)

    w = jnp.ones((8, 8))
    one = amp_jax.explain(f, w, jnp.ones((1, 4, 8)))
    five = amp_jax.explain(f, w, jnp.ones((5, 4, 8)))
    assert (
        five.summary.matmul_flops_by_dtype["bfloat16"]
        == 5 * one.summary.matmul_flops_by_dtype["bfloat16"]
    )
    g = amp_jax.explain(f, w, jnp.ones((5, 4, 8)), grad=True)
    dots = [r for r in g.rows if r.primitive == "dot_general"]
    assert {r.backward for r in dots} == {False, True}
    # (``c @ w`` computes the scan's carry: it writes float32, under amp's keep scope)
    assert all(r.scope.split("/")[0] == "layer" and r.dtype == "bfloat16" for r in dots)
    # each backward row gives its forward's reason (the same op, differentiated)
    forward = {r.reason for r in dots if not r.backward}
    assert {r.reason for r in dots if r.backward} == {f"backward of: {x}" for x in forward}
    with pytest.raises(TypeError, match="grad must be"):
        amp_jax.explain(f, w, jnp.ones((5, 4, 8)), grad="yes")


def _dense(w, x):
    return x @ w  # one source line for both layers, as a library layer's is


def test_explain_tells_one_source_line_apart_by_named_scope():
    """A layer called inside and outside a ``full_precision_scopes`` scope: the two
    dots share a source line and differ only by scope (a Flax Dense installed in a
    virtualenv, whose site-packages JAX does not hide from tracebacks)."""

    def f(w1, w2, x):
        h = jnp.tanh(_dense(w1, x))
        with jax.named_scope("head"):
            return jnp.sum(_dense(w2, h))

    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((8, 64))
    policy = amp_jax.Policy(full_precision_scopes=("head",), allow_outputs="float32")
    for grad in (False, True):
        ex = amp_jax.explain(f, w, w, x, policy=policy, grad=grad)
        dots = [r for r in ex.rows if r.primitive == "dot_general"]
        assert len({r.where for r in dots}) == 1, dots  # one line, told apart by scope
        head = [r for r in dots if r.scope.startswith("head")]
        body = [r for r in dots if not r.scope.startswith("head")]
        assert head and body, dots
        assert all(r.dtype == "float32" and "'head'" in r.reason for r in head), head
        assert all(r.dtype == "bfloat16" and "allow class" in r.reason for r in body), body


def _aux_loss(params, x):
    h = x @ params["w"]
    return jnp.mean(h @ params["w"]), {"names": ["drop"], "mean": jnp.mean(h)}


_AUX_ARGS = ({"w": jnp.ones((32, 32))}, jnp.ones((16, 32)))


def test_explain_and_dtype_report_take_has_aux_and_the_same_options():
    ex = amp_jax.explain(_aux_loss, *_AUX_ARGS, policy="float16", grad=True, has_aux=True)
    dots = {(r.dtype, r.backward) for r in ex.rows if r.primitive == "dot_general"}
    assert dots == {("float16", False), ("float16", True)}
    rows = amp_jax.dtype_report(_aux_loss, *_AUX_ARGS, policy="float16", grad=True, has_aux=True)
    assert {r[1] for r in rows if r[0] == "dot_general"} == {"float16,float16"}
    assert sum(r[4] for r in rows if r[0] == "dot_general") >= 5  # 2 forward, the backward
    # an amp function and the raw function with policy= report the same
    f = lambda a, b: a @ b
    a = jnp.ones((64, 64))
    assert amp_jax.dtype_report(f, a, a, policy="bfloat16") == amp_jax.dtype_report(amp(f), a, a)


def test_a_pair_without_has_aux_names_it():
    with pytest.raises(TypeError, match="has_aux=True"):
        amp_jax.explain(_aux_loss, *_AUX_ARGS, grad=True)


def test_explain_says_moved_more_not_negative_savings():
    f = lambda a, b: jnp.sum(a @ b)
    text = str(amp_jax.explain(f, jnp.ones((64, 8)), jnp.ones((8, 64)), policy="float16"))
    assert "saved -" not in text
    assert "more)" in text or "saved " in text
    ex = amp_jax.explain(f, jnp.ones((64, 8)), jnp.ones((8, 64)), policy="float16")
    if ex.summary.bytes_saved < 0:
        assert "B more)" in text


def _compact_reason(reason):
    return reason.replace(" class: ", ": ")  # (the default view's shorter words)


def _deep(w, x):
    with jax.named_scope("a_rather_long_scope_name_for_the_model_body"):
        with jax.named_scope("and_a_long_block_name_inside_it"):
            return jnp.sum(jnp.tanh(x @ w) ** 2)


def test_the_default_text_fits_120_columns_and_verbose_shows_everything():
    ex = amp_jax.explain(_deep, jnp.ones((64, 64)), jnp.ones((8, 64)), grad=True)
    assert {r.dtype for r in ex.rows if r.primitive == "dot_general"} == {"bfloat16"}
    lines = str(ex).splitlines()
    assert str(ex) == ex.format()
    table = lines[: lines.index("")]
    starts = [line for line in table if not line.startswith(" ")]  # a reason wraps below its row
    assert table[0].split()[:2] == ["source", "line"] and len(starts) == len(ex.rows) + 1
    assert max(map(len, table)) <= 120, max(table, key=len)
    # every reason whole in the default view too: its words, wrapped under its column
    col = table[0].index("reason")
    words = " ".join(line[col:].strip() for line in table[1:])
    for r in ex.rows:
        assert " ".join(_compact_reason(r.reason).split()) in words, r.reason
    assert not any("amp_" in line for line in table)  # amp's own scope names only with verbose
    assert lines[lines.index("") + 1].startswith("policy bfloat16: ")  # then the summary
    full = ex.format(verbose=True).splitlines()
    assert max(map(len, full)) > 120
    assert any("a_rather_long_scope_name_for_the_model_body/and_a_long" in line for line in full)
    for r in ex.rows:  # every reason whole
        assert any(line.rstrip().endswith(r.reason) for line in full), r.reason
    loose = ex.format(width=None).splitlines()  # nothing cut
    assert max(map(len, loose[: loose.index("")])) > 120


def test_format_max_rows_and_min_flops():
    ex = amp_jax.explain(_deep, jnp.ones((64, 64)), jnp.ones((8, 64)), grad=True)
    assert len(ex.rows) > 3 and ex.summary.low_matmul_flop_share == 1.0
    text = [line for line in ex.format(max_rows=2).splitlines() if not line.startswith(" ")]
    assert text[3] == f"... {len(ex.rows) - 2} more rows (format(max_rows=None) shows all)"
    big = [line for line in ex.format(max_rows=None, min_flops=1).splitlines()]
    big = [line for line in big[: big.index("")] if not line.startswith(" ")]
    assert len(big) == 1 + sum(r.flops >= 1 for r in ex.rows)
    assert [r.flops for r in ex.rows] == sorted((r.flops for r in ex.rows), reverse=True)
    assert repr(ex).startswith(f"Explanation({len(ex.rows)} rows, policy='bfloat16'")


@pytest.mark.parametrize("grad", [False, True])
def test_explain_traces_the_function_once_for_amp(grad):
    """The reasons come from the plan amp made while tracing the program it
    explains: ``fn`` runs twice (amp's program and the original), not a third
    time for a plan of its own -- the same rows as that plan gives."""
    calls = []

    def f(w, x):
        calls.append(1)
        return small(w, x)

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    ex = amp_jax.explain(f, w, x, policy=BF16_F32OUT, grad=grad)
    assert len(calls) == 2
    assert ex.rows == amp_jax.explain(small, w, x, policy=BF16_F32OUT, grad=grad).rows


def _first_dot(a, b):
    return jnp.sum(a @ b)


def _second_dot(a, b):
    return jnp.sum(jnp.tanh(a) @ b)


def test_explain_names_each_call_site_of_a_dot_traced_once():
    # amp's dot is traced once per signature and reused at every call site with
    # the same types (JAX's jit cache): rows still name their own source line
    a, b = jnp.ones((8, 64)), jnp.ones((64, 64))
    policy = amp_jax.Policy(allow_outputs="float32")
    for grad in (False, True):
        amp_jax.explain(_first_dot, a, b, policy=policy, grad=grad)
        ex = amp_jax.explain(_second_dot, a, b, policy=policy, grad=grad)
        dots = [r for r in ex.rows if r.primitive == "dot_general"]
        assert dots and all("(_second_dot)" in r.where for r in dots), dots
        assert all("no amp decision" not in r.reason for r in dots), dots


def _scanned_dot(w, xs):
    def body(c, x):
        return jnp.tanh(c @ w) + x, None

    return jnp.sum(jax.lax.scan(body, xs[0], xs)[0])


def test_explain_names_the_call_site_of_a_dot_traced_once_inside_a_scan():
    # JAX differentiates a scan body as a jaxpr, whose eqns keep the source
    # lines of the traces amp's jitted dot reuses: those are of their own line
    w, xs = jnp.ones((8, 8)), jnp.ones((5, 4, 8))
    amp_jax.explain(_first_dot, xs[0], w, grad=True)  # the same dot, another line
    ex = amp_jax.explain(_scanned_dot, w, xs, grad=True)
    dots = [r for r in ex.rows if r.primitive == "dot_general"]
    assert {r.backward for r in dots} == {False, True}
    assert all("(_scanned_dot.<locals>.body)" in r.where or "(body)" in r.where for r in dots), dots
    assert all("no amp decision" not in r.reason for r in dots), dots
