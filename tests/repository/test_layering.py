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
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
#: the policy (a user's data) and what it is made of know no backend
_POLICY_MODULES = {f"amp_jax/_src/{m}.py" for m in ("policy", "op_classes", "policy_names")}


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
                if rel in _POLICY_MODULES:
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
    why = "the Backend record is resolved once per trace (context.Context.backend) and "
    _none(backend_lookups(ROOT), why + "handed down; kernel facts live in amp_jax/_src/backends/")


def test_backend_lookups_finds_what_the_modules_used_to_do():
    old = {
        "amp_jax/_src/attention/plan.py": "from amp_jax._src.backends import backend_for, gpu\n",
        "amp_jax/_src/policy.py": "from amp_jax._src.backends import Backend\n",
        "amp_jax/_src/rules/dots/lowering.py": (
            "from amp_jax._src import backends\nd = backends.backend_for('cpu')\n"
        ),
    }
    found = backend_lookups(ROOT, old)
    assert any(f.startswith("amp_jax/_src/attention/plan.py:1: from") for f in found), found
    assert any("the policy imports" in f for f in found), found
    assert any(f.startswith("amp_jax/_src/rules/dots/lowering.py:2: .backend_for") for f in found)


# -- one name for one thing -------------------------------------------------------------

#: class names still defined twice in amp_jax/_src, and why (shrink, never grow)
KNOWN_TWICE: dict[str, str] = {}


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
    # the check sees attention's plan as it used to be named, and the Env protocol
    # that elementwise.py held beside jaxprs.Env
    old = {"amp_jax/_src/attention/match.py": "class Plan:\n    pass\n"}
    assert "Plan" in classes_defined_twice(ROOT, old)
    old = {"amp_jax/_src/rules/elementwise.py": "class Env:\n    pass\n"}
    assert "Env" in classes_defined_twice(ROOT, old)


def env_roots(root: pathlib.Path, source: dict[str, str] | None = None) -> list[str]:
    """The classes of ``amp_jax/_src`` named ``...Env`` that are not `jaxprs.Env`
    or derived from it (by a base written ``jaxprs.Env``, or one of these)."""
    found = []
    for path in sorted((root / "amp_jax" / "_src").rglob("*.py")):
        rel = str(path.relative_to(root))
        text = (source or {}).get(rel, None) or path.read_text()
        for node in ast.parse(text).body:
            if not isinstance(node, ast.ClassDef) or not node.name.endswith("Env"):
                continue
            if rel == "amp_jax/_src/jaxprs.py" and node.name == "Env":
                continue
            if not any(ast.unparse(b) == "jaxprs.Env" for b in node.bases):
                found.append(f"{rel}:{node.lineno}: class {node.name}")
    return found


def test_one_env_hierarchy():
    """The values of a jaxpr in one evaluation are a `jaxprs.Env`; the
    interpreter's (with its casts, read by the rules) derives from it."""
    _none(env_roots(ROOT), "derive it from jaxprs.Env")
    old = {"amp_jax/_src/interpreter.py": "class _Env:\n    pass\n"}
    assert env_roots(ROOT, old) == ["amp_jax/_src/interpreter.py:1: class _Env"]


# -- the rules: a package with its base and table ------------------------------------------

#: the modules of amp_jax/_src/rules/ and the names each defines (at least); the dot
#: family is one package: its rule, the tangent product, float8 and what planning asks
RULES_LAYOUT = {
    "base.py": {"EqnRule", "AllowRule", "CastingEnv", "Rule", "default_allow_rule"},
    "table.py": {"TABLE", "rule_for", "register_rule"},
    "elementwise.py": {"BroadcastRule", "ExpandRule", "RULES"},
    "dots/lowering.py": {"DotRule", "TransposeRule", "RULES", "plan_layouts"},
    "dots/lowdot.py": {"linear_dot_p", "linear_dot", "dot_transpose"},
    "dots/float8.py": {"applies", "reason", "variant_rule", "float8_dot_rule"},
    "dots/outputs.py": {"allow_output_dtype", "rule_reason"},
    "higher_order.py": {"HigherOrderRule", "ScanRule", "GENERIC", "RULES"},
}

#: modules of the old layouts, now in amp_jax/_src/rules/ (path under amp_jax/_src)
OLD_PLACES = ("rules.py", "elementwise.py", "dots.py", "higher_order.py", "lowdot.py", "float8.py")

