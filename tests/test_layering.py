"""Packages talk through their public faces: read off the source with ``ast``.

``amp_jax.optim``, ``amp_jax.eager``, ``amp_jax.demo`` and ``amp_jax._src`` (the
core every package may use) are separate packages: none reaches into another's
private modules or private names (``from amp_jax.optim import _tree``,
``_loss_scale._unscale``). Each test also runs its check on a copy of the code it
guards against, so a check that finds nothing cannot pass by accident.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PACKAGES = {p.parent.name for p in (ROOT / "amp_jax").glob("*/__init__.py")}


def _package(module: str) -> str:
    """``amp_jax.optim._x`` -> ``optim``; a module of the top level (``amp_jax``,
    ``amp_jax.debug``) is the public face itself: ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else ""


def _is_module(root: pathlib.Path, dotted: str) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def private_reaches(root: pathlib.Path, source: dict[str, str] | None = None) -> list[str]:
    """Every place in ``root/amp_jax`` where a module uses another package's
    private module or private name: ``file:line: what``. ``source`` overrides
    the text of files (relative path -> text)."""
    found = []
    for path in sorted((root / "amp_jax").rglob("*.py")):
        rel = str(path.relative_to(root))
        text = (source or {}).get(rel, None) or path.read_text()
        own = _package(_module_name(path, root))
        modules: dict[str, str] = {}  # local name -> module of another package
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_jax."):
                pkg = _package(node.module)
                if pkg == own or pkg == "":
                    continue
                inner = node.module.split(".")[2:]
                if pkg != "_src" and any(p.startswith("_") for p in inner):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import ...")
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{rel}:{node.lineno}: {node.module}.{alias.name}")
                    if _is_module(root, f"{node.module}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("amp_jax.") and _package(alias.name) not in (own, ""):
                        if alias.asname:
                            modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{rel}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def _none(found: list[str], fix: str) -> None:
    assert not found, fix + ":\n  " + "\n  ".join(found)


def test_no_package_reaches_into_another_packages_private_names():
    fix = "give it a public face (amp_jax.optim's names, or a shared module in amp_jax/_src)"
    _none(private_reaches(ROOT), "a module uses another package's private module or name; " + fix)


def test_private_reaches_finds_what_the_eager_step_used_to_call():
    # the hidden hook this check replaced: eager calling the loss scaler's privates
    old = (
        "from amp_jax.optim import _loss_scale\n"
        "def f(g, s):\n"
        "    return _loss_scale._all_finite(_loss_scale._unscale(g, s))\n"
    )
    found = private_reaches(ROOT, {"amp_jax/eager/_scan_step.py": old})
    assert any("_scan_step.py:1: amp_jax.optim._loss_scale" in f for f in found), found
    assert any("amp_jax.optim._loss_scale._unscale" in f for f in found), found
    private_module = {"amp_jax/eager/_deps.py": "from amp_jax.optim._tree import find_states\n"}
    assert any(
        "_deps.py:1: from amp_jax.optim._tree" in f for f in private_reaches(ROOT, private_module)
    )


# -- the backend travels as a record -------------------------------------------------------

_BACKEND_MODULES = {"cpu", "gpu"}


def backend_lookups(root: pathlib.Path, source: dict[str, str] | None = None) -> list[str]:
    """Every place in ``root/amp_jax`` outside ``_src/backends/`` that looks a
    backend up by name (``backend_for``), imports a backend module (``cpu``,
    ``gpu``), or, in the policy module, imports the backends at all."""
    found = []
    for path in sorted((root / "amp_jax").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel.startswith("amp_jax/_src/backends/"):
            continue
        text = (source or {}).get(rel, None) or path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "amp_jax._src.backends"
            ):
                sub = node.module.split(".")[3:]
                names = {a.name for a in node.names}
                if rel == "amp_jax/_src/policy.py":
                    found.append(f"{rel}:{node.lineno}: the policy imports {node.module}")
                if set(sub) & _BACKEND_MODULES or names & (_BACKEND_MODULES | {"backend_for"}):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import {sorted(names)}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("amp_jax._src.backends"):
                        found.append(f"{rel}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.Attribute) and node.attr == "backend_for":
                found.append(f"{rel}:{node.lineno}: .backend_for")
            elif isinstance(node, ast.Attribute) and node.attr in _BACKEND_MODULES:
                if isinstance(node.value, ast.Name) and node.value.id == "backends":
                    found.append(f"{rel}:{node.lineno}: backends.{node.attr}")
    return found


def test_no_module_outside_backends_looks_a_backend_up_by_name():
    why = "the Backend record is resolved once per trace (planning.Config.backend) and "
    _none(backend_lookups(ROOT), why + "handed down; kernel facts live in amp_jax/_src/backends/")


def test_backend_lookups_finds_what_the_modules_used_to_do():
    old = {
        "amp_jax/_src/attention.py": "from amp_jax._src.backends import backend_for, gpu\n",
        "amp_jax/_src/policy.py": "from amp_jax._src.backends import Backend\n",
        "amp_jax/_src/dots.py": "from amp_jax._src import backends\nd = backends.backend_for('cpu')\n",
    }
    found = backend_lookups(ROOT, old)
    assert any(f.startswith("amp_jax/_src/attention.py:1: from") for f in found), found
    assert any("the policy imports" in f for f in found), found
    assert any(f.startswith("amp_jax/_src/dots.py:2: .backend_for") for f in found), found


# -- one name for one thing -------------------------------------------------------------

#: class names still defined twice in amp_jax/_src, and why (shrink, never grow)
KNOWN_TWICE = {"Env": "jaxprs.Env and the elementwise.Env protocol: issue 50, item 4"}


def classes_defined_twice(root: pathlib.Path, source: dict[str, str] | None = None) -> set[str]:
    """Top-level class names (leading underscores dropped) that two modules of
    ``amp_jax/_src`` define."""
    seen: dict[str, str] = {}
    twice = set()
    for path in sorted((root / "amp_jax" / "_src").rglob("*.py")):
        rel = str(path.relative_to(root))
        text = (source or {}).get(rel, None) or path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                name = node.name.lstrip("_")
                if name in seen and seen[name] != rel:
                    twice.add(name)
                seen.setdefault(name, rel)
    return twice


def test_no_two_modules_define_a_class_of_one_name():
    twice = classes_defined_twice(ROOT)
    assert twice <= set(KNOWN_TWICE), f"defined in two modules of amp_jax/_src: {twice}"
    # the check sees attention's plan as it used to be named
    old = {"amp_jax/_src/attention.py": "class Plan:\n    pass\n"}
    assert "Plan" in classes_defined_twice(ROOT, old)
