"""Resume a test run that was cut off by a time limit (the GPU session's budget).

With ``AMP_JAX_RESUME=<file>`` set, conftest.py loads these hooks: every test
whose outcome is reported is appended to ``<file>`` as its node id, and tests
already listed there are deselected at collection. A second run with the same
file runs only what the first did not reach::

    AMP_JAX_RESUME=done.txt timeout -s INT 300 pytest -n 14 ...   # cut off
    AMP_JAX_RESUME=done.txt pytest -n 14 ...                        # the rest

Under pytest-xdist the controller writes the file (each report reaches it
once); the workers only read it, so all of them collect the same tests.
"""

from __future__ import annotations

import os
import pathlib

import pytest


def _path() -> pathlib.Path:
    return pathlib.Path(os.environ["AMP_JAX_RESUME"])


def _done() -> set[str]:
    path = _path()
    return set(path.read_text().split("\n")) - {""} if path.exists() else set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    done = _done()
    skipped = [item for item in items if item.nodeid in done]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if item.nodeid not in done]


_WRITES = [True]  # False in a pytest-xdist worker, whose reports reach the controller too


def pytest_configure(config: pytest.Config) -> None:
    _WRITES[0] = not hasattr(config, "workerinput")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # one line per test: its teardown report is the last one (also after a skip
    # or a failure in setup)
    if report.when != "teardown" or not _WRITES[0]:
        return
    with _path().open("a") as fh:
        fh.write(report.nodeid + "\n")
