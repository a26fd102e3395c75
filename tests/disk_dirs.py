"""A directory on a real disk, for tests whose subject is the page cache (major faults,
posix_fadvise DONTNEED): on tmpfs the "disk" is memory, nothing is ever dropped, and such a
test could only skip after running. It runs on a disk-backed directory instead: the first of
the repository's own `.pytest-disk/` and /var/tmp that is not tmpfs/ramfs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["MEMORY_FILESYSTEMS", "disk_backed_dir", "filesystem_of"]

REPO = Path(__file__).resolve().parent.parent
CANDIDATES = (REPO / ".pytest-disk", Path("/var/tmp"))
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` lies on, from /proc/self/mounts (longest mount-point
    prefix wins); "" when unreadable."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    path = path.resolve()
    best, kind = "", ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mnt = fields[1].replace("\\040", " ")
        inside = path == Path(mnt) or Path(mnt) in path.parents
        if inside and len(mnt) >= len(best):
            best, kind = mnt, fields[2]
    return kind


def disk_backed_dir(prefix: str) -> Path | None:
    """A fresh directory under the first disk-backed candidate (the caller removes it), or
    None when every candidate is in memory or unwritable."""
    for base in CANDIDATES:
        try:
            base.mkdir(exist_ok=True)
        except OSError:
            continue
        if filesystem_of(base) in MEMORY_FILESYSTEMS or not os.access(base, os.W_OK):
            continue
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    return None
