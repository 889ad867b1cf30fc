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


# --- every Python block of README.md and docs/*.md runs as written ---------
#
# pytest-examples finds the ```python blocks, runs each one as a module and
# compares what it prints with the `#> ` lines (or the quoted block) written
# under its `print` calls; `pytest tests/test_docs.py --update-examples`
# rewrites them. A block whose first line is
#   `# (continues the example above)`   runs with the previous block's names;
#   `# Not run by the doc tests: <why>` is skipped, the reason shown;
#   `# Expected to fail: <why>`         is an xfail (a strict one).
# docs/accelerators.md is a record of GPU runs, not a tutorial: not collected.

from pytest_examples import CodeExample, EvalExample, find_examples  # noqa: E402

_PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if p.name != "accelerators.md")]
EXAMPLES = list(find_examples(*_PAGES))
_CONTINUES = "# (continues the example above)"
_SKIP = "# Not run by the doc tests:"
_XFAIL = "# Expected to fail:"
_DONE: dict[str, dict] = {}  # example -> its module's names after running


def _first_line(example: CodeExample) -> str:
    return example.source.lstrip().splitlines()[0].strip()


def _previous(example: CodeExample) -> CodeExample:
    same = [e for e in EXAMPLES if e.path == example.path and e.start_line < example.start_line]
    if not same:
        raise AssertionError(f"{example} says it continues an example, but none comes before it")
    return same[-1]


def _source_name(text: str) -> str:
    # the module a block runs as is `<page>_<first>_<last>.py`: show it as train.py
    return re.sub(r"\b[\w-]+_\d+_\d+\.py", "train.py", text)


def _run(example: CodeExample, eval_example: EvalExample, check: bool) -> dict:
    key = str(example)
    if key in _DONE:
        return _DONE[key]
    names = {}
    if _first_line(example) == _CONTINUES:
        names = _run(_previous(example), eval_example, check=False)
    eval_example.print_callback = _source_name
    if check and eval_example.update_examples:
        names = eval_example.run_print_update(example, module_globals=names)
    elif check:
        names = eval_example.run_print_check(example, module_globals=names)
    else:
        names = eval_example.run(example, module_globals=names)
    _DONE[key] = names
    return names


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_doc_example_runs(example: CodeExample, eval_example: EvalExample, monkeypatch, tmp_path):
    first = _first_line(example)
    if first.startswith(_SKIP):
        pytest.skip(first[len(_SKIP) :].strip())
    if first.startswith(_XFAIL):
        with pytest.raises(Exception):  # noqa: B017 (the page says which error)
            _run(example, eval_example, check=True)
        pytest.xfail(first[len(_XFAIL) :].strip())
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    _run(example, eval_example, check=True)
