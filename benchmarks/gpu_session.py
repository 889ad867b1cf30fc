"""Everything a lent GPU is for, in one command that fits the device budget.

    python -m benchmarks.gpu_session --out $OUT [--budget 560] [--stages ...]
                                     [--resume FILE] [--smoke]

A session is lent a GPU for 15 minutes in all, a start included, at most 10
minutes a command, and gets back at most 8 files. This runs the stages below
in priority order, each cut off (SIGINT, then SIGKILL) at its share of
``--budget`` seconds or at what is left, and leaves in ``--out``:

* ``summary.md``: each stage's time and outcome, the suite's row and
  failures, the benchmark's targets;
* ``RESULTS_GPU.md`` (benchmarks.run), ``PROFILE_GPU.md`` (benchmarks.gpu_profile),
  ``QUANTIZED_UPDATE.md`` (benchmarks.quantized_states --timing-only);
* ``tests_done.txt``: the node id of every test that finished. The machine keeps
  it (``--resume``, in /tmp) while it stays warm (30 s after a call), so the same
  command run again at once, ``--stages tests_gpu,tests_rest``, runs only the
  tests that the cut-off run did not reach (``--fresh`` starts over);
* ``logs.tar.gz``: every stage's log, the junit files, the optimized HLO of the
  benchmarked steps and the Perfetto traces.

Stages (``--stages``, comma-separated, in the order given):

``device``     nvidia-smi and the versions of what the tests import
``tests_gpu``  the test files that check GPU behaviour (cuDNN attention, float8
               GEMMs, in-place optimizer state, explicit rounding), via
               tools/accelerator_suite.py
``bench``      GPT (with the PyTorch peers), gpt_fp8, MLP and CNN step times
``quantized``  quantized AdamW states' update beside the bf16-state update
``profile``    device time per kernel kind: amp, hand bf16 + cuDNN, amp's bf16 stream
``tests_rest`` the rest of the suite, in whatever time is left

Wheels in ``.whl/`` (``bash benchmarks/gpu_wheels.sh`` here, then ``carry:
[".whl"]``) are installed first, into /tmp: Haiku, Keras and pytest-examples,
which the device machine lacks. ``--smoke`` runs the same stages on tiny models
and a few test files, to check this script on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: test files that check what only a GPU shows, most telling first
GPU_TESTS = (
    "tests/test_backend_gpu.py",
    "tests/test_attention.py",
    "tests/test_float8.py",
    "tests/test_eager.py",
    "tests/test_optim_kahan_sr.py",
    "tests/repository/test_performance_structure.py",
    "tests/test_lowdot.py",
    "tests/behaviour/test_forward_mode.py",
    "tests/test_optim_quantized.py",
    "tests/behaviour/test_random_programs.py",
)
#: tests that the smoke run takes (fast on a CPU)
SMOKE_TESTS = ("tests/test_backend_gpu.py", "tests/test_policy.py")

#: (stage, share of the budget in seconds; None: what is left), in the default order.
#: Sized from the last H100 runs (the suite's 640 tests in 3.5 min on 12 workers;
#: the benchmark's compiles ~90 s) and the CPU suite's per-file times (2026-11-26:
#: GPU_TESTS sum to 383 s of test time, the rest to 880 s, 220 s of it sharding
#: tests that need 8 devices and skip on one GPU).
SHARES = {
    "device": 20,
    "tests_gpu": 130,
    "bench": 200,
    "quantized": 30,
    "profile": 60,
    "tests_rest": None,
}
#: seconds kept back for packing the results
RESERVE = 15
#: seconds between SIGINT and SIGKILL when a stage is cut off
GRACE = 20


def _rest_tests(first: tuple[str, ...]) -> list[str]:
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    return [t for t in every if t not in first]


def _pytest_extra() -> list[str]:
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return []
    return ["--timeout=300"]  # one hung test must not take the whole budget


def commands(work: pathlib.Path, smoke: bool, workers: int) -> dict[str, list[str]]:
    py = sys.executable
    suite = [py, "tools/accelerator_suite.py", "--workers", str(workers), *_pytest_extra()]
    gpu_tests = SMOKE_TESTS[:1] if smoke else GPU_TESTS
    rest = SMOKE_TESTS[1:] if smoke else _rest_tests(GPU_TESTS)
    bench = [py, "-m", "benchmarks.run", "--no-extras", "--out", str(work / "RESULTS_GPU.md")]
    bench += ["--hlo-dir", str(work / "hlo")]
    bench += ["--smoke", "--models", "gpt"] if smoke else ["--models", "gpt,gpt_fp8,mlp,cnn"]
    profile = [py, "-m", "benchmarks.gpu_profile", "--out", str(work / "PROFILE_GPU.md")]
    profile += ["--trace-dir", str(work / "traces")]
    profile += ["--smoke"] if smoke else []
    quantized = [py, "-m", "benchmarks.quantized_states", "--timing-only"]
    return {
        "device": [
            "bash",
            "-c",
            "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm "
            f"--format=csv || true; {py} -m benchmarks.gpu_session --versions",
        ],
        "tests_gpu": [*suite, "--out", str(work / "tests_gpu"), *gpu_tests],
        "bench": bench,
        "profile": profile,
        "quantized": quantized,
        "tests_rest": [*suite, "--out", str(work / "tests_rest"), *rest],
    }


#: the packages whose versions the device stage prints
PACKAGES = (
    "jax", "jaxlib", "flax", "optax", "equinox", "chex", "hypothesis", "pytest",
    "pytest-xdist", "pytest-timeout", "torch", "dm-haiku", "keras",
)  # fmt: skip


def versions() -> str:
    """The device and the versions of PACKAGES (``missing`` where not installed)."""
    import importlib.metadata

    import jax

    d = jax.devices()[0]
    lines = [f"{jax.default_backend()} {d.device_kind} {getattr(d, 'compute_capability', '')}"]
    for name in PACKAGES:
        try:
            lines.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name} missing")
    return "\n".join(lines)


def install_wheels(wheels: pathlib.Path, site: pathlib.Path, log: pathlib.Path) -> str:
    """pip-installs ``wheels/*.whl`` (benchmarks/gpu_wheels.sh) into ``site``, offline
    and without their dependencies (the device machine has the rest); says how it went."""
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    if not found:
        return "none"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *found]
    with log.open("w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc:
            return f"pip failed ({rc}): see logs/wheels.log"
        # a plugin that fails to import stops pytest itself (pytest-examples needs
        # black, black needs click...): then run without the wheels
        check = [sys.executable, "-c", "import haiku, keras, pytest_examples"]
        env = {**os.environ, "PYTHONPATH": str(site), "KERAS_BACKEND": "jax"}
        rc = subprocess.run(check, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        shutil.rmtree(site)
        return f"{len(found)} installed but not importable, so not used: see logs/wheels.log"
    return f"{len(found)} installed"


#: runs argv[1:] with SIGINT's default action, as a shell gives it, also where this
#: runs under a process that ignores SIGINT (a pytest-xdist worker does, and its
#: children inherit that). Not ``preexec_fn``: it makes subprocess fork, and JAX
#: warns at a fork.
_DEFAULT_SIGINT = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
)


def run_stage(cmd: list[str], log: pathlib.Path, seconds: float, env: dict) -> tuple[int, bool]:
    """Runs ``cmd`` in its own process group, its output to ``log``; at ``seconds``
    sends the group SIGINT (pytest and the benchmarks keep what they have), then
    SIGKILL after GRACE seconds. Returns (exit status, whether it was cut off)."""
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [*_DEFAULT_SIGINT, *cmd],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=max(seconds, 1)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                return proc.wait(timeout=GRACE), True
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait(), True


def _grep(path: pathlib.Path, pattern: str, limit: int = 60) -> list[str]:
    if not path.exists():
        return []
    rx = re.compile(pattern)
    return [
        line.rstrip() for line in path.read_text(errors="replace").splitlines() if rx.search(line)
    ][:limit]


def _first_table(path: pathlib.Path) -> list[str]:
    """The lines of the first Markdown table in ``path``."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    return list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))


def _section(path: pathlib.Path, heading: str) -> list[str]:
    """The lines of the Markdown section ``heading`` (up to the next heading of its level)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    level = heading.split(" ")[0]
    for i, line in enumerate(lines):
        if line.startswith(heading):
            out = [line]
            for nxt in lines[i + 1 :]:
                if nxt.startswith(level + " "):
                    break
                out.append(nxt)
            return out
    return []


def summary(work: pathlib.Path, rows: list[tuple[str, str, float, int, bool]], wheels: str) -> str:
    lines = [
        f"# GPU session, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Wheels carried: {wheels}.",
        "",
        "| stage | seconds (share) | exit | cut off |",
        "|---|---:|---:|---|",
    ]
    for name, share, used, rc, cut in rows:
        lines.append(f"| {name} | {used:.0f} ({share}) | {rc} | {'yes' if cut else ''} |")
    device_log = work / "logs" / "device.log"
    if device_log.exists():
        lines += ["", "```", *device_log.read_text().splitlines()[-14:], "```"]
    for stage in ("tests_gpu", "tests_rest"):
        log = work / "logs" / f"{stage}.log"
        if not log.exists():
            continue
        lines += ["", f"## {stage}", ""]
        lines += _grep(log, r"^\| (gpu|cpu|backend|---)") or ["(no row: the run was cut off)"]
        lines += _grep(log, r"^(FAILED|ERROR) ") + _grep(log, r"(passed|failed).* in [0-9.]+s", 3)
    targets = _section(work / "RESULTS_GPU.md", "## Targets (GPU)")
    if targets:
        lines += ["", *targets]
    else:
        log = work / "logs" / "bench.log"
        if log.exists():
            text = log.read_text(errors="replace").split("# amp_jax speed benchmark")[0]
            lines += ["", "## bench (from its log: the tables printed per model)", ""]
            lines += [ln for ln in text.splitlines() if ln.startswith(("# ", "|"))]
    quantized = _grep(work / "logs" / "quantized.log", r"^\|")
    if quantized:
        lines += ["", "## quantized", "", *quantized]
    by_kind = _first_table(work / "PROFILE_GPU.md")
    if by_kind:
        lines += ["", "## profile", "", *by_kind]
    return "\n".join(lines) + "\n"


#: the most a file may weigh to come back from the device machine
MAX_FILE = 16 * 2**20


def _pack(work: pathlib.Path, tar_path: pathlib.Path) -> None:
    """Everything in ``work`` as one .tar.gz; without the HLO and the traces (the
    bulk) where it would be too large to come back."""
    for skip in (set(), {"hlo", "traces"}):
        with tarfile.open(tar_path, "w:gz") as tar:
            for path in sorted(work.iterdir()):
                if path.name not in skip:
                    tar.add(path, arcname=f"gpu_session/{path.name}")
        if tar_path.stat().st_size < MAX_FILE:
            return
        print(f"# {tar_path.name}: over {MAX_FILE >> 20} MiB; packed again without {skip}")


def main(argv: list[str] | None = None) -> str:
    """Runs the stages; returns the summary (also printed and written to ``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "gpu_out"))
    )
    p.add_argument(
        "--budget",
        type=float,
        default=560,
        help="seconds for all stages together (a cut-off stage takes up to 20 more)",
    )
    p.add_argument("--stages", default=",".join(SHARES), help=f"subset of {','.join(SHARES)}")
    p.add_argument(
        "--resume",
        type=pathlib.Path,
        default=pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "amp_jax_gpu_tests_done.txt",
        help="the tests finished so far: those listed are skipped, those run are added",
    )
    p.add_argument("--fresh", action="store_true", help="forget the tests finished so far")
    p.add_argument("--workers", type=int, default=14, help="pytest-xdist workers")
    p.add_argument(
        "--wheels",
        type=pathlib.Path,
        default=ROOT / ".whl",
        help="wheels to install first (benchmarks/gpu_wheels.sh; not with --smoke)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny models, few tests (a CPU check)")
    p.add_argument("--versions", action="store_true", help="print the device and versions; exit")
    args = p.parse_args(argv)
    if args.versions:
        text = versions()
        print(text, flush=True)
        return text
    start = time.monotonic()
    stages = args.stages.split(",")
    unknown = sorted(set(stages) - set(SHARES))
    if unknown:
        p.error(f"--stages: unknown {unknown}; valid: {','.join(SHARES)}")
    work = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_session_{os.getpid()}"
    (work / "logs").mkdir(parents=True)
    done = args.resume
    if args.fresh:
        done.unlink(missing_ok=True)
    site = work.parent / f"{work.name}_site"  # not packed: ruff's binary alone is 25 MB
    wheels = (
        "none (--smoke)"
        if args.smoke
        else install_wheels(args.wheels, site, work / "logs" / "wheels.log")
    )
    print(f"# wheels from {args.wheels}: {wheels}", flush=True)
    path = [str(ROOT), str(site) if site.exists() else None, os.environ.get("PYTHONPATH")]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, path)),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "AMP_JAX_RESUME": str(done),
    }
    cmds = commands(work, args.smoke, 2 if args.smoke else args.workers)
    rows = []
    for name in stages:
        left = args.budget - (time.monotonic() - start) - RESERVE
        share = SHARES[name]
        seconds = left if share is None else min(share, left)
        if seconds < 5:
            rows.append((name, str(share or "rest"), 0.0, -1, True))
            print(f"# {name}: no time left", flush=True)
            continue
        print(f"# {name}: up to {seconds:.0f} s", flush=True)
        t0 = time.monotonic()
        rc, cut = run_stage(cmds[name], work / "logs" / f"{name}.log", seconds, env)
        rows.append((name, str(share or "rest"), time.monotonic() - t0, rc, cut))
        print(f"# {name}: exit {rc}{', cut off' if cut else ''}, {rows[-1][2]:.0f} s", flush=True)
    text = summary(work, rows, wheels)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(text)
    for name in ("RESULTS_GPU.md", "PROFILE_GPU.md"):
        if (work / name).exists():
            shutil.copyfile(work / name, args.out / name)
    if done.exists():
        shutil.copyfile(done, args.out / "tests_done.txt")
    quantized = work / "logs" / "quantized.log"
    if quantized.exists():
        shutil.copyfile(quantized, args.out / "QUANTIZED_UPDATE.md")
    _pack(work, args.out / "logs.tar.gz")
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
