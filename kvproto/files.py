"""Reading small files without being stopped by what is in their place.

A FIFO where a state or configuration file should be blocks open() until something writes to
it (the agent's start hung, deaf to SIGTERM; `dpuctl config show` too); a device is read until
the caller's limit. Every small file the agent and dpuctl read that a user can name or replace
goes through `open_regular` (found by attack passes: the saved eviction order, the leader file,
the key file, tenants.json, the config file, token files).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["open_regular", "read_small_file"]


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file `path`, opened without blocking; OSError
    (FileNotFoundError where it is missing, EINVAL for anything but a regular file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: Path, max_bytes: int) -> bytes:
    """At most `max_bytes` + 1 bytes of the regular file `path` (a caller tells one too long by
    the length); OSError as `open_regular`."""
    fd = open_regular(path)
    try:
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
