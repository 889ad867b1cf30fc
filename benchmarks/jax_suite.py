"""JAX's own test files run through amp's interpreter (issue 48).

    python -m benchmarks.jax_suite --jax-src /tmp/jax-src-0.10.2 --mode float32
    python -m benchmarks.jax_suite --jax-src /tmp/jax-src-0.10.2 --mode bfloat16 \\
        --files custom_api_test.py,ode_test.py

``--jax-src`` is a checkout of JAX's repository (its ``tests/`` at the tag of
the installed JAX: ``git archive jax-v0.10.2 tests pyproject.toml conftest.py``);
JAX's test code stays out of this repository. Each file runs with pytest in a
subprocess, in the checkout, with our plugin (`benchmarks/_jax_suite_plugin.py`)
loaded: first without amp (the baseline), then with amp wrapped around every
function the test file passes to ``jax.jit``, ``grad``, ``vmap``, ``jvp``,
``vjp``, ``linearize`` and the jacobians, in one mode:

- ``float32``: amp's interpreter forced on at float32 (every equation
  re-bound, no dtype changed): every test that passes without amp must pass,
  bar the skip list (``jax_suite_skips.txt``: failures that are the wrapping's
  own, each with its reason);
- ``bfloat16``: ``amp(fn, policy="bfloat16")``: numerical assertion failures
  are expected and counted; a crash (any other exception) is a defect.

The tests that fail under amp run once more with ``jax.jit`` where amp was
(the plugin's ``jit`` mode): "fail under jit too" counts those that fail
because their function is traced to a jaxpr at all, as amp traces it. A hint,
not a proof: ``jax.jit`` also fails where amp would not (a function or other
non-array argument that amp takes as static and jit refuses), so each skip-list
line says why, from a standalone check.

Per file and mode the table gives: tests that pass without amp, of those how
many fail under amp (crashes, assertion failures) and how many of the failures
the skip list explains, and how many are amp's known defects
(``jax_suite_known.txt``, each with its issue). The failing node ids, their exceptions and the skip
reasons go to ``--out`` (``<mode>/failures.txt`` and the JSON lines of each
run). ``--baseline failures`` (for a slow machine) runs the baseline only on
the tests that fail under amp and counts every other test that passes under
amp as passing without it. ``--smoke`` runs the plugin on our own tiny test
file (``jax_suite_sample/``), no JAX checkout needed, and checks that it
wrapped something.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SKIPS = HERE / "jax_suite_skips.txt"
#: failures of amp's known defects, each with the issue that fixes it (same format)
KNOWN = HERE / "jax_suite_known.txt"
SAMPLE = HERE / "jax_suite_sample"

#: issue 48's files; lax_test and lax_numpy_test only for their dot/conv/matmul tests
FILES = (
    "lax_control_flow_test.py",
    "lax_autodiff_test.py",
    "custom_api_test.py",
    "api_test.py",
    "lax_numpy_reducers_test.py",
    "nn_test.py",
    "lax_vmap_op_test.py",
    "custom_root_test.py",
    "custom_linear_solve_test.py",
    "ode_test.py",
    "lax_test.py",
    "lax_numpy_test.py",
)
SELECT = {
    "lax_test.py": "Dot or dot or Conv or conv or Matmul or matmul",
    "lax_numpy_test.py": "Dot or dot or Matmul or matmul or Einsum or einsum or Tensordot",
}


def read_skips(path: pathlib.Path) -> list[tuple[str, str, str, str]]:
    """(mode or ``*``, node-id glob, exception type or ``""``, reason) for each
    line ``MODE GLOB [EXCEPTION-TYPE]  # reason``."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        spec, _, reason = line.partition("#")
        mode, glob, *kind = spec.split()
        if not reason.strip():
            raise ValueError(f"{path}: {line!r} has no reason (write it after '#')")
        out.append((mode, glob, "".join(kind), reason.strip()))
    return out


def skip_reason(row: dict, mode: str, skips: list[tuple[str, str, str, str]]) -> str | None:
    """The reason ``row``'s failure is on the skip list, or None."""
    for m, glob, kind, reason in skips:
        if m in ("*", mode) and fnmatch.fnmatchcase(row["nodeid"], glob):
            if not kind or kind == row["type"]:
                return reason
    return None


