"""JAX's, Equinox's and Flax NNX's own test files run through amp's
interpreter (issues 48 and 56).

    python -m benchmarks.jax_suite --src /tmp/jax-src-0.10.2 --mode float32
    python -m benchmarks.jax_suite --src /tmp/jax-src-0.10.2 --mode bfloat16 \\
        --files custom_api_test.py,ode_test.py
    python -m benchmarks.jax_suite --suite equinox --src /tmp/equinox-0.13.8 \\
        --mode float32,bfloat16
    python -m benchmarks.jax_suite --suite flax_nnx --src /tmp/flax-0.12.8 \\
        --files nn/linear_test.py,transforms_test.py

``--suite`` picks the library (`SUITES`: ``jax``, ``equinox``, ``flax_nnx``)
and ``--src`` (``--jax-src``, as before) is a checkout of its repository with
its tests at the tag of the installed version (JAX: ``git archive jax-v0.10.2
tests pyproject.toml conftest.py``; Equinox ``v0.13.8``: ``tests``
and ``pyproject.toml``; Flax ``v0.12.8``: ``tests/nnx`` and
``pyproject.toml``); their test code stays out of this repository. A file
``SOURCE`` (or ``JAX_SOURCE``) in the checkout names the tag and commit for
the tables. ``--files`` are paths under the suite's test folder
(``tests/``, ``tests/nnx/``); by default JAX's are issue 48's list and the
libraries' every test file. Each file runs with pytest in a
subprocess, in the checkout, with our plugin (`benchmarks/_jax_suite_plugin.py`)
loaded: first without amp (the baseline), then with amp wrapped around every
function the test file passes to ``jax.jit``, ``grad``, ``vmap``, ``jvp``,
``vjp``, ``linearize`` and the jacobians, and to the library's own
transformations (``eqx.filter_jit``/``filter_grad``/``filter_value_and_grad``/
``filter_vmap``; ``nnx.jit``/``grad``/``value_and_grad``/``vmap``), in one mode:

- ``float32``: amp's interpreter forced on at float32 (every equation
  re-bound, no dtype changed): every test that passes without amp must pass,
  bar the skip list (``jax_suite_skips.txt``, ``equinox_suite_skips.txt``,
  ``flax_nnx_suite_skips.txt``: failures that are the wrapping's own, each
  with its reason);
- ``bfloat16``: ``amp(fn, policy="bfloat16")``: numerical assertion failures
  are expected and counted; a crash (any other exception) is a defect.

The tests that fail under amp run once more with the suite's jit where amp
was (the plugin's ``jit`` mode: ``jax.jit``, ``eqx.filter_jit``, ``nnx.jit``): "fail under jit too" counts those that fail
because their function is traced to a jaxpr at all, as amp traces it. A hint,
not a proof: ``jax.jit`` also fails where amp would not (a function or other
non-array argument that amp takes as static and jit refuses), so each skip-list
line says why, from a standalone check.

Per file and mode the table gives: tests that pass without amp, of those how
many fail under amp (crashes, assertion failures) and how many of the failures
the skip list explains, and how many are amp's known defects
(``<suite>_suite_known.txt``, each with its issue). The failing node ids, their exceptions and the skip
reasons go to ``--out`` (``<mode>/failures.txt`` and the JSON lines of each
run). ``--baseline failures`` (for a slow machine) runs the baseline only on
the tests that fail under amp and counts every other test that passes under
amp as passing without it. ``--together N`` runs up to N files in one pytest process (on a busy machine
starting JAX and the library again per file is most of a small file's time);
a suite's ``isolate`` tests run in a process of their own (their failure
breaks the process for every later test). ``--smoke`` runs the plugin on our own tiny test
files (``jax_suite_sample/``: one per suite), no checkout needed, and checks
that every test wrapped something.
"""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Suite:
    """One library's test suite: where its test files are in a checkout
    (``tests``), which run by default (``files``; ``()``: every ``*_test.py``
    and ``test_*.py`` under ``tests``), a ``-k`` per file, the pytest
    ``addopts`` that replace the checkout's, and its skip and known-defect lists."""

    name: str
    package: str
    tests: str
    files: tuple[str, ...] = ()
    select: dict[str, str] = dataclasses.field(default_factory=dict)
    addopts: str = "--import-mode=importlib"
    #: node ids that run under amp in a pytest process of their own: their
    #: failure leaves the process broken for every test after them
    isolate: tuple[str, ...] = ()

    @property
    def skips(self) -> pathlib.Path:
        return SKIPS if self.name == "jax" else HERE / f"{self.name}_suite_skips.txt"

    @property
    def known(self) -> pathlib.Path:
        return KNOWN if self.name == "jax" else HERE / f"{self.name}_suite_known.txt"

    def default_files(self, src: pathlib.Path) -> list[str]:
        """``files``, or every test file under ``src``'s test folder."""
        if self.files:
            return list(self.files)
        root = src / self.tests
        found = {*root.rglob("*_test.py"), *root.rglob("test_*.py")}
        return sorted(str(f.relative_to(root)) for f in found)