#: what runs the rules: a module of amp_jax/_src/rules/ imports none of them
RULE_USERS = (
    "planning",
    "control",
    "painted",
    "classify",
    "interpreter",
    "painting",
    "transform",
    "calling",
    "diagnostics",
)


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def rules_layout(root: pathlib.Path, source: dict[str, str] | None = None) -> list[str]:
    """What is out of place in ``amp_jax/_src/rules/``: a module or name of
    `RULES_LAYOUT` missing, a module of the old layout left at the top of
    ``_src``, an import of a module that runs the rules (`RULE_USERS`)."""
    found = []
    pkg = root / "amp_jax" / "_src" / "rules"
    for name, names in RULES_LAYOUT.items():
        rel = f"amp_jax/_src/rules/{name}"
        text = (source or {}).get(rel, None)
        if text is None and not (pkg / name).is_file():
            found.append(f"{rel}: missing")
            continue
        missing = names - _defined(ast.parse(text or (pkg / name).read_text()))
        if missing:
            found.append(f"{rel}: does not define {sorted(missing)}")
    for old in (*OLD_PLACES, "rules/dots.py"):
        if (root / "amp_jax" / "_src" / old).is_file() or f"amp_jax/_src/{old}" in (source or {}):
            found.append(f"amp_jax/_src/{old}: belongs in amp_jax/_src/rules/")
    paths = {str(p.relative_to(root)): p for p in pkg.rglob("*.py")}
    for rel in sorted(
        {*paths, *(r for r in (source or {}) if r.startswith(str(pkg.relative_to(root))))}
    ):
        text = (source or {}).get(rel, None) or paths[rel].read_text()
        for node in ast.walk(ast.parse(text)):
            mods = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_jax._src"):
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                parts = m.split(".")
                if len(parts) > 2 and parts[:2] == ["amp_jax", "_src"] and parts[2] in RULE_USERS:
                    found.append(f"{rel}:{node.lineno}: imports {m}")
    return found


def test_the_rule_base_is_a_package_with_its_table():
    _none(rules_layout(ROOT), "the rules live in amp_jax/_src/rules/ and call nothing above them")
    old = {
        "amp_jax/_src/rules/higher_order.py": "from amp_jax._src import planning\nGENERIC = 1\n",
        "amp_jax/_src/elementwise.py": "class EqnRule:\n    pass\n",
        # the dot family as it was: float8 beside the planner, calling back up into it
        "amp_jax/_src/float8.py": "def applies():\n    pass\n",
        "amp_jax/_src/rules/dots/outputs.py": "from amp_jax._src.planning import Plan\n",
    }
    found = rules_layout(ROOT, old)
    assert "amp_jax/_src/rules/higher_order.py:1: imports amp_jax._src.planning" in found, found
    assert any("higher_order.py: does not define" in f for f in found), found
    assert "amp_jax/_src/elementwise.py: belongs in amp_jax/_src/rules/" in found, found
    assert "amp_jax/_src/float8.py: belongs in amp_jax/_src/rules/" in found, found
    assert "amp_jax/_src/rules/dots/outputs.py:1: imports amp_jax._src.planning" in found, found


# -- the planner: a module per stage, each importing only the stages below ----------------

#: the planner's modules (``amp_jax/_src/<name>.py``), bottom up: the plan record, the
#: context it is made under, classification, the painted draft, what decides control
#: flow, the decisions. Each imports none of those after it; ``painting`` (pure graph
#: functions) imports none of them.
PLANNER_LAYERS = ("painting", "plans", "context", "classify", "painted", "control", "planning")


