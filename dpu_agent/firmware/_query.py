"""Read a device's firmware configuration through mlxconfig (or mstflint's mstconfig).

`mlxconfig -d DEV -e -j FILE query` writes JSON: ``{"Device #1": {device_type, name,
description, device, tlv_configuration: {PARAM: {read_only, modified, next_value,
default_value, current_value}}}}`` with values as a number, ``NAME(n)`` or ``N/A``. mstflint's
mstconfig up to 4.21 (Debian 12) has no ``-j``: its ``-e query`` table is parsed instead
(``*RO     NAME   default current next``). Both parse into the same `DeviceConfig`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "QUERY_TIMEOUT_S",
    "DeviceConfig",
    "FirmwareToolError",
    "FirmwareUnavailable",
    "LiveParam",
    "Tool",
    "find_tool",
    "parse_json_query",
    "parse_text_query",
    "parse_value",
    "query_device",
    "run_set",
    "set_argv",
]

# mlxconfig reads every TLV through the PCI config space or the mst driver: seconds, tens of
# seconds on a busy BlueField; a set also writes NVRAM. Bounded, never forever.
QUERY_TIMEOUT_S = 180.0
OUTPUT_BYTES_MAX = 4 << 20  # a full query of a BF3 is ~100 KiB of JSON
_VALUE_RE = re.compile(r"^(?P<label>[^()]*)\((?P<code>-?\d+)\)$")
_UNAVAILABLE = ("Failed to open the device", "No such file", "No devices found", "Device not")


class FirmwareToolError(Exception):
    """mlxconfig/mstconfig ran and refused (exit code and its message kept)."""

    def __init__(self, argv: list[str], returncode: int, message: str) -> None:
        self.argv, self.returncode, self.message = argv, returncode, message
        super().__init__(f"{' '.join(argv)} exited {returncode}: {message}")


class FirmwareUnavailable(Exception):
    """No tool installed, or the device cannot be opened (absent, no permission, no driver)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveParam:
    read_only: bool
    next_boot: int | None  # None: N/A or an array
    current: int | None = None
    default: int | None = None
    shown: dict[str, Any] = field(default_factory=dict)  # as the tool printed them


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceConfig:
    device: str
    device_type: str
    name: str
    description: str
    params: dict[str, LiveParam]


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    path: str
    json: bool  # mlxconfig (MFT) writes -j JSON; mstflint's mstconfig 4.21 does not


def find_tool(tool: str | None = None) -> Tool:
    """`tool` (a name or path), else mlxconfig, else mstconfig on PATH."""
    for name in [tool] if tool else ["mlxconfig", "mstconfig"]:
        path = shutil.which(name)
        if path:
            return Tool(path=path, json=_supports_json(path))
    raise FirmwareUnavailable(
        f"{tool or 'mlxconfig or mstconfig'} not found; install NVIDIA MFT (mlxconfig) or "
        "mstflint (apt-get install mstflint: mstconfig)"
    )