SUITES = {
    "jax": Suite("jax", "jax", "tests", FILES, SELECT),
    # Equinox's own addopts load jaxtyping's import hook with beartype (not a
    # dependency of amp_jax's environments): its tests run without it
    "equinox": Suite("equinox", "equinox", "tests", addopts=""),
    "flax_nnx": Suite(
        "flax_nnx",
        "flax",
        "tests/nnx",
        addopts="",
        # the test writes a cycle (m.ref = m) into its argument; amp flattens the
        # argument, and jaxlib's flatten of a cycle leaks the interpreter's
        # recursion depth: every later test raises RecursionError (amp now refuses a cycle first)
        isolate=(
            "tests/nnx/transforms_test.py::TestJIT::test_graph_updates_add_self_reference",
            "tests/nnx/transforms_test.py::TestJIT::test_graph_updates_ref_in_output",
        ),
    ),
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
    suite: Suite,
    src: pathlib.Path,
    targets: list[str],
    mode: str,
    log: pathlib.Path,
    select: str | None,
    cases: int,
    timeout: float,
    reuse: bool = False,
    deselect: tuple[str, ...] = (),
) -> list[dict]:
    """One pytest run of ``suite``'s ``targets`` (paths or node ids, relative
    to ``src``) under ``mode``; the plugin's rows (one per test). ``reuse``:
    the rows an earlier run left in ``log``, nothing run."""
    if reuse:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        AMP_JAX_SUITE_MODE=mode,
        AMP_JAX_SUITE_SUITE=suite.name,
        AMP_JAX_SUITE_LOG=str(log),
        JAX_NUM_GENERATED_CASES=str(cases),
        JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    cmd += ["benchmarks._jax_suite_plugin", "-o", f"addopts={suite.addopts}"]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", "0"]
    except ImportError:
        pass
    if select:
        cmd += ["-k", select]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
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


