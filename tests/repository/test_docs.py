"""The documentation builds in strict mode and covers every public name."""

import html
import importlib
import inspect
import itertools
import os
import pathlib
import re
import subprocess
import sys
import traceback

import pytest

import amp_jax
import amp_jax.optim

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    _check_api_renders(api)


def _check_api_renders(api_html: str) -> None:
    """What mkdocstrings shows: no reST roles, no private names in signatures."""
    text = html.unescape(re.sub(r"<[^>]+>", "", api_html))
    roles = sorted(set(re.findall(r":(?:class|func|meth|attr|data|mod|obj|exc):`[^`]*`", text)))
    assert not roles, f"reST roles render as literal text; write [`X`][amp_jax.X]: {roles[:10]}"
    private = sorted(set(re.findall(r"\w+\s*(?::[^=\n]+)?=\s*_[A-Za-z]\w*", text)))
    assert not private, f"private names as defaults in rendered signatures: {private[:10]}"
    assert "*extra" not in text


# --- every Python block of README.md and docs/*.md runs as written ---------
#
# pytest-examples finds the ```python blocks, runs each one as a module and
# compares what it prints with the `# > ` lines (or the quoted block) written
# under its `print` calls; `pytest tests/repository/test_docs.py --update-examples`
# rewrites them. A block whose leading comment lines include
#   `# (continues the example above)`   runs with the names of the previous
#                                        block that runs;
#   `# Not run by the doc tests: <why>` is skipped, the reason shown;
#   `# Expected to fail: "<error>" <why>` must raise an error whose message
#                                        holds <error> (an xfail).

from pytest_examples import CodeExample, EvalExample, find_examples  # noqa: E402
from pytest_examples import run_code as _run_code  # noqa: E402

# `ruff format` (which formats the Python blocks of markdown files too) writes
# pytest-examples' `#> output` comments as `# > output`: use that spelling.
_run_code.comment_prefix = "# > "
_run_code.comment_prefix_re = re.compile(r"^ *# > ", re.MULTILINE)

_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
EXAMPLES = list(find_examples(*_PAGES))
_CONTINUES = "# (continues the example above)"
_SKIP = "# Not run by the doc tests:"
_XFAIL = "# Expected to fail:"
_DONE: dict[str, dict] = {}  # example -> its module's names after running


def _markers(example: CodeExample) -> list[str]:
    lines = example.source.lstrip().splitlines()
    return [l.strip() for l in itertools.takewhile(lambda l: l.startswith("#"), lines)]


def _marked(example: CodeExample, prefix: str) -> str | None:
    return next((m[len(prefix) :].strip() for m in _markers(example) if m.startswith(prefix)), None)


def _previous(example: CodeExample) -> CodeExample:
    same = [
        e
        for e in EXAMPLES
        if e.path == example.path
        and e.start_line < example.start_line
        and _marked(e, _SKIP) is None
        and _marked(e, _XFAIL) is None
    ]
    if not same:
        raise AssertionError(f"{example} says it continues an example, but none comes before it")
    return same[-1]


def _write_train_py(example: CodeExample) -> pathlib.Path:
    # every block runs as ./train.py (cwd: the test's tmp_path), so the source
    # lines explain and first_nonfinite print read `train.py:<line in the block>`
    path = pathlib.Path("train.py")
    path.write_text(example.source)
    return path


def _run(example: CodeExample, eval_example: EvalExample, check: bool) -> dict:
    key = str(example)
    if key in _DONE:
        return _DONE[key]
    names = {}
    if _CONTINUES in _markers(example):
        names = _run(_previous(example), eval_example, check=False)
    eval_example._write_file = _write_train_py
    try:
        if check and eval_example.update_examples:
            names = eval_example.run_print_update(example, module_globals=names)
        elif check:
            names = eval_example.run_print_check(example, module_globals=names)
        else:
            names = eval_example.run(example, module_globals=names)
    except Exception as exc:
        # pytest-examples' own traceback (rewritten to point into the page) makes
        # pytest's report crash on Python 3.11: name the page line ourselves
        lines, tb = [], exc.__traceback__
        while tb is not None:  # its frames carry the page's file name and line numbers
            if tb.tb_frame.f_code.co_filename == str(example.path):
                lines.append(tb.tb_lineno)
            tb = tb.tb_next
        at = f"{example.path.name}:{lines[-1]}" if lines else str(example)
        raise AssertionError(
            f"the example at {at} raised\n"
            + "".join(traceback.format_exception_only(type(exc), exc))
        ) from None
    _DONE[key] = names
    return names


