"""Counters over compiled HLO text, shared by the benchmarks and the tests."""

from __future__ import annotations

import re


def loop_scalar_all_reduces(hlo_text: str) -> int:
    """Number of one-element all-reduces inside while bodies of compiled HLO
    text: collectives paid on every loop iteration."""
    n = 0
    for body in re.findall(r"body=%([\w.\-]+)", hlo_text):
        text = re.search(r"^%" + re.escape(body) + r" .*?^}", hlo_text, re.S | re.M).group(0)
        for m in re.finditer(r"= \(?\w+\[([\d,]*)\]\S* all-reduce(?:-start)?\(", text):
            n += all(d == "1" for d in m.group(1).split(",") if d)
    return n