def run_file(args, src: pathlib.Path, names: list[str], mode: str, skips, known) -> list[dict]:
    """The baseline and the amp run of test files (several in one pytest
    process: see `groups`): a row and the failures of each."""
    suite = SUITES[args.suite]
    out = pathlib.Path(args.out) / mode
    select = suite.select.get(names[0]) if len(names) == 1 else None
    if args.k:
        select = f"({select}) and ({args.k})" if select else args.k
    target = [f"{suite.tests}/{name}" for name in names]
    # a file in a subfolder: its log beside the others
    stem = names[0].replace("/", "__") + (f".and{len(names) - 1}" if len(names) > 1 else "")
    isolated = tuple(i for i in suite.isolate if i.split("::")[0] in target)
    amp_rows = run_pytest(
        suite,
        src,
        target,
        mode,
        out / f"{stem}.jsonl",
        select,
        args.cases,
        args.timeout,
        bool(args.reuse),
        isolated,
    )
    for i, nodeid in enumerate(isolated):
        log = out / f"{stem}.isolated{i}.jsonl"
        amp_rows += run_pytest(
            suite, src, [nodeid], mode, log, None, args.cases, args.timeout, bool(args.reuse)
        )
    amp = {r["nodeid"]: r for r in amp_rows}
    if args.baseline == "full":
        base_rows = run_pytest(
            suite,
            src,
            target,
            "off",
            out / f"{stem}.base.jsonl",
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
                suite,
                src,
                others,
                "off",
                out / f"{stem}.base.jsonl",
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
            suite,
            src,
            ids,
            "jit",
            out / f"{stem}.jit.jsonl",
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
    results = []
    for name in names:
        prefix = f"{suite.tests}/{name}::"

        def mine(nodeid: str, prefix: str = prefix) -> bool:
            return nodeid.startswith(prefix)

        rows = [r for r in amp_rows if mine(r["nodeid"])]
        results.append(
            {
                "file": name,
                "ran": len(rows),
                "baseline_passed": sum(1 for n in passed if mine(n)),
                "wrapped": sum(1 for r in rows if r.get("wrapped")),
                "failed": [r for r in failed if mine(r["nodeid"])],
                "missing": [n for n in missing if mine(n)],
            }
        )
    return results


def groups(suite: Suite, files: list[str], together: int) -> list[list[str]]:
    """``files`` in groups of up to ``together`` that run in one pytest
    process (each process imports JAX and the library again: on a busy
    machine that is most of a small file's time); a file with its own ``-k``
    alone."""
    alone = [[f] for f in files if f in suite.select]
    rest = [f for f in files if f not in suite.select]
    return alone + [rest[i : i + together] for i in range(0, len(rest), max(together, 1))]


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


def versions(suite: Suite) -> str:
    import importlib.metadata

    import jax
    import jaxlib

    lib = ""
    if suite.package != "jax":
        lib = f"{suite.package} {importlib.metadata.version(suite.package)}, "
    return (
        f"{lib}JAX {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"Python {platform.python_version()}, "
        f"{platform.machine()} {os.cpu_count()} cores ({jax.default_backend()})"
    )


#: the smoke run's sample files, one per suite (jax_suite_sample/tests/)
SAMPLES = {"jax": "sample_test.py", "equinox": "equinox_test.py", "flax_nnx": "flax_nnx_test.py"}


def smoke() -> str:
    """The plugin on our own sample test files, every suite's transformations
    patched at once: every test must wrap, and amp must run."""
    import tempfile

    every = Suite(",".join(SUITES), "jax", "tests")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("float32", "bfloat16"):
            files = [f"tests/{f}" for f in SAMPLES.values()]
            log = pathlib.Path(tmp) / f"{mode}.jsonl"
            rows = run_pytest(every, SAMPLE, files, mode, log, None, 1, 600)
            for name in SAMPLES.values():
                # node ids are relative to pytest's rootdir (this repository's root)
                mine = [r for r in rows if r["nodeid"].split("::")[0].endswith(f"tests/{name}")]
                results.append(
                    {
                        "file": name,
                        "mode": mode,
                        "ran": len(mine),
                        "baseline_passed": len(mine),
                        "wrapped": sum(1 for r in mine if r.get("wrapped")),
                        "failed": [dict(r, skip=None) for r in mine if r["outcome"] == "failed"],
                        "missing": [],
                    }
                )
    text = table(results, "## smoke: benchmarks/jax_suite_sample")
    text += failures_text(results)
    if not all(r["wrapped"] == r["ran"] > 0 for r in results):
        raise AssertionError(f"the plugin left a test's functions unwrapped:\n{text}")
    return text


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=tuple(SUITES), default="jax", help="whose tests run")
    p.add_argument(
        "--src",
        "--jax-src",
        dest="src",
        help="a checkout of the suite's repository (its tests at the installed version's tag)",
    )
    p.add_argument("--mode", default="float32", help="float32, bfloat16 or both: float32,bfloat16")
    p.add_argument(
        "--files",
        help="comma-separated paths under the suite's test folder (default: JAX's list, "
        "or every test file of Equinox's tests/ and Flax's tests/nnx/)",
    )
    p.add_argument(
        "--together",
        type=int,
        default=1,
        help="run up to N files in one pytest process (default 1: each file alone)",
    )
    p.add_argument("-k", dest="k", help="pytest -k expression for every file (a subset)")
    p.add_argument("--cases", type=int, default=2, help="JAX_NUM_GENERATED_CASES")
    p.add_argument("--baseline", choices=("full", "failures"), default="full")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run")
    p.add_argument("--out", default="/tmp/amp_jax_suite", help="logs: failing node ids, JSON lines")
    p.add_argument("--skips", help="the skip list (default: the suite's)")
    p.add_argument(
        "--reuse",
        choices=("amp", "all"),
        help="take the amp runs (all: every run) from --out's logs instead of running them: "
        "after a skip-list edit, or after an amp run cut short",
    )
    p.add_argument("--smoke", action="store_true", help="only the plugin on our sample test files")
    args = p.parse_args(argv)
    if args.smoke:
        text = smoke()
        print(text)
        return text
    if not args.src:
        p.error(f"--src PATH is needed (a checkout of the {args.suite} repository)")
    suite = SUITES[args.suite]
    src = pathlib.Path(args.src).resolve()
    skips = read_skips(pathlib.Path(args.skips) if args.skips else suite.skips)
    known = read_skips(suite.known)
    files = args.files.split(",") if args.files else suite.default_files(src)
    results = []
    for mode in args.mode.split(","):
        for names in groups(suite, files, args.together):
            for r in run_file(args, src, names, mode, skips, known):
                r["mode"] = mode
                results.append(r)
                print(table([r], "").strip().splitlines()[-2], flush=True)
    date = datetime.date.today().isoformat()
    source = str(src)
    for marker in ("SOURCE", "JAX_SOURCE"):
        if (src / marker).exists():
            source = (src / marker).read_text().strip()
            break
    header = (
        f"## {versions(suite)}; {date}\n\n{args.suite} tests from {source}; "
        f"JAX_NUM_GENERATED_CASES={args.cases}; "
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
