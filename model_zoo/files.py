"""Crash-safe file writes: the one atomic writer every package uses.

A file is written to a temporary sibling (same folder, so the rename cannot cross file
systems), flushed and fsynced, given its final permissions, renamed over the target, and then
the folder is fsynced so that the rename itself survives a crash. A reader sees the old file or
the new one, never part of one; a write that fails midway leaves the old file as it was and no
temporary file behind.

It lives in `model_zoo`, the package the others depend on, so that `model_zoo`, `edge_sdk` and
`coordinator` all write through it without importing upwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Final, Literal, overload

__all__ = ["DEFAULT_MODE", "atomic_open", "atomic_path", "write_atomic"]

DEFAULT_MODE: Final[int] = 0o644  # a new file: readable by all, as `open(..., "w")` makes it


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, mode: int | None = None) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a file name (onnx.save, a torch
    exporter); on success it is fsynced and renamed to `path`, on failure removed.

    `mode`: the permissions of the result; default: those of the file it replaces, else 0o644.
    The folder is created when missing.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        mode = target.stat().st_mode & 0o777 if target.exists() else DEFAULT_MODE
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDWR)  # the writer has closed it: make its bytes durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


@overload
@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], *, text: Literal[True], mode: int | None = None
) -> Iterator[IO[str]]: ...


@overload
@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], *, text: Literal[False] = False, mode: int | None = None
) -> Iterator[IO[bytes]]: ...


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike[str], *, text: bool = False, mode: int | None = None
) -> Iterator[IO[Any]]:
    """An open handle (UTF-8 text with `text`, else binary) whose content replaces `path`
    when the block ends without an exception; see `atomic_path` for `mode`."""
    with (
        atomic_path(path, mode=mode) as tmp,
        open(tmp, "w" if text else "wb", encoding="utf-8" if text else None) as handle,
    ):
        yield handle
        handle.flush()


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None
) -> Path:
    """Replace `path` with `data` (str as UTF-8) atomically; returns the path."""
    if isinstance(data, str):
        with atomic_open(path, text=True, mode=mode) as text_handle:
            text_handle.write(data)
    else:
        with atomic_open(path, mode=mode) as binary_handle:
            binary_handle.write(data)
    return Path(path)
