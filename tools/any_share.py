"""How many of amp_jax's function parameters are annotated ``Any`` (issue 50).

    python tools/any_share.py                  # amp_jax/_src, per file and in total
    python tools/any_share.py amp_jax/optim    # any other folders or files

Counted with ``ast`` (nothing is imported): every parameter of every ``def``
and ``async def`` (methods and nested functions included; lambdas have no
annotations), ``*args`` and ``**kwargs`` included, ``self`` and ``cls`` left
out. A parameter counts as ``Any`` when its annotation is exactly ``Any`` (or
``typing.Any``, or the string ``"Any"``); ``dict[str, Any]`` and
``Callable[..., Any]`` say something about the value and are not counted. A
parameter without an annotation is counted apart (column ``bare``); the
share is ``(Any + bare) / params``, as both are ``Any`` to a type checker.

tests/repository/test_typing.py holds the share in amp_jax/_src under a ceiling.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterable, Iterator
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: What the script counts when given no paths.
DEFAULT = ROOT / "amp_jax" / "_src"


class Count(NamedTuple):
    """The parameters of one file."""

    params: int
    any: int
    bare: int

    @property
    def share(self) -> float:
        """``(any + bare) / params``: a parameter without an annotation is
        ``Any`` to a type checker too (0 for a file without parameters)."""
        return (self.any + self.bare) / self.params if self.params else 0.0


def _is_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip() in ("Any", "typing.Any")
    return ast.unparse(annotation) in ("Any", "typing.Any")


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[ast.arg]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    decorators = {ast.unparse(d) for d in fn.decorator_list}
    if method and positional and "staticmethod" not in decorators:
        if positional[0].arg in ("self", "cls") or "classmethod" in decorators:
            positional = positional[1:]
    rest = [x for x in (a.vararg, a.kwarg) if x is not None]
    return [*positional, *a.kwonlyargs, *rest]


def _functions(tree: ast.AST) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Every function in ``tree`` and whether it is a method (defined in a class body)."""

    def walk(
        node: ast.AST, in_class: bool
    ) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child, in_class
                yield from walk(child, False)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, True)
            else:
                yield from walk(child, in_class)

    yield from walk(tree, False)


def count_source(source: str) -> Count:
    """The parameter count of one module's source."""
    params = any_ = bare = 0
    for fn, method in _functions(ast.parse(source)):
        for arg in _params(fn, method):
            params += 1
            any_ += _is_any(arg.annotation)
            bare += arg.annotation is None
    return Count(params, any_, bare)


def count_files(paths: Iterable[pathlib.Path]) -> dict[str, Count]:
    """``{path relative to the repository: Count}`` of every ``.py`` file under ``paths``."""
    files: list[pathlib.Path] = []
    for p in paths:
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    out = {}
    for f in files:
        name = (
            f.resolve().relative_to(ROOT).as_posix() if f.resolve().is_relative_to(ROOT) else str(f)
        )
        out[name] = count_source(f.read_text(encoding="utf-8"))
    return out


def total(counts: dict[str, Count]) -> Count:
    """The sum over files."""
    return Count(*(sum(c[i] for c in counts.values()) for i in range(3)))


def table(counts: dict[str, Count]) -> str:
    """The per-file rows (files with parameters), then the total."""
    width = max([len(n) for n in counts] + [5])
    lines = [f"{'file':<{width}}  {'params':>6}  {'Any':>5}  {'bare':>5}  {'share':>6}"]
    for name, c in counts.items():
        if c.params:
            lines.append(
                f"{name:<{width}}  {c.params:>6}  {c.any:>5}  {c.bare:>5}  {c.share:>6.1%}"
            )
    t = total(counts)
    lines.append(f"{'total':<{width}}  {t.params:>6}  {t.any:>5}  {t.bare:>5}  {t.share:>6.1%}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    paths = [pathlib.Path(a) for a in argv] or [DEFAULT]
    print(table(count_files(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
