"""The test suite on each supported JAX: ``nox`` runs the four legs CI runs.

    pip install nox uv && nox                 # every leg whose Python is here (.ci/run: all)
    nox -s tests-3.13                         # one leg: Python 3.13, the newest JAX
    nox -s tests-3.12 -- tests/test_compat.py # one leg, pytest arguments after --
    nox -s lowest-3.11                        # the lowest direct dependency versions

Each leg is one Python with one JAX, installed by uv into a fresh virtualenv:

- Python 3.11 with JAX 0.10.2, the lowest pyproject.toml admits;
- Python 3.12 with JAX 0.11.2 (what the accelerator machines run);
- Python 3.13 with the newest JAX the registry serves (``--upgrade``, no pin;
  the leg prints the version it got);
- Python 3.11 with every direct dependency at the lowest version
  pyproject.toml admits (``uv pip install --resolution lowest-direct``: JAX
  0.10.2 again; optax, numpy, Flax, Equinox, orbax, Haiku, Keras, pytest...
  at their lower bounds), so that those bounds stay true.

Only the newest-JAX leg (3.13) runs the tests marked ``heavy`` (the
benchmarks' smoke runs, tests/repository/test_benchmarks.py; the model libraries of
tests/behaviour/test_model_libraries.py, which the ``integrations`` extra installs on
3.13 only); the others pass ``-m "not heavy"``.

The four take 45 to 60 minutes on a 2-core CPU (README), within CI's 90;
one leg takes 10 to 18.

Pythons are found on PATH; a pyenv install's versions are added to it, since
pyenv's shims expose only the selected one. A leg whose Python is missing is
skipped with nox's line ``Session tests-3.12 skipped: Python interpreter 3.12
not found``, and a machine with none of the three runs the suite once on the
Python running nox (the ``here`` session), so that the README's command passes
on a machine with any one Python 3.11+. CI (``.ci/run`` sets ``AMP_JAX_CI=1``)
requires every leg: a missing Python fails it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Mapping

import nox

nox.options.default_venv_backend = "uv"

#: Python of each leg -> the JAX it runs (None: the newest the registry serves).
LEGS = {"3.11": "0.10.2", "3.12": "0.11.2", "3.13": None}
#: What ``nox`` with no -s runs: every leg.
EVERY_LEG = ["tests-3.11", "tests-3.12", "tests-3.13", "lowest-3.11"]
#: Set by .ci/run: every leg must run, a missing Python is an error.
CI_VARIABLE = "AMP_JAX_CI"
PYTEST = ("python", "-m", "pytest", "-q", "-n", "2")
#: What the legs other than the newest-JAX one deselect (the ``heavy`` marker, pyproject.toml).
NOT_HEAVY = ("-m", "not heavy")
JUNIT = pathlib.Path("build", "junit")


def _pyenv_pythons_on_path() -> None:
    """Puts every pyenv Python's bin directory on PATH (newest release first)."""
    root = pathlib.Path(os.environ.get("PYENV_ROOT") or pathlib.Path.home() / ".pyenv")
    versions = sorted(
        (p for p in root.glob("versions/3.*") if (p / "bin" / "python").exists()),
        key=lambda p: tuple(int(x) if x.isdigit() else -1 for x in p.name.split(".")),
        reverse=True,
    )
    os.environ["PATH"] = os.pathsep.join([*(str(p / "bin") for p in versions), os.environ["PATH"]])


def _default_sessions(environ: Mapping[str, str], found: Callable[[str], bool]) -> list[str]:
    """The sessions ``nox`` runs: every leg, or ``here`` where no leg's Python is found.

    ``found(version)`` says whether a Python of that version is on PATH. In CI
    (``AMP_JAX_CI`` set) every leg, found or not: nox then fails a missing one.
    """
    if environ.get(CI_VARIABLE) or any(found(v) for v in LEGS):
        return list(EVERY_LEG)
    return ["here"]


def _python_on_path(version: str) -> bool:
    return shutil.which(f"python{version}") is not None


_pyenv_pythons_on_path()
# Use the Pythons found above; never download one (CI reaches the package registry only).
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
if hasattr(nox.options, "download_python"):  # nox 2025.10+
    nox.options.download_python = "never"
# CI requires every leg; elsewhere nox skips a leg whose Python is missing, saying so.
nox.options.error_on_missing_interpreters = bool(os.environ.get(CI_VARIABLE))
nox.options.sessions = _default_sessions(os.environ, _python_on_path)


def _print_versions(session: nox.Session) -> None:
    session.run(
        "python",
        "-c",
        "import sys, jax, jaxlib, numpy, optax, flax; "
        "print('leg:', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', "
        "jaxlib.__version__, 'numpy', numpy.__version__, 'optax', optax.__version__, "
        "'flax', flax.__version__)",
    )


def _run_suite(session: nox.Session, *pytest_args: str, env: dict[str, str] | None = None) -> None:
    """pytest on this leg, then the leg's row for benchmarks/results/ACCELERATOR_RUNS.md from its junit."""
    _print_versions(session)
    JUNIT.mkdir(parents=True, exist_ok=True)
    junit = JUNIT / f"{session.name}.xml"
    # pytest's 1 (tests failed) still gets its row printed; version_row.py then fails the leg
    session.run(
        *PYTEST,
        f"--junitxml={junit}",
        *pytest_args,
        *session.posargs,
        success_codes=[0, 1],
        env=env,
    )
    session.run("python", "tools/version_row.py", str(junit))


@nox.session(python=list(LEGS))
def tests(session: nox.Session) -> None:
    """The whole suite on one Python with its JAX (see ``LEGS``)."""
    jax_version = LEGS[session.python]
    pins = [f"jax=={jax_version}", f"jaxlib=={jax_version}"] if jax_version else ["--upgrade"]
    extras = "test,docs,integrations" + ("" if jax_version else ",release")
    session.install("-e", f".[{extras}]", *pins)
    # heavy tests and the packaging check (build, twine check, install in a fresh venv)
    # on the newest leg only
    _run_suite(
        session,
        *(NOT_HEAVY if jax_version else ()),
        env=None if jax_version else {"AMP_JAX_PACKAGING": "1"},
    )


@nox.session(python=None)
def here(session: nox.Session) -> None:
    """The suite on the Python running nox with the newest JAX, heavy tests included.

    Run by ``nox`` only where none of the legs' Pythons is found (a machine with
    Python 3.14 alone, say); ``nox -s here`` runs it anywhere.
    """
    session.install("-e", ".[test,docs,integrations,release]", "--upgrade")
    _run_suite(session, env={"AMP_JAX_PACKAGING": "1"})


@nox.session(python=["3.11"])
def lowest(session: nox.Session) -> None:
    """The suite with every direct dependency at the lowest version pyproject admits."""
    session.install("--resolution", "lowest-direct", "-e", ".[test,docs,integrations]")
    _run_suite(session, *NOT_HEAVY)
