"""Helpers shared by the tests: walking jaxprs for structure checks."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core


def _open(j):
    return j.jaxpr if hasattr(j, "jaxpr") and not isinstance(j, jex_core.Jaxpr) else j


def eqns(jaxpr, path=()):
    """Yields (eqn, path of enclosing primitive names) for every eqn, recursively."""
    for e, p, _ in eqns_run(jaxpr, path):
        yield e, p


def eqns_run(jaxpr, path=(), times=1):
    """Yields (eqn, path, times it runs) for every eqn, recursively: the one
    walker of the tests (a ``scan`` body runs ``length`` times)."""
    for e in _open(jaxpr).eqns:
        yield e, path, times
        inner = times * (e.params["length"] if e.primitive.name == "scan" else 1)
        for sub in jex_core.jaxprs_in_params(e.params):
            yield from eqns_run(sub, path + (e.primitive.name,), inner)


def rel(a, b):
    """The relative error ``|a - b| / |b|`` (Frobenius norms over all leaves of
    two pytrees of arrays), in float64: the one formula of the tests."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(
        float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
        for x, y in zip(la, lb)
    )
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)
    return num**0.5 / (den**0.5 + 1e-12)


def prim_dtypes(jaxpr, name):
    """[(input dtypes, output dtypes, path)] of every ``name`` eqn."""
    return [
        (
            tuple(np.dtype(v.aval.dtype) for v in e.invars),
            tuple(np.dtype(v.aval.dtype) for v in e.outvars),
            p,
        )
        for e, p in eqns(jaxpr)
        if e.primitive.name == name
    ]


BF16 = np.dtype(jax.numpy.bfloat16)
F16 = np.dtype(jax.numpy.float16)
F32 = np.dtype(np.float32)


def _tiny(e):
    """A dot_general with a contraction or a result of fewer than 8 elements (amp
    keeps those float32, and JAX's transposes of them stay float32 too)."""
    (lc, _), _ = e.params["dimension_numbers"]
    k = int(np.prod([e.invars[0].aval.shape[d] for d in lc]))
    return k < 8 or int(np.prod(e.outvars[0].aval.shape)) < 8


def check_dots_low(jaxpr, min_low=1):
    """Every dot_general has bf16 operands, except batched ones on CPU (float32
    there); tiny ones (see ``_tiny``) are not judged."""
    n_low = 0
    for e, _ in eqns(jaxpr):
        if e.primitive.name != "dot_general":
            continue
        if _tiny(e):
            continue  # (a tiny forward dot stays float32; a big one's transposes may be tiny)
        prec = e.params.get("precision")
        if any(
            p is not None and getattr(p, "name", str(p)) != "DEFAULT"
            for p in (prec if isinstance(prec, tuple) else (prec,))
        ):
            continue  # an explicit precision (e.g. inside jnp.linalg on GPU) stays as asked
        ins = tuple(np.dtype(v.aval.dtype) for v in e.invars)
        batched = bool(e.params["dimension_numbers"][1][0])
        if batched and jax.default_backend() == "cpu":
            assert ins == (F32, F32), ins
        else:
            assert ins == (BF16, BF16), ins
            n_low += 1
    assert n_low >= min_low, n_low


def allow_out_dtype(policy="bfloat16"):
    """The dtype amp's dots and convs write on this backend (float32 on CPU, bf16 on GPU)."""
    from amp_jax import get_policy
    from amp_jax._src import backends
    from amp_jax._src.rules.dots import outputs

    return np.dtype(outputs.allow_output_dtype(get_policy(policy), backends.current()))


def _open_jaxpr(j):
    return j.jaxpr if hasattr(j, "jaxpr") else j


def _computed_from_low(body, outs) -> list[str]:
    """Float32 outputs ``outs`` of ``body`` computed from a bf16 value: walks
    back through first-order ops to the matmuls (which must write float32),
    into ``cond`` branches and ``jit`` bodies."""
    body = _open_jaxpr(body)
    producer = {v: q for q in body.eqns for v in q.outvars}
    todo = [body.outvars[k] for k in outs]
    todo = [v for v in todo if np.dtype(v.aval.dtype) == F32]
    seen, bad = set(), []
    while todo:
        v = todo.pop()
        if isinstance(v, jax.extend.core.Literal) or v in seen:
            continue
        seen.add(v)
        if np.dtype(v.aval.dtype) == BF16:
            bad.append(f"carry computed from a bf16 value ({producer.get(v)})")
            continue
        q = producer.get(v)
        if q is None or q.primitive.name in ("dot_general", "conv_general_dilated"):
            continue
        k = q.outvars.index(v)
        if q.primitive.name == "cond":
            for br in q.params["branches"]:
                bad += _computed_from_low(br, [k])
        elif q.primitive.name in ("jit", "pjit"):
            bad += _computed_from_low(q.params["jaxpr"], [k])
        elif not any(True for _ in jax.extend.core.jaxprs_in_params(q.params)):
            todo.extend(q.invars)
    return bad


