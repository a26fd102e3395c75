"""Firmware profiles: TOML files of mlxconfig parameters, checked against the parameter schema.

The schema (`schema.toml`, generated from mstflint's parameter database by
scripts/firmware-schema-from-mstflint.py) gives each parameter's type (bool, unsigned with its
bit-width maximum, enum with its names and numbers), whether it is per port (then a profile
must name NAME_P1 / NAME_P2, as mlxconfig does) and what activates a new value (`reboot`: a
firmware reset or Arm reboot; `host_power_cycle`: PCI topology the host enumerates at power-on).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproto.tomlfile import TomlFileError, load_toml

__all__ = [
    "ACTIVATIONS",
    "PROFILE_DIRS",
    "PROFILE_NAME_RE",
    "Param",
    "Profile",
    "ProfileError",
    "load_profile",
    "load_schema",
    "profile_names",
    "schema_param",
]

ACTIVATIONS = ("reboot", "host_power_cycle")  # in order of disruption
PROFILE_BYTES_MAX = 1 << 16  # a profile is a few dozen lines
PROFILE_PARAMS_MAX = 128  # DPF's DPUFlavor allows 32 per device; both ports doubled, and room
EXTENDS_DEPTH_MAX = 4  # profile -> base -> ...; deeper is a mistake (or a cycle)
_PORT_RE = re.compile(r"^(?P<base>.+)_P(?P<port>[12])$")
# A profile's name becomes a file name (firmware_profiles/NAME.toml) and a word of the root-run
# first-boot unit: letters, digits, '_', '.', '-', starting with a letter or digit.
PROFILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SCHEMA_PATH = Path(__file__).with_name("schema.toml")
# Where `--profile NAME` is looked up: $DPUKV_FIRMWARE_PROFILES, the source tree, the installed
# copy (provisioning puts the profiles there).
PROFILE_DIRS = (
    Path(__file__).resolve().parents[2] / "firmware_profiles",
    Path("/etc/dpukv/firmware_profiles"),
)


class ProfileError(ValueError):
    """The profile is invalid; the message names the file, the parameter and what is allowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    name: str  # mlxconfig's base name (no _P1/_P2)
    type: str  # bool | unsigned | enum
    per_port: bool
    activation: str
    values: tuple[tuple[str, int], ...] = ()  # enum names and numbers
    max: int = 1

    def code(self, value: Any, where: str) -> int:
        """A profile value as the number mlxconfig stores; ProfileError when not allowed."""
        if self.type == "bool":
            if isinstance(value, bool):
                return int(value)
            raise ProfileError(f"{where} = {value!r}: {self.name} is a boolean (true/false)")
        if self.type == "enum":
            names = dict(self.values)
            if isinstance(value, str) and value in names:
                return names[value]
            if type(value) is int and value in names.values():
                return value
            allowed = ", ".join(n for n, _ in self.values)
            raise ProfileError(f"{where} = {value!r}: {self.name} is one of {allowed}")
        if type(value) is int and 0 <= value <= self.max:
            return value
        raise ProfileError(f"{where} = {value!r}: {self.name} is an integer 0..{self.max}")

    def label(self, code: int) -> str:
        """How mlxconfig prints a value: NAME(n) for enums and booleans, else the number."""
        if self.type == "bool":
            return f"{'True' if code else 'False'}({code})"
        for name, n in self.values:
            if n == code:
                return f"{name}({code})"
        return str(code)


def load_schema(path: Path = _SCHEMA_PATH) -> dict[str, Param]:
    doc = load_toml(path, max_bytes=PROFILE_BYTES_MAX, what="firmware schema")
    out: dict[str, Param] = {}
    for name, spec in doc.items():
        assert spec["type"] in ("bool", "unsigned", "enum"), (name, spec)
        assert spec["activation"] in ACTIVATIONS, (name, spec)
        out[name] = Param(
            name=name,
            type=spec["type"],
            per_port=spec["per_port"],
            activation=spec["activation"],
            values=tuple(spec.get("values", {}).items()),
            max=spec.get("max", 1),
        )
    return out


def schema_param(schema: dict[str, Param], name: str) -> Param | None:
    """The schema entry for a profile or query name (NAME or NAME_Pn)."""
    m = _PORT_RE.match(name)
    if m and m["base"] in schema and schema[m["base"]].per_port:
        return schema[m["base"]]
    p = schema.get(name)
    return p if p is not None and not p.per_port else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    name: str
    description: str
    device_types: tuple[str, ...]
    source: str
    parameters: dict[str, int]  # mlxconfig name (with _Pn) -> number

    def to_json(self, schema: dict[str, Param]) -> dict[str, Any]:
        labels = {k: _param(schema, k).label(v) for k, v in self.parameters.items()}
        return {
            "name": self.name,
            "description": self.description,
            "device_types": list(self.device_types),
            "source": self.source,
            "parameters": labels,
        }


