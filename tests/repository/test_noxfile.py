"""The README's test command (``nox``) on a machine with one Python, and CI's (``.ci/run``).

noxfile.py is imported with a stand-in for nox (the legs' virtualenvs do not install nox),
so these check the noxfile's own choices: which sessions run, and whether a missing Python
fails its leg or skips it.
"""

import importlib.util
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fake_nox() -> types.ModuleType:
    nox = types.ModuleType("nox")
    nox.options = types.SimpleNamespace(download_python=None)
    nox.sessions = {}

    def session(python=None):
        def register(fn):
            nox.sessions[fn.__name__] = python
            return fn

        return register

    nox.session = session
    return nox


def _load_noxfile(monkeypatch, env: dict[str, str]):
    monkeypatch.setitem(sys.modules, "nox", _fake_nox())
    for key in ("AMP_JAX_CI", "UV_PYTHON_DOWNLOADS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", str(ROOT))  # restored after the test
    spec = importlib.util.spec_from_file_location("_noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_requires_every_leg(monkeypatch):
    noxfile = _load_noxfile(monkeypatch, {"AMP_JAX_CI": "1"})
    assert noxfile.nox.options.error_on_missing_interpreters is True
    assert noxfile.nox.options.sessions == noxfile.EVERY_LEG
    assert noxfile.EVERY_LEG == ["tests-3.11", "tests-3.12", "tests-3.13", "lowest-3.11"]
    # with no Python found at all, CI still asks for every leg (nox then fails them)
    assert noxfile._default_sessions({"AMP_JAX_CI": "1"}, lambda v: False) == noxfile.EVERY_LEG


def test_elsewhere_a_missing_python_is_skipped(monkeypatch):
    noxfile = _load_noxfile(monkeypatch, {})
    assert noxfile.nox.options.error_on_missing_interpreters is False
    assert noxfile.nox.options.download_python == "never"


@pytest.mark.parametrize("have", ["3.11", "3.12", "3.13"])
def test_one_python_runs_the_legs(monkeypatch, have):
    noxfile = _load_noxfile(monkeypatch, {})
    assert noxfile._default_sessions({}, lambda v: v == have) == noxfile.EVERY_LEG


def test_no_leg_python_runs_the_suite_on_nox_python(monkeypatch):
    noxfile = _load_noxfile(monkeypatch, {})
    assert noxfile._default_sessions({}, lambda v: False) == ["here"]
    assert noxfile.nox.sessions["here"] is None  # nox's own interpreter
    assert noxfile.nox.sessions["tests"] == ["3.11", "3.12", "3.13"]


def test_ci_script_is_the_readme_command():
    readme = (ROOT / "README.md").read_text()
    run = (ROOT / ".ci" / "run").read_text()
    command = "pip install nox uv && nox"
    assert command in readme and run.rstrip().endswith(command)
    assert "export AMP_JAX_CI=1" in run
