"""The demo's data: the Python standard library's own source, as bytes.

Byte-level vocabulary (256 symbols). Files are listed in sorted order, split
into train and validation *by file* with a seeded permutation, and each split
is the concatenation of its files' bytes. Installed third-party packages
(``site-packages``, ``dist-packages``) are excluded, so the corpus only
depends on the Python version.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig

import numpy as np

VOCAB = 256
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation byte streams and where they came from."""

    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    root: str
    n_train_files: int
    n_val_files: int


def stdlib_files(root: str | None = None) -> list[pathlib.Path]:
    """Sorted ``*.py`` files under the standard library directory."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in base.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(p.relative_to(base).parts) and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def load_corpus(seed: int, val_fraction: float = 0.1, root: str | None = None) -> Corpus:
    """Reads the corpus and splits it by file (the split depends only on ``seed``)."""
    files = stdlib_files(root)
    if len(files) < 2:
        raise RuntimeError(
            f"found {len(files)} *.py files under {root or sysconfig.get_paths()['stdlib']!r}; "
            "the demo needs the Python standard library sources."
        )
    order = np.random.default_rng(seed).permutation(len(files))
    n_val = max(1, int(round(val_fraction * len(files))))
    val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])

    def concat(idx):
        return np.frombuffer(b"\n".join(files[i].read_bytes() for i in idx), dtype=np.uint8)

    return Corpus(
        concat(train_idx),
        concat(val_idx),
        str(files[0].parent if root else sysconfig.get_paths()["stdlib"]),
        len(train_idx),
        len(val_idx),
    )


def batch_offsets(n_tokens: int, seq: int, batch: int, n_batches: int, seed: int) -> np.ndarray:
    """``(n_batches, batch)`` random window starts, the same for every mode."""
    if n_tokens <= seq + 1:
        raise ValueError(f"a split of {n_tokens} bytes is too short for --seq {seq}")
    return np.random.default_rng(seed).integers(0, n_tokens - seq - 1, size=(n_batches, batch))


def windows(data: np.ndarray, offsets: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-byte targets, both ``int32[batch, seq]``."""
    idx = offsets[:, None] + np.arange(seq + 1)[None, :]
    chunk = data[idx].astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]
