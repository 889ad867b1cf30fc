"""mkdocs hook: pages generated from the library's own data.

* ``<!-- amp:op-table -->`` ... ``<!-- /amp:op-table -->``: the op
  classification of ``amp_jax.get_policy("bfloat16")`` (``Policy.table()``),
  so the table in the docs is the table the code uses. The generated table is
  also committed between the two markers, so the page reads the same in the
  repository view; ``tests/repository/test_docs.py`` checks that it is current
  (``python docs/hooks/amp_docs.py`` rewrites it).
* ``<!-- amp:backend-table -->`` ... ``<!-- /amp:backend-table -->``:
  ``amp_jax.BACKEND_SLOW_IN_LOW_PRECISION``, the same way.
* ``<!-- amp:benchmark-results -->`` by ``benchmarks/results/RESULTS.md`` when it
  exists (relative links in it are turned into plain text, as they point
  outside the docs), or by a note on how to produce it.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_CLASS_DOC = {
    "allow": "compute dtype operands, float32 accumulation (matmuls, convolutions)",
    "deny": "always float32 (exp/log/pow, accumulating reductions, linear algebra)",
    "follow": "elementwise arithmetic: follows its inputs; low between two allow ops",
    "clear": "data movement, comparisons, max/min: numerically neutral",
    "never": "operand dtypes are part of the meaning: never cast",
}


def op_table() -> str:
    from amp_jax import get_policy
    from amp_jax._src.op_classes import OP_CLASSES

    policy = get_policy("bfloat16")
    by_class: dict[str, list[str]] = {c: [] for c in OP_CLASSES}
    for name, cls in policy.table():
        by_class[cls].append(name)
    missing = set(OP_CLASSES) - set(_CLASS_DOC)
    if missing:
        raise RuntimeError(
            f"docs/hooks/amp_docs.py: describe the new op class(es) {sorted(missing)}"
        )
    lines = ["| class | what amp does | primitives |", "|---|---|---|"]
    for cls in OP_CLASSES:
        names = ", ".join(f"`{n}`" for n in by_class[cls])
        lines.append(f"| `{cls}` ({len(by_class[cls])}) | {_CLASS_DOC[cls]} | {names} |")
    return "\n".join(lines)


def backend_table() -> str:
    from amp_jax import BACKEND_SLOW_IN_LOW_PRECISION

    lines = ["| primitive | backend |", "|---|---|"]
    lines += [f"| `{p}` | {b} |" for p, b in sorted(BACKEND_SLOW_IN_LOW_PRECISION)]
    return "\n".join(lines)


_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _unlink_relative(text: str) -> str:
    def repl(m):
        bang, label, target = m.groups()
        if re.match(r"^[a-z]+://|^#|^mailto:", target):
            return m.group(0)
        shown = f"benchmarks/results/{target}" if not target.startswith("/") else target
        return f"{label} (`{shown}`)" if label else f"`{shown}`"

    return _LINK.sub(repl, text)


def benchmark_results() -> str:
    """benchmarks/results/RESULTS.md (CPU) and, when present, RESULTS_GPU.md."""
    parts = []
    titles = {"RESULTS.md": "CPU", "RESULTS_GPU.md": "GPU"}
    for name in ("RESULTS.md", "RESULTS_GPU.md"):
        path = ROOT / "benchmarks" / "results" / name
        if path.exists():
            # each file's own title names the machine here (both are "amp_jax speed benchmark")
            text = re.sub(
                r"\A# .*", f"# {titles[name]} (`benchmarks/results/{name}`)", path.read_text()
            )
            text = re.sub(
                r"^(#+)", r"#\1", text, flags=re.M
            )  # nest its headings under this page's title
            parts.append(_unlink_relative(text))
    if not parts:
        return (
            '!!! note "No results yet"\n    `benchmarks/results/RESULTS.md` has not been generated in this checkout. '
            "Run `python -m benchmarks.run` to produce it."
        )
    return "\n\n".join(parts)


_MARKERS = {"<!-- amp:benchmark-results -->": benchmark_results}
# generated text committed between <!-- amp:NAME --> and <!-- /amp:NAME -->
_BLOCKS = {"op-table": op_table, "backend-table": backend_table}


def fill_blocks(markdown: str) -> str:
    """``markdown`` with every committed generated block regenerated."""
    for name, make in _BLOCKS.items():
        markdown = re.sub(
            rf"(<!-- amp:{name} -->\n).*?(<!-- /amp:{name} -->)",
            lambda m, make=make: m.group(1) + "\n" + make() + "\n\n" + m.group(2),
            markdown,
            flags=re.S,
        )
    return markdown


def on_page_markdown(markdown, page, config, files, **kwargs):
    markdown = fill_blocks(markdown)
    for marker, make in _MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


if __name__ == "__main__":  # rewrite the committed generated tables
    page = ROOT / "docs" / "how-amp-works.md"
    page.write_text(fill_blocks(page.read_text()))
