"""``dtype_report`` and ``format_dtype_report``: which primitives ran in which
dtypes, where, how often, and why amp kept an op in its original precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import amp_jax
from amp_jax import amp, dtype_report, format_dtype_report, full_precision

# toy shapes: every matmul lowered; float32 matmul results on every backend
POLICY = amp_jax.Policy(min_low_contraction=0, min_low_flops=0, allow_outputs="float32")
X, W = jnp.ones((4, 8)), jnp.full((8, 8), 0.1)


def _scanned(x, w):
    h = x @ w

    def body(c, _):
        return jnp.tanh(c @ w), None

    c, _ = jax.lax.scan(body, h, None, length=3)
    return jnp.sum(full_precision(lambda a: a @ w)(c))


def test_rows_give_dtypes_place_count_and_reason():
    rows = dtype_report(_scanned, X, W, policy=POLICY)
    assert all(len(r) == 6 and isinstance(r[4], int) for r in rows)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)  # by primitive name
    dots = [r for r in rows if r[0] == "dot_general"]
    low = [r for r in dots if r[1] == "bfloat16,bfloat16"]
    assert {r[2] for r in low} == {"float32"}  # (allow_outputs="float32")
    assert sum(r[4] for r in low) == 2  # the dot before the scan, and the one in its body
    assert any("scan" in r[3] for r in low) and any("scan" not in r[3] for r in low)
    # lowered: the rule that lowered them (tests/behaviour/test_explain_models.py checks every row)
    (outside,) = [r for r in low if "scan" not in r[3]]
    assert outside[5] == "allow class: runs in bfloat16 (float32 accumulation)"
    (inside,) = [r for r in low if "scan" in r[3]]  # bf16 operands, the carry's float32 output
    assert inside[5] == (
        "allow class: runs in bfloat16 (float32 accumulation); writes float32: "
        "computes a loop-carried value: kept in the carry's dtype"
    )
    (kept,) = [r for r in dots if r[1] == "float32,float32"]
    assert kept[5] == "full_precision scope" and kept[4] == 1
    casts = [r for r in rows if r[0] == "convert_element_type" and r[2] == "bfloat16"]
    assert casts and all(r[1] == "float32" for r in casts)


def test_a_kept_op_says_why():
    # 2x2 is too small to pay (the default thresholds)
    rows = dtype_report(lambda a, b: a @ b, jnp.ones((2, 2)), jnp.ones((2, 2)), policy="bfloat16")
    (dot,) = [r for r in rows if r[0] == "dot_general"]
    assert dot[1] == "float32,float32" and dot[5].startswith("too small to pay")


def test_grad_reports_the_backward_pass_and_any_function_as_it_is():
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    fwd = dtype_report(f, W, X, policy=POLICY)
    bwd = dtype_report(f, W, X, policy=POLICY, grad=True)
    n = lambda rows: sum(r[4] for r in rows if r[0] == "dot_general")  # noqa: E731
    assert n(fwd) == 1 and n(bwd) == 2  # (x @ w, and dw: x is not differentiated)
    assert {r[1] for r in bwd if r[0] == "dot_general"} == {"bfloat16,bfloat16"}
    # a function that is not an amp function, given no policy: traced as it is
    traced = dtype_report(jax.grad(amp(f, policy=POLICY)), W, X)
    assert n(traced) == 2 and {r[1] for r in traced if r[0] == "dot_general"} == {
        "bfloat16,bfloat16"
    }
    plain = dtype_report(f, W, X)
    assert {r[1] for r in plain if r[0] == "dot_general"} == {"float32,float32"}


def test_format_aligns_every_column_under_its_header():
    rows = dtype_report(_scanned, X, W, policy=POLICY)
    assert ("dot_general", "bfloat16,bfloat16") in {r[:2] for r in rows}
    lines = format_dtype_report(rows).splitlines()
    assert len(lines) == len(rows) + 1
    header = lines[0]
    assert header.split() == ["primitive", "inputs", "outputs", "inside", "count", "why"]
    for name in ("inputs", "outputs", "inside", "count"):
        col = header.index(name)
        assert all(line[col - 2 : col] == "  " and line[col] != " " for line in lines[1:]), name
    assert all(line == line.rstrip() for line in lines)
    for line, row in zip(lines[1:], rows):
        assert line.split()[:5] == [*row[:4], str(row[4])]
    (kept,) = [line for line in lines if "full_precision scope" in line]
    assert kept.endswith("full_precision scope")


def test_format_takes_rows_without_a_reason():
    text = format_dtype_report([("tanh", "bfloat16", "bfloat16", "-", 3)])
    assert text.splitlines()[1].split() == ["tanh", "bfloat16", "bfloat16", "-", "3"]
