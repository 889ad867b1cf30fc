"""The package builds as an sdist and a wheel that install and import in a fresh venv.

Slow (a build and an install from the registry's cache), so it runs on one leg: the
newest (noxfile.py sets AMP_JAX_PACKAGING=1 there), or anywhere with that variable set.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not os.environ.get("AMP_JAX_PACKAGING"),
    reason="packaging check runs on the newest leg (AMP_JAX_PACKAGING=1)",
)


def _run(*cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_readme_links_are_absolute():
    # the README is the package index's long description: relative links would break there
    readme = (ROOT / "README.md").read_text()
    relative = [l for l in re.findall(r"\]\(([^)]+)\)", readme) if not l.startswith(("http", "#"))]
    assert not relative, f"README links must be absolute (https://github.com/...): {relative}"


def test_sdist_and_wheel_build_install_and_import(tmp_path):
    pytest.importorskip("build")
    uv = shutil.which("uv")
    installer = ["--installer", "uv"] if uv else []
    dist = tmp_path / "dist"
    # sdist first, then the wheel built from the sdist: a file the sdist lacks fails here
    _run(sys.executable, "-m", "build", *installer, "--outdir", str(dist), str(ROOT))
    wheel = next(dist.glob("amp_jax-*.whl"))
    sdist = next(dist.glob("amp_jax-*.tar.gz"))
    _run(sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist))
    # self-consistent: no tests that would need the repository's workloads/ and benchmarks/
    with tarfile.open(sdist) as tar:
        members = [m.split("/", 1)[1] for m in tar.getnames() if "/" in m]
    assert not [m for m in members if m.startswith("tests/")], members
    assert "amp_jax/__init__.py" in members and "LICENSE" in members
    names = zipfile.ZipFile(wheel).namelist()
    assert "amp_jax/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names), names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "Project-URL: Source" in meta
    venv = tmp_path / "venv"
    if uv:
        _run(uv, "venv", "--python", sys.executable, str(venv))
        python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
        _run(uv, "pip", "install", "--python", str(python), str(wheel))
    else:
        _run(sys.executable, "-m", "venv", str(venv))
        python = venv / "bin" / "python"
        _run(str(python), "-m", "pip", "install", "-q", str(wheel))
    out = _run(
        str(python),
        "-c",
        "import amp_jax, amp_jax.optim, amp_jax.eager, jax.numpy as jnp; "
        "print(amp_jax.__version__, amp_jax.amp(lambda a: a @ a)(jnp.ones((4, 4))).dtype)",
        cwd=tmp_path,  # not the repository: import the installed package
    )
    assert out.split() == ["0.1.0", "float32"], out
