"""Reading the HLO text XLA compiled: the ops that decide precision, with their types.

`hlo_ops` parses the text of an HLO module (``jax.stages.Compiled.as_text()``)
into `HloOp` records: every matmul (``dot``, and the GEMM custom calls of
cuBLAS/cuBLASLt and oneDNN), convolution, attention (cuDNN's fused attention
custom calls) and collective, with the element types of its operands and
result, its source line and its JAX name stack (``op_name``). The operands'
types are looked up in the computation that holds the op, so a dot inside a
fusion has the types of the fusion's parameters as XLA runs them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator

#: HLO element type -> numpy name (the others keep HLO's: ``s32``, ``pred``...)
NUMPY_NAMES = {
    "f64": "float64",
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e5m2fnuz": "float8_e5m2fnuz",
    "f8e4m3": "float8_e4m3",
    "f8e3m4": "float8_e3m4",
    "f8e8m0fnu": "float8_e8m0fnu",
    "f4e2m1fn": "float4_e2m1fn",
}
#: bytes per element of HLO's element types
ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
}

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
KINDS = ("matmul", "convolution", "attention", "collective")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+[a-z\d]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\((.*)\)\s*->")
_PARAM = re.compile(r"([\w.\-]+):\s*(\(?[^,()]*(?:\([^)]*\))?)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


@dataclasses.dataclass(frozen=True)
class HloOp:
    """One op of a compiled HLO module that decides or moves precision.

    Attributes:
      kind: ``"matmul"``, ``"convolution"``, ``"attention"`` or ``"collective"``.
      opcode: the HLO opcode (``dot``, ``convolution``, ``all-gather``...) or,
        for a custom call, its target (``__cublas$lt$matmul$f8``).
      operands: the element types of its array operands (HLO names: ``bf16``).
      result: the element type of its (first) result.
      shape: its result's shape, ``f32[64,128]`` (a tuple's, comma-separated).
      where: its source line, ``file:line (function)`` (``-`` when XLA kept none).
      op_name: the JAX name stack of the op (``jit(f)/transpose(jvp())/dot_general``).
      name: its name in the module.
    """

    kind: str
    opcode: str
    operands: tuple[str, ...]
    result: str
    shape: str
    where: str
    op_name: str
    name: str

    @property
    def backward(self) -> bool:
        """Whether the op belongs to the backward pass of ``jax.grad``."""
        return "transpose(" in self.op_name

    @property
    def nbytes(self) -> int:
        """Bytes of its result (``0`` for element types of unknown size)."""
        return shape_bytes(self.shape)


def shape_bytes(shape: str) -> int:
    """Bytes of the arrays of an HLO shape (``bf16[64,128]``; a tuple's, all together)."""
    total = 0
    for dt, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        size = ITEMSIZE.get(dt, 1 if dt.startswith(("f8", "f4")) else 0)
        total += n * size
    return total


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_shape(rest: str) -> tuple[str, str]:
    """``(shape, what follows)`` of an instruction's right-hand side."""
    if rest.startswith("("):
        end = _balanced(rest, 0)
        return rest[:end], rest[end:]
    shape, _, tail = rest.partition(" ")
    return shape, " " + tail


def _element_type(shape: str) -> str:
    m = _ARRAY.search(shape)
    return m.group(1) if m else "-"


class _Frames:
    """The source locations of a module's ``StackFrames`` table (newer XLA
    writes ``stack_frame_id=N`` in the metadata instead of a file and line)."""

    def __init__(self, text: str):
        self.files = self._table(text, "FileNames", r'(\d+) "(.*)"')
        self.functions = self._table(text, "FunctionNames", r'(\d+) "(.*)"')
        self.locations = self._table(
            text, "FileLocations", r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)"
        )
        self.frames = self._table(text, "StackFrames", r"(\d+) \{file_location_id=(\d+)")

    @staticmethod
    def _table(text: str, title: str, row: str) -> dict[str, tuple[str, ...]]:
        m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
        if m is None:
            return {}
        out = {}
        for line in m.group(1).splitlines():
            r = re.match(row, line.strip())
            if r:
                out[r.group(1)] = r.groups()[1:]
        return out

    def where(self, frame: str) -> str:
        loc = self.frames.get(frame)
        row = self.locations.get(loc[0]) if loc else None
        if row is None:
            return "-"
        file_id, fn_id, line = row
        path = self.files.get(file_id, ("?",))[0]
        fn = self.functions.get(fn_id, ("",))[0]
        return _relative(path) + f":{line}" + (f" ({fn.rsplit('.', 1)[-1]})" if fn else "")


def _relative(path: str) -> str:
    """``path`` relative to the working directory when under it (as explain's rows)."""
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else path


def _where(line: str, frames: _Frames) -> str:
    m = _SOURCE.search(line)
    if m:
        return f"{_relative(m.group(1))}:{m.group(2)}"
    f = _FRAME.search(line)
    return frames.where(f.group(1)) if f else "-"


def _kind(opcode: str, target: str) -> str | None:
    if opcode == "dot":
        return "matmul"
    if opcode == "convolution":
        return "convolution"
    if opcode in COLLECTIVES:
        return "collective"
    if opcode != "custom-call":
        return None
    t = target.lower()
    if "fmha" in t or "attention" in t or "flash" in t:
        return "attention"
    if "conv" in t:
        return "convolution"
    if "matmul" in t or "gemm" in t:
        return "matmul"
    return None


def _instructions(text: str) -> Iterator[tuple[str, str, dict[str, str]]]:
    """``(name, right-hand side, the computation's types by name)`` of each instruction."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:  # a computation starts: its parameters' types
            types = {n: _element_type(s) for n, s in _PARAM.findall(head.group(2))}
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        rest = line[m.end() :]
        shape, _ = _split_shape(rest)
        types[m.group(1)] = _element_type(shape)
        yield m.group(1), rest, types


def hlo_ops(text: str) -> list[HloOp]:
    """The matmuls, convolutions, attention calls and collectives of an HLO module's text.

    Args:
      text: the module's text, as ``jax.stages.Compiled.as_text()`` returns it.

    Returns:
      One `HloOp` per op, in the order of the text (an async collective's
      ``-start`` counts, its ``-done`` does not).
    """
    frames = _Frames(text)
    ops = []
    for name, rest, types in _instructions(text):
        shape, tail = _split_shape(rest)
        m = _OPCODE.match(tail)
        if m is None:
            continue
        opcode = m.group(1).removesuffix("-start")
        target = _TARGET.search(tail)
        kind = _kind(opcode, target.group(1) if target else "")
        if kind is None:
            continue
        args = tail[m.end() - 1 : _balanced(tail, m.end() - 1)]
        operands = []
        for a in args[1:-1].split(","):
            typed = _ARRAY.search(a)  # (older text writes each operand's type)
            ref = re.search(r"%([\w.\-]+)", a)
            dt = typed.group(1) if typed else types.get(ref.group(1), "-") if ref else "-"
            if dt not in ("-", "token"):
                operands.append(dt)
        op_name = _OP_NAME.search(tail)
        arrays = [f"{t}[{d}]" for t, d in _ARRAY.findall(shape)]
        if m.group(1).endswith("-start") and opcode != "all-reduce" and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]  # (operands, results): the results
        ops.append(
            HloOp(
                kind=kind,
                opcode=target.group(1) if target and opcode == "custom-call" else opcode,
                operands=tuple(operands),
                result=_element_type(arrays[0]) if arrays else "-",
                shape=", ".join(arrays) or shape,
                where=_where(tail, frames),
                op_name=op_name.group(1) if op_name else "",
                name=name,
            )
        )
    return ops