def run_pytest(
    src: pathlib.Path,
    targets: list[str],
    mode: str,
    log: pathlib.Path,
    select: str | None,
    cases: int,
    timeout: float,
    reuse: bool = False,
) -> list[dict]:
    """One pytest run of ``targets`` (paths or node ids, relative to ``src``)
    under ``mode``; the plugin's rows (one per test). ``reuse``: the rows an
    earlier run left in ``log``, nothing run."""
    if reuse:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        AMP_JAX_SUITE_MODE=mode,
        AMP_JAX_SUITE_LOG=str(log),
        JAX_NUM_GENERATED_CASES=str(cases),
        JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    cmd += ["benchmarks._jax_suite_plugin", "-o", "addopts=--import-mode=importlib"]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", "0"]
    except ImportError:
        pass
    if select:
        cmd += ["-k", select]
    # many node ids: pass them through a file (the command line has a limit)
    if len(targets) > 50:
        listing = log.with_suffix(".args")
        listing.write_text("\n".join(targets))
        cmd += [f"@{listing}"]
    else:
        cmd += targets
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {timeout} s\n" + str(e.stdout or "")[-2000:]
    log.with_suffix(".out").write_text(
        f"{' '.join(cmd)}\n{time.monotonic() - started:.0f} s\n{tail}"
    )
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_file(args, src: pathlib.Path, name: str, mode: str, skips, known) -> dict:
    """The baseline and the amp run of one test file: its row and failures."""
    out = pathlib.Path(args.out) / mode
    select = SELECT.get(name)
    if args.k:
        select = f"({select}) and ({args.k})" if select else args.k
    target = [f"tests/{name}"]
    amp_rows = run_pytest(
        src, target, mode, out / f"{name}.jsonl", select, args.cases, args.timeout, bool(args.reuse)
    )
    amp = {r["nodeid"]: r for r in amp_rows}
    if args.baseline == "full":
        base_rows = run_pytest(
            src,
            target,
            "off",
            out / f"{name}.base.jsonl",
            select,
            args.cases,
            args.timeout,
            args.reuse == "all",
        )
        passed = {r["nodeid"] for r in base_rows if r["outcome"] == "passed"}
    else:
        # only the tests that did not pass under amp run without it
        others = sorted(n for n, r in amp.items() if r["outcome"] == "failed")
        base_rows = (
            run_pytest(
                src,
                others,
                "off",
                out / f"{name}.base.jsonl",
                None,
                args.cases,
                args.timeout,
                args.reuse == "all",
            )
            if others
            else []
        )
        passed = {n for n, r in amp.items() if r["outcome"] == "passed"}
        passed |= {r["nodeid"] for r in base_rows if r["outcome"] == "passed"}
    failed = [amp[n] for n in sorted(passed) if n in amp and amp[n]["outcome"] == "failed"]
    missing = sorted(n for n in passed if n not in amp)  # the amp run died before them
    for r in failed:
        r["skip"] = skip_reason(r, mode, skips)
        r["known"] = None if r["skip"] else skip_reason(r, mode, known)
    # the control: the failing tests with jax.jit where amp was
    ids = [r["nodeid"] for r in failed]
    control = (
        run_pytest(
            src,
            ids,
            "jit",
            out / f"{name}.jit.jsonl",
            None,
            args.cases,
            args.timeout,
            args.reuse == "all",
        )
        if ids
        else []
    )
    jit_failed = {r["nodeid"] for r in control if r["outcome"] == "failed"}
    for r in failed:
        r["jit_fails"] = r["nodeid"] in jit_failed
    return {
        "file": name,
        "ran": len(amp_rows),
        "baseline_passed": len(passed),
        "wrapped": sum(1 for r in amp_rows if r.get("wrapped")),
        "failed": failed,
        "missing": missing,
    }


