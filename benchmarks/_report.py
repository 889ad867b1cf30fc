"""What every benchmark script does with its report."""

from __future__ import annotations

import os

#: where the benchmarks write their result pages (benchmarks/results/, indexed by
#: benchmarks/README.md)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def emit(text: str, out: str | None) -> str:
    """Prints the report ``text`` and writes it to the file ``out`` (``None``: print only)."""
    print(text)
    if out is not None:
        with open(out, "w") as fh:
            fh.write(text)
    return text
