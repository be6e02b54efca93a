"""The one atomic writer (model_zoo.files): a reader sees the old file or the new one, never part.

Every package writes through it: state files and checkpoints, ONNX exports, results.json, the
report, split.txt, the daemon's rounds.jsonl and run.json, the broker ACL files, the plots.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from model_zoo.files import atomic_open, atomic_path, write_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary_file(tmp_path):
    # Prepare: a file a reader relies on.
    target = tmp_path / "results.json"
    target.write_text("old\n")

    # Execute: the writer dies after writing part of the new content.
    with pytest.raises(RuntimeError, match="disk on fire"), atomic_open(target, text=True) as f:
        f.write("new, half of it")
        raise RuntimeError("disk on fire")

    # Assert: the old content, whole, and nothing else in the folder.
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_failing_path_writer_leaves_nothing_behind_either(tmp_path):
    target = tmp_path / "model.onnx"
    with pytest.raises(ValueError, match="verification failed"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half a graph")
        raise ValueError("verification failed")
    assert list(tmp_path.iterdir()) == []


def test_a_reader_never_sees_a_half_written_file(tmp_path):
    # Prepare: two whole versions of a 2 MB file, written in small pieces, again and again.
    target = tmp_path / "state"
    versions = [b"a" * 2**21, b"b" * 2**21]
    write_atomic(target, versions[0])
    done = threading.Event()

    def writer() -> None:
        for i in range(40):
            with atomic_open(target) as f:
                for k in range(0, 2**21, 2**16):
                    f.write(versions[i % 2][k : k + 2**16])
        done.set()

    # Execute: read while it writes.
    thread = threading.Thread(target=writer)
    thread.start()
    reads = 0
    while not done.is_set():
        data = target.read_bytes()
        reads += 1
        assert data in versions, f"a reader saw {len(data)} bytes of a version in progress"
    thread.join(60)
    assert reads > 0

    # Assert: only whole versions were ever seen, and no temporary file is left.
    assert target.read_bytes() in versions
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


def test_the_content_is_fsynced_and_so_is_the_folder_before_returning(tmp_path, monkeypatch):
    # Prepare: note what each fsync is called on.
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    # Execute
    write_atomic(tmp_path / "split.txt", "c0 10\n")

    # Assert: the bytes, then the rename (the folder), each made durable.
    assert synced == ["file", "dir"]


def test_permissions_new_files_are_0644_replaced_files_keep_theirs_and_mode_wins(tmp_path):
    new = write_atomic(tmp_path / "report.md", "# report\n")
    assert _mode(new) == 0o644  # not mkstemp's 0o600: a report is meant to be shared

    kept = tmp_path / "acl"
    kept.write_text("x")
    kept.chmod(0o640)
    write_atomic(kept, "y")
    assert (_mode(kept), kept.read_text()) == (0o640, "y")

    secret = write_atomic(tmp_path / "passwd", "c0:hash\n", mode=0o600)
    assert _mode(secret) == 0o600


def test_text_is_written_as_utf8_and_missing_folders_are_created(tmp_path):
    target = tmp_path / "new" / "dir" / "report.md"
    write_atomic(target, "λ = 0.5, 2 pp²\n")
    assert target.read_bytes() == "λ = 0.5, 2 pp²\n".encode()
