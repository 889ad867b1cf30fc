"""The documentation builds in strict mode and covers every public name."""

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import amp_jax
import amp_jax.optim

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _public_modules():
    mods = [amp_jax, amp_jax.optim, importlib.import_module("amp_jax.debug")]
    try:
        mods.append(importlib.import_module("amp_jax.eager"))
    except ModuleNotFoundError:
        pass
    return mods


def _directives():
    found = set()
    for page in DOCS.rglob("*.md"):
        found.update(re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(), flags=re.M))
    return found


PUBLIC = [(m.__name__, n) for m in _public_modules() for n in m.__all__]


@pytest.mark.parametrize("module, name", PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_documented(module, name):
    obj = getattr(sys.modules[module], name)
    qual = f"{module}.{name}"
    assert qual in _directives(), (
        f"{qual} is in {module}.__all__ but on no API page: add '::: {qual}' to docs/api/*.md"
    )
    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj) or callable(obj):
        doc = inspect.getdoc(obj)
        assert doc and doc.strip(), f"{qual} has no docstring"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")  # not on the accelerator machine; CI installs the test extra
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("XLA_FLAGS", None)
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about its successor
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    site = tmp_path / "site"
    how = (site / "how-amp-works" / "index.html").read_text()
    for name, cls in amp_jax.get_policy("bfloat16").table():
        assert f"<code>{name}</code>" in how, f"generated op table lacks {name} ({cls})"
    api = "".join(page.read_text() for page in sorted((site / "api").rglob("index.html")))
    for module, name in PUBLIC:
        assert f'id="{module}.{name}"' in api, f"{module}.{name} was not rendered on an API page"
