"""Prints the benchmarks/results/ACCELERATOR_RUNS.md row of one nox leg, from the leg's own junit file.

    python tools/version_row.py build/junit/tests-3.12.xml

Run by ``noxfile.py`` in the leg's virtualenv after its pytest run, so the
backend, device, Python and JAX in the row are the ones the tests ran on and
the counts are pytest's own. Exits 1 when the junit file records a failure or
an error (the leg fails), else 0.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import sys
import xml.etree.ElementTree as ET

import jax
from accelerator_suite import _counts


def _device() -> str:
    d = jax.devices()[0]
    if d.platform != "cpu":
        return d.device_kind
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "CPU",
    )
    return f"{model}, {os.cpu_count()} cores"


def row(junit: pathlib.Path) -> tuple[str, dict[str, int], float]:
    """(Markdown row, counts, the suite's wall time in seconds) of ``junit``."""
    c = _counts(junit)
    seconds = sum(float(s.get("time", 0.0)) for s in ET.parse(junit).getroot().iter("testsuite"))
    python = platform.python_version()
    line = (
        f"| {jax.default_backend()} | {_device()}, Python {python} | {jax.__version__} | "
        f"{c['passed']} | {c['failed']} | {c['skipped']} | {c['xfailed']} | "
        f"{datetime.date.today().isoformat()} |"
    )
    return line, c, seconds


def main(argv: list[str]) -> int:
    line, c, seconds = row(pathlib.Path(argv[0]))
    print("| backend | device | JAX | passed | failed | skipped | xfailed | date |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    print(line)
    print(f"({argv[0]}: pytest wall time {seconds / 60:.1f} min)")
    return 1 if c["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
