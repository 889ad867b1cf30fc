"""Fingerprints of what amp produces, to prove a refactor changed nothing.

    python -m benchmarks.plan_hash --write build/plan_hash.json   # before the change
    python -m benchmarks.plan_hash --check build/plan_hash.json   # after: exit 1 on any change

For each case (workloads/models.py's models under the policies that exercise
every rule family: bfloat16, float16, XLA attention, float8 tensor- and
row-wise, a backend-unaware policy) it hashes:

* ``hlo``: the optimized HLO of ``jax.jit(jax.value_and_grad(amp(loss)))``,
  with source-line metadata stripped (a moved function changes its line, not
  the program);
* ``jaxpr``: the ``jax.make_jaxpr`` of the same, which names every dtype and
  cast amp inserted;
* ``explain``: ``str(amp_jax.explain(loss, ..., grad=True))``;
* ``report``: ``amp_jax.format_dtype_report(amp_jax.dtype_report(...))``.

The hashes depend on the JAX version and on the CPU (amp's plan reads the
backend's kernels), so compare runs on one machine and one JAX: write the
baseline on the commit before the change, check on the commit after. With
``--check`` every differing entry is printed; ``--dump DIR`` also writes the
texts, to diff them.

``--backend gpu`` plans for the GPU's `Backend` record (``backends.backend_for
("gpu")``, injected with ``backends.use``) on this CPU: a ``plan`` entry (the
plan tree of the loss) and the jaxpr, explain and report entries lowered here
(or the error lowering raised: a cuDNN attention needs a GPU); no ``hlo``
(XLA:CPU compiling a program planned for a GPU says nothing of the GPU's).
Without a GPU this is how a change is shown to leave GPU plans alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

import jax

import amp_jax
from amp_jax import Policy, amp
from amp_jax._src import backends, planning, plans
from amp_jax._src.context import Context
from workloads.models import cnn, gpt, gpt_fp8, mlp


def _cases() -> list[tuple[str, Any, Any, dict[str, Any]]]:
    return [
        ("mlp", mlp(small=True), "bfloat16", {}),
        ("gpt", gpt(small=True), "bfloat16", {}),
        ("gpt_f16", gpt(small=True), "float16", {}),
        ("gpt_xla_attn", gpt(small=True), "bfloat16", {"attention": "xla"}),
        ("cnn", cnn(small=True), "bfloat16", {}),
        ("cnn_f16", cnn(small=True), "float16", {}),
        ("gpt_fp8", gpt_fp8(small=True), "float8", {}),
        ("gpt_fp8_row", gpt_fp8(small=True), "float8_rowwise", {}),
        ("mlp_noaware", mlp(small=True), Policy("bfloat16", backend_aware=False), {}),
        ("cnn_noaware", cnn(small=True), Policy("bfloat16", backend_aware=False), {}),
    ]


def _strip(hlo: str) -> str:
    """``hlo`` without its source positions: the ops' metadata, and the tables of
    file names, function names, file locations and stack frames that name the
    files by absolute path (a checkout elsewhere, or a function moved, changes
    them, not the program)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    return re.sub(
        r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:\d+ .*\n)*\n?",
        "",
        hlo,
        flags=re.M,
    )


def texts(only: str | None = None, backend: str | None = None) -> dict[str, str]:
    """Every case's texts, keyed ``case.kind``; ``backend``: plan for that
    platform's `Backend` record (`_planned_for`), else for this process's."""
    if backend is not None:
        with backends.use(backends.backend_for(backend)):
            return _planned_for(only)
    out: dict[str, str] = {}
    for name, loss, policy, params, batch in _each_case(only):
        step = jax.value_and_grad(amp(loss, policy=policy))
        out[f"{name}.hlo"] = _strip(jax.jit(step).lower(params, *batch).compile().as_text())
        out[f"{name}.jaxpr"] = str(jax.make_jaxpr(step)(params, *batch))
        out[f"{name}.explain"] = str(
            amp_jax.explain(loss, params, *batch, policy=policy, grad=True)
        )
        report = amp_jax.dtype_report(loss, params, *batch, policy=policy, grad=True)
        out[f"{name}.report"] = amp_jax.format_dtype_report(report)
    return out