def table(results: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| file | mode | tests run | wrapped | passed without amp | failed under amp | crashes | assertions | fail under jit too | on the skip list | known defect | unexplained |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    totals = [0] * 10
    for r in results:
        f = r["failed"]
        crash = sum(1 for x in f if x["crash"])
        skipped = sum(1 for x in f if x["skip"])
        nums = [r["ran"], r["wrapped"], r["baseline_passed"], len(f) + len(r["missing"])]
        jit = sum(1 for x in f if x.get("jit_fails"))
        known = sum(1 for x in f if x.get("known"))
        nums += [crash + len(r["missing"]), len(f) - crash, jit, skipped, known]
        nums += [len(f) + len(r["missing"]) - skipped - known]
        totals = [a + b for a, b in zip(totals, nums)]
        lines.append(f"| {r['file']} | {r['mode']} | " + " | ".join(map(str, nums)) + " |")
    lines.append("| **total** | | " + " | ".join(f"**{n}**" for n in totals) + " |")
    return "\n".join(lines) + "\n"


def failures_text(results: list[dict]) -> str:
    out = []
    for r in results:
        for x in r["failed"]:
            kind = "crash" if x["crash"] else "assert"
            skip = f"  [skip list: {x['skip']}]" if x["skip"] else ""
            skip += f"  [known: {x['known']}]" if x.get("known") else ""
            jit = " [fails under jit too]" if x.get("jit_fails") else ""
            out.append(f"{r['mode']} {kind}{jit} {x['nodeid']}: {x['type']}: {x['message']}{skip}")
        for n in r["missing"]:
            out.append(f"{r['mode']} crash {n}: the amp run did not reach it (timed out or died)")
    return "\n".join(out) + "\n"


def versions() -> str:
    import jax
    import jaxlib

    return (
        f"JAX {jax.__version__}, jaxlib {jaxlib.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} {os.cpu_count()} cores ({jax.default_backend()})"
    )


def smoke() -> str:
    """The plugin on our own sample test file: it must wrap, and amp must run."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for mode in ("float32", "bfloat16"):
            rows = run_pytest(
                SAMPLE,
                ["tests/sample_test.py"],
                mode,
                pathlib.Path(tmp) / f"{mode}.jsonl",
                None,
                1,
                600,
            )
            results.append(
                {
                    "file": "sample_test.py",
                    "mode": mode,
                    "ran": len(rows),
                    "baseline_passed": len(rows),
                    "wrapped": sum(1 for r in rows if r.get("wrapped")),
                    "failed": [dict(r, skip=None) for r in rows if r["outcome"] == "failed"],
                    "missing": [],
                }
            )
    text = table(results, "## smoke: benchmarks/jax_suite_sample")
    text += failures_text(results)
    if not all(r["wrapped"] == r["ran"] > 0 for r in results):
        raise AssertionError(f"the plugin wrapped nothing:\n{text}")
    return text


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--jax-src", help="a checkout of JAX's repository (its tests/ at the installed version)"
    )
    p.add_argument("--mode", default="float32", help="float32, bfloat16 or both: float32,bfloat16")
    p.add_argument("--files", default=",".join(FILES), help="comma-separated file names in tests/")
    p.add_argument("-k", dest="k", help="pytest -k expression for every file (a subset)")
    p.add_argument("--cases", type=int, default=2, help="JAX_NUM_GENERATED_CASES")
    p.add_argument("--baseline", choices=("full", "failures"), default="full")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run")
    p.add_argument("--out", default="/tmp/amp_jax_suite", help="logs: failing node ids, JSON lines")
    p.add_argument("--skips", default=str(SKIPS))
    p.add_argument(
        "--reuse",
        choices=("amp", "all"),
        help="take the amp runs (all: every run) from --out's logs instead of running them: "
        "after a skip-list edit, or after an amp run cut short",
    )
    p.add_argument("--smoke", action="store_true", help="only the plugin on our sample test file")
    args = p.parse_args(argv)
    if args.smoke:
        text = smoke()
        print(text)
        return text
    if not args.jax_src:
        p.error("--jax-src PATH is needed (a checkout of JAX's repository)")
    src = pathlib.Path(args.jax_src).resolve()
    skips = read_skips(pathlib.Path(args.skips))
    known = read_skips(KNOWN)
    results = []
    for mode in args.mode.split(","):
        for name in args.files.split(","):
            r = run_file(args, src, name, mode, skips, known)
            r["mode"] = mode
            results.append(r)
            print(table([r], "").strip().splitlines()[-2], flush=True)
    date = datetime.date.today().isoformat()
    source = (src / "JAX_SOURCE").read_text().strip() if (src / "JAX_SOURCE").exists() else str(src)
    header = (
        f"## {versions()}; {date}\n\nJAX tests from {source}; JAX_NUM_GENERATED_CASES={args.cases}; "
        f"baseline: {args.baseline}" + (f"; -k {args.k!r}" if args.k else "")
    )
    text = table(results, header)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "failures.txt").write_text(failures_text(results))
    print(text)
    print(f"failures: {out / 'failures.txt'}")
    return text


if __name__ == "__main__":
    main()