def imports_of(root: pathlib.Path, source: dict[str, str] | None = None) -> dict[str, set[str]]:
    """The modules of ``amp_jax._src`` each module of ``root/amp_jax/_src`` imports
    (anywhere in it: a function-level import counts), by dotted name."""
    src = root / "amp_jax" / "_src"
    files = {str(p.relative_to(root)): p for p in src.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for rel in sorted({*files, *(source or {})}):
        text = (source or {}).get(rel, None) or files[rel].read_text()
        mod = _module_name(root / rel, root)
        found = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_jax._src"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if _is_module(root, sub) else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("amp_jax._src"))
        found.discard(mod)
    return out


def planner_layering(root: pathlib.Path, source: dict[str, str] | None = None) -> list[str]:
    """Each import of a planner module (`PLANNER_LAYERS`) that runs up the table."""
    graph = imports_of(root, source)
    found = []
    for k, name in enumerate(PLANNER_LAYERS):
        above = {f"amp_jax._src.{n}" for n in PLANNER_LAYERS[k + 1 :]}
        for m in sorted(graph.get(f"amp_jax._src.{name}", set()) & above):
            found.append(f"amp_jax/_src/{name}.py imports {m}")
    return found


def test_the_planner_is_a_module_per_stage_each_above_the_last():
    _none(planner_layering(ROOT), "a planner stage imports a stage above it (PLANNER_LAYERS)")
    old = {"amp_jax/_src/classify.py": "from amp_jax._src.control import decision_slice\n"}
    assert planner_layering(ROOT, old) == ["amp_jax/_src/classify.py imports amp_jax._src.control"]


def test_the_decision_slice_and_loop_fixed_point_live_in_control():
    """painting.py is pure painting: it takes no function to call back (the
    loop reads), and what decides control flow is control.py's, beside its loop
    fixed point."""
    src = ROOT / "amp_jax" / "_src"
    painting = ast.parse((src / "painting.py").read_text())
    control_defs = _defined(ast.parse((src / "control.py").read_text()))
    assert {"decision_seeds", "decision_slice", "_loop_reads"} <= control_defs
    assert not {"decision_seeds", "decision_slice", "_loop_reads"} & _defined(painting)
    imported = {n.module or "" for n in ast.walk(painting) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(painting) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    for stage in PLANNER_LAYERS[1:]:
        assert stage not in imported and f"amp_jax._src.{stage}" not in imported, stage
    for fn in (n for n in painting.body if isinstance(n, ast.FunctionDef)):
        for a in fn.args.args:
            assert "Callable" not in ast.unparse(a.annotation or ast.Constant("")), (fn.name, a.arg)


# -- the layers of amp_jax/_src, and the size of a module -----------------------------------

#: The layers of amp_jax/_src, bottom first, by the first part of a module's name
#: (a module, or a package with all it holds): a module imports only from its own
#: layer or the ones below. The pipeline reads bottom-up: the policy and JAX's
#: objects; the jaxpr toolkit and the backends; the records a trace is described
#: by; the rules that bind each primitive; planning and the interpreter; the
#: transformation; diagnostics beside it, reading what it did.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"compat", "mesh", "op_classes", "policy_names", "policy", "optstate"}),
    frozenset({"jaxprs", "mutation", "nnx_nodes", "backends"}),
    frozenset(
        {
            "decision",
            "calling",
            "returning",
            "plain_objects",
            "casting",
            "paths",
            "painting",
            "attention",
            "plans",
            "context",
        }
    ),
    frozenset({"rules"}),
    frozenset({"classify", "painted", "control", "planning", "interpreter"}),
    frozenset({"transform", "api"}),
    frozenset({"diagnostics", "testing"}),
)


def _src_imports(
    root: pathlib.Path, source: dict[str, str] | None = None
) -> dict[str, set[tuple[str, int]]]:
    """``{module: {(imported module, line)}}`` between the modules of
    ``amp_jax/_src`` (dotted below ``amp_jax._src``), imports inside functions too."""
    src = root / "amp_jax" / "_src"
    texts = {str(p.relative_to(root)): p.read_text() for p in src.rglob("*.py")}
    texts.update(source or {})
    out: dict[str, set[tuple[str, int]]] = {}
    for rel, text in texts.items():
        mod = _module_name(root / rel, src)
        found = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_jax._src"):
                base = node.module.removeprefix("amp_jax._src").lstrip(".")
                names = [f"{base}.{a.name}".lstrip(".") for a in node.names]
                names = [n if _is_module(src, n) else base for n in names]
            elif isinstance(node, ast.Import):
                names = [
                    a.name.removeprefix("amp_jax._src.")
                    for a in node.names
                    if a.name.startswith("amp_jax._src.")
                ]
            found.update((n, node.lineno) for n in names if n and n != mod)
    return out


def _layer(module: str) -> int | None:
    head = module.split(".")[0]
    return next((i for i, names in enumerate(LAYERS) if head in names), None)


def layer_breaks(root: pathlib.Path, source: dict[str, str] | None = None) -> list[str]:
    """Every module of ``amp_jax/_src`` in no layer of `LAYERS`, and every import
    that runs up the layers: ``module:line: imports other``."""
    found = []
    for mod, imports in sorted(_src_imports(root, source).items()):
        if not mod:
            continue
        own = _layer(mod)
        if own is None:
            found.append(f"{mod}: in no layer of LAYERS (add it where it belongs)")
            continue
        for other, line in sorted(imports):
            theirs = _layer(other)
            if theirs is not None and theirs > own:
                found.append(f"{mod}:{line}: imports {other}, a layer above it")
    return found


def import_cycles(root: pathlib.Path, source: dict[str, str] | None = None) -> list[list[str]]:
    """The import cycles between the modules of ``amp_jax/_src`` (a package's
    ``__init__`` counts as the package), each once."""
    graph = {m: {o for o, _ in imports} for m, imports in _src_imports(root, source).items()}
    cycles, done = [], set()

    def visit(mod: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(mod, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    cycles.append(cycle)
            elif nxt not in seen:
                seen.add(nxt)
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        seen = {start}
        visit(start, [start])
    return cycles


def test_no_import_runs_up_the_layers_or_in_a_circle():
    _none(layer_breaks(ROOT), "amp_jax/_src imports only downward (LAYERS)")
    assert not import_cycles(ROOT), import_cycles(ROOT)
    # the checks see what they guard against: the policy importing the planner,
    # a module nobody placed, a circle
    old = {"amp_jax/_src/policy.py": "from amp_jax._src import planning\n"}
    assert "policy:1: imports planning, a layer above it" in layer_breaks(ROOT, old)
    assert any(
        "nowhere: in no layer" in f for f in layer_breaks(ROOT, {"amp_jax/_src/nowhere.py": ""})
    )
    circle = {
        "amp_jax/_src/mesh.py": "from amp_jax._src import optstate\n",
        "amp_jax/_src/optstate.py": "from amp_jax._src.mesh import partitioned_by_mesh\n",
    }
    assert ["mesh", "optstate"] in import_cycles(ROOT, circle)


#: The most lines a module of amp_jax/_src may have: one responsibility a reader
#: takes in at one sitting (issue 59).
MAX_LINES = 500

#: Modules still longer, being split (shrink, never grow): each must still be longer.
KNOWN_LONG: frozenset[str] = frozenset()


def long_modules(root: pathlib.Path) -> dict[str, int]:
    src = root / "amp_jax" / "_src"
    lines = {str(p.relative_to(src)): len(p.read_text().splitlines()) for p in src.rglob("*.py")}
    return {rel: n for rel, n in sorted(lines.items()) if n > MAX_LINES}


def test_no_module_is_longer_than_a_sitting():
    long = long_modules(ROOT)
    assert set(long) <= KNOWN_LONG, (
        f"modules of amp_jax/_src over {MAX_LINES} lines: "
        f"{ {k: v for k, v in long.items() if k not in KNOWN_LONG} }; split them by responsibility"
    )
    assert not KNOWN_LONG - set(long), (
        f"{sorted(KNOWN_LONG - set(long))} are {MAX_LINES} lines or fewer now: remove them "
        "from KNOWN_LONG"
    )


def unmapped_modules(root: pathlib.Path, doc: str | None = None) -> list[str]:
    """The modules and packages of ``amp_jax/_src`` that the pipeline map (the
    docstring of ``amp_jax/_src/__init__.py``) does not name, and the packages
    (``name/``) it names that do not exist."""
    src = root / "amp_jax" / "_src"
    if doc is None:
        doc = ast.get_docstring(ast.parse((src / "__init__.py").read_text())) or ""
    heads = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in src.glob("*/__init__.py")}
    found = [
        f"{h}: not in the map" for h in sorted(heads | packages) if not re.search(rf"\b{h}\b", doc)
    ]
    found += [f"{p}/: no such package" for p in re.findall(r"\b(\w+)/", doc) if p not in packages]
    return found


def test_the_pipeline_map_names_every_module():
    _none(unmapped_modules(ROOT), "amp_jax/_src/__init__.py maps the pipeline: name it there")
    assert unmapped_modules(ROOT, "transform calling rules/ nowhere/") == [
        *[
            f"{h}: not in the map"
            for h in sorted(
                {p.stem for p in (ROOT / "amp_jax" / "_src").glob("*.py")}
                | {p.parent.name for p in (ROOT / "amp_jax" / "_src").glob("*/__init__.py")}
            )
            if h not in ("__init__", "transform", "calling", "rules")
        ],
        "nowhere/: no such package",
    ]
