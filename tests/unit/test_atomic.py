"""Reports are written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tracer.atomic import write_atomically


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "incident.md"
    write_atomically(path, b"first\n")
    assert path.read_bytes() == b"first\n"

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        write_atomically(path, b"second, half written\n")
    assert path.read_bytes() == b"first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incident.md"]


def test_a_symlink_in_place_of_the_temporary_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep\n")
    (tmp_path / f".r.md.{os.getpid()}.tmp").symlink_to(target)
    with pytest.raises(OSError):
        write_atomically(tmp_path / "r.md", b"report\n")
    assert target.read_text() == "keep\n"