def _each_case(only: str | None) -> Any:
    """``(name, loss, policy, params, batch)`` of each case (``only``: a comma-separated
    list of the names to keep)."""
    key = jax.random.PRNGKey(0)
    for name, model, policy, kwargs in _cases():
        if only and name not in only.split(","):
            continue
        loss: Callable[..., Any] = lambda p, *b, _m=model, _kw=kwargs: _m.loss(p, *b, **_kw)
        yield name, loss, policy, model.init(key), model.batch(key)


def _planned_for(only: str | None) -> dict[str, str]:
    """The texts of each case planned for the injected `Backend` record: its
    plan tree (``plan``: ``planning.format_plan`` of the loss), and the jaxpr,
    explain and report entries lowered on this CPU, or the error that lowering
    raised (a cuDNN attention without a GPU); no ``hlo``."""
    out: dict[str, str] = {}
    for name, loss, policy, params, batch in _each_case(only):
        ctx = Context(amp_jax.get_policy(policy), backends.current())
        closed = jax.make_jaxpr(loss)(params, *batch)
        out[f"{name}.plan"] = plans.format_plan(planning.plan(ctx, closed))
        step = jax.value_and_grad(amp(loss, policy=policy))
        makers: dict[str, Callable[[], Any]] = {
            "jaxpr": lambda: jax.make_jaxpr(step)(params, *batch),
            "explain": lambda: amp_jax.explain(loss, params, *batch, policy=policy, grad=True),
            "report": lambda: amp_jax.format_dtype_report(
                amp_jax.dtype_report(loss, params, *batch, policy=policy, grad=True)
            ),
        }
        for kind, make in makers.items():
            try:
                out[f"{name}.{kind}"] = str(make())
            except Exception as e:  # noqa: BLE001 -- the error is the entry (the same before and after)
                out[f"{name}.{kind}"] = f"error: {type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> str:
    """Runs the tool; returns its report (a table of the hashes and, with
    ``--check``, what changed). Exits 1 when ``--check`` finds a change, 2
    when the baseline is of another JAX."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=pathlib.Path, help="write the hashes to this JSON file")
    mode.add_argument("--check", type=pathlib.Path, help="compare with this JSON file")
    mode.add_argument("--smoke", action="store_true", help="the mlp case, printed only (CI)")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--dump", type=pathlib.Path, help="also write each text to this folder")
    parser.add_argument(
        "--backend", help="plan for this platform's Backend record (e.g. gpu; no hlo entries)"
    )
    args = parser.parse_args(argv)
    found = texts("mlp" if args.smoke else args.only, args.backend)
    hashes = {k: _digest(v) for k, v in found.items()}
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        for k, v in found.items():
            (args.dump / k).write_text(v)
    before: dict[str, str] = {}
    if args.check:
        baseline = json.loads(args.check.read_text())
        if baseline["versions"]["jax"] != jax.__version__:
            print(
                f"the baseline is of JAX {baseline['versions']['jax']}, this is {jax.__version__}"
            )
            sys.exit(2)
        before = baseline["hashes"]
    rows = ["| entry | sha256[:16] | unchanged |", "|---|---|---|"]
    rows += [
        f"| {k} | {v} | {'-' if not args.check else before.get(k) == v} |"
        for k, v in hashes.items()
    ]
    changed = [k for k in hashes if args.check and before.get(k) != hashes[k]]
    summary = (
        f"{len(hashes) - len(changed)} of {len(hashes)} unchanged (JAX {jax.__version__})"
        if args.check
        else f"{len(hashes)} hashes (JAX {jax.__version__})"
    )
    text = "\n".join([*rows, "", *(f"changed: {k}" for k in changed), summary]) + "\n"
    print(text)
    if args.write:
        versions = {"jax": jax.__version__, "amp_jax": amp_jax.__file__}
        versions["backend"] = args.backend or jax.default_backend()
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps({"versions": versions, "hashes": hashes}, indent=1))
        print(f"written to {args.write}")
    if changed:
        sys.exit(1)
    return text


if __name__ == "__main__":
    main()
