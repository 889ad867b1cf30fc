"""One formatter and one linter for the whole repository (ruff, configured in pyproject.toml)."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("ruff")
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cmd", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(cmd):
    r = subprocess.run(
        [sys.executable, "-m", "ruff", *cmd, "."], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, (
        f"ruff {' '.join(cmd)} failed; run `ruff {cmd[0]} .`:\n{r.stdout}{r.stderr}"
    )