def _supports_json(path: str) -> bool:
    try:
        out = subprocess.run([path, "-h"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--json_format" in out.stdout + out.stderr  # MFT's mlxconfig, mstflint >= 4.2x


def parse_value(value: Any) -> int | None:
    """A printed value as its number: 3, "3", "ETH(2)", "True(1)"; None for N/A and arrays."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.isdigit():
        return int(text)
    m = _VALUE_RE.match(text)
    return int(m["code"]) if m else None


def parse_json_query(doc: Any) -> DeviceConfig:
    """The first device of a `mlxconfig -j` query document; ValueError when malformed."""
    if not isinstance(doc, dict) or not doc:
        raise ValueError("mlxconfig JSON: expected an object keyed by 'Device #1'")
    dev = next(iter(doc.values()))
    if not isinstance(dev, dict) or not isinstance(dev.get("tlv_configuration"), dict):
        raise ValueError("mlxconfig JSON: the device has no tlv_configuration object")
    params: dict[str, LiveParam] = {}
    for name, p in dev["tlv_configuration"].items():
        if not isinstance(p, dict):
            raise ValueError(f"mlxconfig JSON: {name} is not an object")
        params[name] = LiveParam(
            read_only=bool(p.get("read_only", False)),
            next_boot=parse_value(p.get("next_value")),
            current=parse_value(p.get("current_value")),
            default=parse_value(p.get("default_value")),
            shown={k: p[k] for k in ("default_value", "current_value", "next_value") if k in p},
        )
    return DeviceConfig(
        device=str(dev.get("device", "")),
        device_type=str(dev.get("device_type", "")),
        name=str(dev.get("name", "")),
        description=str(dev.get("description", "")),
        params=params,
    )


_COLUMNS = {"Default": "default_value", "Current": "current_value", "Next Boot": "next_value"}


def parse_text_query(text: str) -> DeviceConfig:
    """The table of `mlxconfig/mstconfig -d DEV -e query` (columns as its header says)."""
    info: dict[str, str] = {}
    columns: list[str] = []
    params: dict[str, LiveParam] = {}
    for line in text.splitlines():
        if line.startswith("Configurations:"):
            columns = [_COLUMNS[c] for c in _COLUMNS if c in line]
            continue
        if not columns:
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("Device type", "Name", "Description", "Device"):
                info[key.strip()] = value.strip()
            continue
        flags, fields = line[:3], line[3:].split()
        if len(fields) != len(columns) + 1 or not re.fullmatch(r"[A-Z0-9_\[\]]+", fields[0]):
            continue  # notes after the table ("The '*' shows parameters ...")
        shown = dict(zip(columns, fields[1:], strict=True))
        params[fields[0]] = LiveParam(
            read_only=flags[1:3] == "RO",
            next_boot=parse_value(shown["next_value"]),
            current=parse_value(shown.get("current_value")),
            default=parse_value(shown.get("default_value")),
            shown=shown,
        )
    if not columns:
        raise ValueError("mlxconfig query output has no 'Configurations:' table")
    return DeviceConfig(
        device=info.get("Device", ""),
        device_type=info.get("Device type", ""),
        name=info.get("Name", ""),
        description=info.get("Description", ""),
        params=params,
    )


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except OSError as e:
        raise FirmwareUnavailable(f"cannot run {argv[0]}: {e.strerror}") from None
    except subprocess.TimeoutExpired:
        raise FirmwareToolError(argv, -1, f"no answer within {QUERY_TIMEOUT_S:.0f} s") from None
    if out.returncode != 0:
        message = _message(out.stdout + out.stderr)
        if any(s in message for s in _UNAVAILABLE):
            raise FirmwareUnavailable(f"{argv[0]} -d {argv[2]}: {message}")
        raise FirmwareToolError(argv, out.returncode, message)
    return out


def _message(output: str) -> str:
    """The tool's -E- lines (its usage text after them is noise)."""
    errors = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("-E-")]
    return "; ".join(errors) or output.strip()[-500:]


def query_device(device: str, tool: Tool) -> DeviceConfig:
    """Query every parameter with default, current and next-boot values."""
    if not tool.json:
        return parse_text_query(_run([tool.path, "-d", device, "-e", "query"]).stdout)
    fd, path = tempfile.mkstemp(prefix="mlxconfig-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("{}")  # mlxconfig parses the file before adding its device: start valid
        _run([tool.path, "-d", device, "-e", "-j", path, "query"])
        raw = Path(path).read_bytes()[:OUTPUT_BYTES_MAX]
        return parse_json_query(json.loads(raw))
    finally:
        os.unlink(path)


def set_argv(tool_path: str, device: str, values: dict[str, int]) -> list[str]:
    """One `-y set` call for every change (numbers: unambiguous across tool versions)."""
    assert values, "nothing to set"
    return [tool_path, "-d", device, "-y", "set", *(f"{k}={v}" for k, v in values.items())]


def run_set(device: str, tool: Tool, values: dict[str, int]) -> str:
    return _run(set_argv(tool.path, device, values)).stdout