def _param(schema: dict[str, Param], name: str) -> Param:
    p = schema_param(schema, name)
    assert p is not None, name
    return p


def profile_names(dirs: tuple[Path, ...] | None = None) -> list[str]:
    return sorted({p.stem for d in _dirs(dirs) if d.is_dir() for p in d.glob("*.toml")})


def _dirs(dirs: tuple[Path, ...] | None) -> tuple[Path, ...]:
    if dirs is not None:
        return dirs
    env = os.environ.get("DPUKV_FIRMWARE_PROFILES")
    return ((Path(env),) if env else ()) + PROFILE_DIRS


def _find(ref: str, dirs: tuple[Path, ...] | None, near: Path | None) -> Path:
    if ref.endswith(".toml") or "/" in ref:
        return Path(ref)
    search = ((near,) if near is not None else ()) + _dirs(dirs)
    for d in search:
        if (d / f"{ref}.toml").is_file():
            return d / f"{ref}.toml"
    known = ", ".join(profile_names(dirs)) or "none found"
    raise ProfileError(f"no firmware profile {ref!r} (known: {known}); or give a .toml path")


def load_profile(
    ref: str, *, schema: dict[str, Param] | None = None, dirs: tuple[Path, ...] | None = None
) -> Profile:
    """A profile by name (looked up in PROFILE_DIRS) or by path, validated against the schema."""
    schema = schema if schema is not None else load_schema()
    return _load(ref, schema, dirs, None, 0)


def _read(path: Path) -> dict[str, Any]:
    try:
        return load_toml(path, max_bytes=PROFILE_BYTES_MAX, what="firmware profile")
    except TomlFileError as e:
        raise ProfileError(str(e)) from None


def _load(
    ref: str, schema: dict[str, Param], dirs: tuple[Path, ...] | None, near: Path | None, depth: int
) -> Profile:
    if depth > EXTENDS_DEPTH_MAX:
        raise ProfileError(f"firmware profile {ref}: 'extends' deeper than {EXTENDS_DEPTH_MAX}")
    path = _find(ref, dirs, near)
    doc = _read(path)
    unknown = set(doc) - {"profile", "parameters"}
    head = doc.get("profile")
    if unknown or not isinstance(head, dict):
        raise ProfileError(f"{path}: needs a [profile] table and [parameters]; unknown {unknown}")
    extra = set(head) - {"name", "description", "device_types", "extends", "remove"}
    if extra:
        raise ProfileError(f"{path}: unknown [profile] keys {sorted(extra)}")
    params: dict[str, int] = {}
    device_types = head.get("device_types")
    if "extends" in head:
        base = _load(str(head["extends"]), schema, dirs, path.parent, depth + 1)
        params.update(base.parameters)
        device_types = device_types or list(base.device_types)
    for name in head.get("remove", []):
        if name not in params:
            raise ProfileError(f"{path}: remove {name!r}: not in the base profile")
        del params[name]
    raw = doc.get("parameters", {})
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: [parameters] must be a table")
    for name, value in raw.items():
        params[name] = _check(schema, name, value, f"{path}: {name}")
    if not params or len(params) > PROFILE_PARAMS_MAX:
        raise ProfileError(f"{path}: 1 to {PROFILE_PARAMS_MAX} parameters, not {len(params)}")
    if not isinstance(device_types, list) or not all(isinstance(t, str) for t in device_types):
        raise ProfileError(f"{path}: [profile] device_types must be a list like ['BlueField3']")
    name = head.get("name", path.stem)
    if not isinstance(name, str) or not PROFILE_NAME_RE.fullmatch(name):
        raise ProfileError(
            f"{path}: [profile] name = {name!r}: 1 to 64 letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    return Profile(
        name=name,
        description=str(head.get("description", "")),
        device_types=tuple(device_types),
        source=str(path),
        parameters=params,
    )


def _check(schema: dict[str, Param], name: str, value: Any, where: str) -> int:
    p = schema_param(schema, name)
    if p is None:
        if name in schema and schema[name].per_port:
            raise ProfileError(f"{where}: {name} is per port; give {name}_P1 and/or {name}_P2")
        m = _PORT_RE.match(name)
        if m and m["base"] in schema:
            raise ProfileError(f"{where}: {m['base']} is not per port; give it without _P{m[2]}")
        raise ProfileError(f"{where}: unknown mlxconfig parameter (schema: {_SCHEMA_PATH.name})")
    return p.code(value, where)