def carries_are_computed_in_their_dtype(jaxpr) -> list[str]:
    """Problems with the loops of the rewritten ``jaxpr``: a float32 carry of
    a ``scan``/``while`` body computed from a bf16 value."""
    bad = []
    for e, _ in eqns(jaxpr):
        if e.primitive.name == "scan":
            p = e.params
            n = p["num_carry"] if "num_carry" in p else len(p["ft_in"].unpack()[1])
            bad += _computed_from_low(p["jaxpr"], range(n))
        elif e.primitive.name == "while":
            bad += _computed_from_low(e.params["body_jaxpr"], range(len(e.outvars)))
    return bad


#: primitives that add values together (a sum over an axis, a window, the
#: positions of a scatter)
SUMS = (
    "reduce_sum",
    "cumsum",
    "reduce_window_sum",
    "scatter-add",
    "scatter_add",
    "select_and_scatter_add",
)


def _summed(e) -> int:
    """How many values ``e`` (a primitive of ``SUMS``) may add into one (a
    bound: 2 where the indices decide)."""
    shape = e.invars[0].aval.shape
    name = e.primitive.name
    if name == "reduce_sum":
        return int(np.prod([shape[a] for a in e.params["axes"]]))
    if name == "cumsum":
        return int(shape[e.params["axis"]])
    if name == "reduce_window_sum":
        return int(np.prod(e.params["window_dimensions"]))
    return 2


def low_sums(jaxpr):
    """[(primitive, operand aval)] of the eqns of ``jaxpr`` (recursively) that
    add two or more compute-dtype (bf16/f16) values together."""
    return [
        (e.primitive.name, str(e.invars[0].aval))
        for e, _ in eqns(jaxpr)
        if e.primitive.name in SUMS
        and any(np.dtype(getattr(v.aval, "dtype", np.int32)) in (BF16, F16) for v in e.invars)
        and _summed(e) > 1
    ]


def shown_path(file: str) -> str:
    """How amp's diagnostics (``explain`` rows, ``first_nonfinite``) name ``file``:
    relative to the working directory when it lies below it."""
    return os.path.relpath(file) if file.startswith(os.getcwd() + os.sep) else file


def marked_line(file: str, marker: str) -> int:
    """1-based number of the one line of ``file`` that holds ``marker`` (as a
    comment such as ``# MARK-DOT``; lines that name it in quotes do not count)."""
    lines = pathlib.Path(file).read_text().splitlines()
    quoted = (f'"{marker}"', f"'{marker}'")
    (n,) = [i + 1 for i, t in enumerate(lines) if marker in t and not any(q in t for q in quoted)]
    return n


def hand_bf16_matmul(a, b):
    """A matmul with its operands cast to bf16 by hand (as Flax ``dtype=`` does),
    accumulated in float32: the hand-cast oracle amp is compared with."""
    return jax.numpy.matmul(
        a.astype(jax.numpy.bfloat16),
        b.astype(jax.numpy.bfloat16),
        preferred_element_type=jax.numpy.float32,
    )


@contextlib.contextmanager
def low_elementwise() -> Iterator[Any]:
    """Plans inside the block as a GPU or TPU does: ``follow`` ops between two
    low ops painted in the compute dtype (``Backend.low_elementwise``), which
    XLA:CPU's record keeps float32. For tests of the painting itself on CPU."""
    from amp_jax._src import backends

    record = dataclasses.replace(backends.current(), low_elementwise=True)
    with backends.use(record):
        yield record


def ode_loss(mm, solver: str = "Tsit5", adjoint=None):
    """A diffrax adaptive solve (PIDController) of ``y' = tanh(mm(tanh(mm(y, w1)), w2))``
    from ``y0`` over [0, 1], as ``loss(w1, w2, y0) = sum(y(1) ** 2)``; ``mm``: the
    matmul (plain, or cast by hand), ``solver``: a diffrax solver's name."""
    import diffrax

    def loss(w1, w2, y0):
        def vf(t, y, args):
            return jnp.tanh(mm(jnp.tanh(mm(y, args[0])), args[1]))

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vf),
            getattr(diffrax, solver)(),
            0.0,
            1.0,
            0.1,
            y0,
            args=(w1, w2),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
            max_steps=64,
            **({} if adjoint is None else {"adjoint": adjoint}),
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return loss
