"""Byte corpora for ``gaengine train``: files -> one uint8 tensor per split -> random windows.

The default corpus is the ``.py`` files of the Python standard library on this machine (no download, the
same bytes on every run of one interpreter). Files are read in sorted order up to a byte cap and split by
file: every ``val_every``-th file goes to validation, the rest to training. Windows are sampled with a
seeded ``torch.Generator``, so a run is reproducible from its seed.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

__all__ = ["TEXT_SUFFIXES", "ByteCorpus", "corpus_files", "load_corpus", "sample_batch", "eval_batches"]

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".c", ".h", ".cpp", ".cu", ".json", ".toml", ".yaml", ".yml")
"""File suffixes read when ``--data`` is a folder."""

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


@dataclass(frozen=True)
class ByteCorpus:
    """Training and validation bytes, each a ``(n_bytes,)`` uint8 CPU tensor."""

    train: torch.Tensor
    """Training bytes, files concatenated in sorted order."""
    val: torch.Tensor
    """Validation bytes, files concatenated in sorted order."""
    source: str
    """Where the bytes came from, for the summary."""
    num_files: int
    """Number of files read (both splits)."""


def corpus_files(path: Optional[Path] = None) -> list[Path]:
    """Files of a corpus in a deterministic (sorted) order.

    ``path=None``: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``, third-party packages
    excluded. A file: just that file. A folder: every file below it with a suffix in ``TEXT_SUFFIXES``.
    Raises ``FileNotFoundError`` when the path does not exist or holds no such file.
    """
    if path is None:
        root, suffixes = Path(sysconfig.get_paths()["stdlib"]), (".py",)
    else:
        root, suffixes = Path(path), TEXT_SUFFIXES
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise FileNotFoundError(f"--data {path}: no such file or folder")
    files = sorted(
        f
        for f in root.rglob("*")
        if f.suffix in suffixes and f.is_file() and not _SKIP_DIRS.intersection(f.relative_to(root).parts)
    )
    if not files:
        raise FileNotFoundError(f"no {'/'.join(suffixes)} files found under {root}")
    return files


def _split_single(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    n_val = int(len(data) * val_fraction)
    return data[: len(data) - n_val], data[len(data) - n_val :]


def load_corpus(
    path: Optional[Path] = None, *, max_bytes: int = 4 << 20, val_every: int = 10, min_split_bytes: int = 0
) -> ByteCorpus:
    """Read a corpus (see :func:`corpus_files`) into train/validation byte tensors.

    Files are read in order until ``max_bytes`` (bytes) have been read; the last file is truncated to fit.
    Every ``val_every``-th file (index 9, 19, ... for 10) goes to validation. When that leaves either split
    shorter than ``min_split_bytes`` (a single file, or a few small ones), the concatenated bytes are split
    instead: the last ``1/val_every`` of them go to validation.
    Raises ``ValueError`` when the corpus is too small for both splits.
    """
    if max_bytes < 1 or val_every < 2:
        raise ValueError(f"max_bytes must be >= 1 and val_every >= 2, got {max_bytes} and {val_every}")
    files = corpus_files(path)
    train, val, total, read = bytearray(), bytearray(), 0, 0
    for i, f in enumerate(files):
        if total >= max_bytes:
            break
        data = f.read_bytes()[: max_bytes - total]
        total += len(data)
        read += 1
        (val if i % val_every == val_every - 1 else train).extend(data)
    if min(len(train), len(val)) < max(min_split_bytes, 1):
        train, val = _split_single(bytes(train + val), 1.0 / val_every)
    if min(len(train), len(val)) < max(min_split_bytes, 1):
        raise ValueError(
            f"corpus too small: {len(train)} training and {len(val)} validation bytes, "
            f"need at least {min_split_bytes} each"
        )
    source = str(path) if path is not None else f"Python stdlib *.py ({files[0].parent})"
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return ByteCorpus(train=as_tensor(train), val=as_tensor(val), source=source, num_files=read)


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random contiguous windows of ``data``: inputs and next-byte targets.

    ``data``: ``(n_bytes,)`` uint8, ``n_bytes > seq_len``. Returns ``x, y``: ``(batch_size, seq_len)`` int64
    on ``device``, ``y[:, t] = x[:, t + 1]`` shifted by one byte. Offsets come from ``generator`` (CPU).
    """
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def eval_batches(
    data: torch.Tensor, num_batches: int, batch_size: int, seq_len: int, seed: int, device: torch.device | str = "cpu"
) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches (the same for every evaluation and every run with ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    return [sample_batch(data, batch_size, seq_len, generator, device) for _ in range(num_batches)]
