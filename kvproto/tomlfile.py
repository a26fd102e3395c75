"""The one reader of the project's TOML files (agent config, its [net] and [spdk] sections,
firmware profiles): bounded in size, with one error text for a file that cannot be read, is
too big or is not TOML.

Here rather than in dpu_agent because spdk_plugins reads the agent config too and imports
only kvproto (tests/test_package_imports.py).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from kvproto.files import read_small_file

__all__ = ["CONFIG_BYTES_MAX", "TomlFileError", "load_toml"]

# The agent config (all its sections, tenants included) is a few hundred lines; a file bigger
# than this is a mistake (a log or an image given by error), refused before it is parsed.
CONFIG_BYTES_MAX = 1 << 20


class TomlFileError(ValueError):
    """A TOML file that cannot be read, is over its size bound or is not valid TOML; the
    message names the file and what was wrong with it."""


def load_toml(
    path: str | os.PathLike[str], *, max_bytes: int = CONFIG_BYTES_MAX, what: str = "config"
) -> dict[str, Any]:
    """The document in `path`. Reads at most `max_bytes` + 1 bytes, so an oversized file costs
    no more memory than a file of the bound. `what` names the file in errors ("config",
    "firmware profile")."""
    assert max_bytes > 0, max_bytes
    p = os.fspath(path)
    try:  # a FIFO in its place blocked open() for good
        raw = read_small_file(Path(p), max_bytes)
    except OSError as e:
        raise TomlFileError(f"cannot read {what} {p}: {e.strerror}") from None
    if len(raw) > max_bytes:
        raise TomlFileError(f"{what} {p} is over {max_bytes} bytes")
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TomlFileError(f"{what} {p} is not valid TOML: {e}") from None
