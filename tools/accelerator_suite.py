"""Runs the whole test suite on an accelerator and prints one summary row.

    python tools/accelerator_suite.py [--workers N] [--out DIR] [pytest args...]

On a GPU machine: the suite runs with pytest-xdist (``-n``, default 8
workers), without the pytest-benchmark plugin (it clashes with xdist under
warnings-as-errors) and without JAX's GPU memory preallocation (the workers
share one GPU). It writes ``junit.xml`` and ``log.txt`` to ``--out`` and
prints a Markdown row for benchmarks/results/ACCELERATOR_RUNS.md:

    | backend | device | JAX | passed | failed | skipped | xfailed | date |

The exit status is pytest's. Cut off with SIGINT (``benchmarks/gpu_session.py``
does this at the end of its budget), it still writes the row of the tests that
ran. Modules whose packages are missing there
(nbclient, mkdocs) skip themselves with ``pytest.importorskip``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _counts(junit: pathlib.Path) -> dict[str, int]:
    counts = dict(passed=0, failed=0, skipped=0, xfailed=0)
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed"] += 1
        elif "skipped" in kinds:
            msg = kinds["skipped"].get("type", "") + kinds["skipped"].get("message", "")
            counts["xfailed" if "xfail" in msg else "skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _device() -> tuple[str, str, str]:
    code = (
        "import jax; d = jax.devices()[0]; "
        "print(jax.default_backend(), '|', d.device_kind, '|', jax.__version__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": ""},
    )
    parts = [p.strip() for p in out.stdout.strip().split("|")]
    return tuple(parts) if len(parts) == 3 else ("?", out.stderr.strip()[-200:], "?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist workers (0: none)")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=ROOT / "accelerator_out",
        help="folder for junit.xml and log.txt",
    )
    args, rest = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    junit = args.out / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:benchmark",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *rest,
    ]
    if args.workers:
        cmd += ["-n", str(args.workers)]
    with open(args.out / "log.txt", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        # Cut off with SIGINT (a terminal's Ctrl-C, `timeout -s INT`, gpu_session.py),
        # pytest gets the signal as one of this process group and reports what it
        # ran; this process ignores it, keeps that output and prints the row of it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # after the fork: pytest keeps it
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    backend, device, version = _device()
    c = _counts(junit) if junit.exists() else dict(passed=0, failed=0, skipped=0, xfailed=0)
    print("| backend | device | JAX | passed | failed | skipped | xfailed | date |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    print(
        f"| {backend} | {device} | {version} | {c['passed']} | {c['failed']} | "
        f"{c['skipped']} | {c['xfailed']} | {datetime.date.today().isoformat()} |"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