@pytest.fixture(scope="module")
def _examples_dir(tmp_path_factory):
    # one directory for all: a block continuing another calls functions whose
    # source is the other's train.py, named relative to the working directory
    return tmp_path_factory.mktemp("doc_examples")


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_doc_example_runs(
    example: CodeExample, eval_example: EvalExample, monkeypatch, _examples_dir
):
    monkeypatch.chdir(_examples_dir)  # blocks that write files write them here
    if (why := _marked(example, _SKIP)) is not None:
        pytest.skip(why)
    if (why := _marked(example, _XFAIL)) is not None:
        error = re.match(r'"([^"]+)"', why)
        assert error, (
            f'{example}: write the expected error first: # Expected to fail: "<error>" ...'
        )
        with pytest.raises(AssertionError, match=re.escape(error.group(1))):
            _run(example, eval_example, check=True)
        pytest.xfail(why)
    _run(example, eval_example, check=True)


def test_committed_generated_tables_are_current():
    # the op tables are committed so the page reads the same in the repository view
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        hook = importlib.import_module("amp_docs")
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    page = (DOCS / "how-amp-works.md").read_text()
    assert hook.fill_blocks(page) == page, "run `python docs/hooks/amp_docs.py` and commit"


# --- the README reads in two minutes ---------------------------------------------------


def test_readme_is_short_and_plain():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10_000, f"README.md is {len(text.encode())} bytes (at most 10 KB)"
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > 300]
    assert not long, f"README.md lines over 300 characters: {long}"
    intro = text[: text.index("```")]  # what, why and a number before the first code block
    assert "mixed precision for JAX" in intro and re.search(r"\d(\.\d)?x faster", intro)
    # the policy's class words are the docs' vocabulary: not before they are explained
    for word in ("allow", "deny", "follow", "clear", "painting", "painted"):
        assert not re.search(rf"\b{word}\b", text, flags=re.I), f"README.md uses {word!r}"
    # how long each command takes, and an install without a clone
    nox_line = next(ln for ln in text.splitlines() if ln.startswith("pip install nox uv && nox"))
    assert re.search(r"\d+ (to \d+ )?minutes", nox_line), nox_line  # (its duration, on its line)
    assert "4-5 minutes" in text and "amp-jax-demo" in text
    assert "git+https://github.com/amp-jax/amp_jax" in text


# --- user pages speak of amp_jax, not of how we made it --------------------------------

# a date (also inside a path), a count of our runs, our own shorthand; the run-by-run
# record lives in benchmarks/ (benchmarks/results/ACCELERATOR_RUNS.md), whose files keep dates
_OUR_OWN = re.compile(
    r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)"
    r"|\b(?:one|first|second|third|last)\s+run\b|\b(?:two|three|four|five)\s+runs\b"
    r"|nobody\s+here|weak\s+column",
    flags=re.I,
)
# every user page (README.md and the site's pages) but the changelog, which may carry dates
_USER_PAGES = [
    ROOT / "README.md",
    *sorted(p for p in DOCS.glob("*.md") if p.name != "changelog.md"),
]


@pytest.mark.parametrize("page", _USER_PAGES, ids=lambda p: p.name)
def test_user_page_has_no_dates_run_counts_or_our_shorthand(page):
    text = page.read_text()
    found = [
        f"{page.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for m in _OUR_OWN.finditer(text)
    ]
    assert not found, "dates, run counts or our own shorthand on a user page:\n" + "\n".join(found)


def test_user_pages_do_not_speak_of_how_gpu_runs_are_budgeted():
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        text = page.read_text()
        for phrase in (
            "device time",
            "is lent",
            "minutes a command",
            "own session",
            "GPU round",
            "this round",
        ):
            assert phrase not in text, f"{page.name} speaks of our own runs: {phrase!r}"
