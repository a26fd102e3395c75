"""bf.cfg for `bfb-install -c`: installer settings plus a `bfb_modify_os` hook that installs
the agent into the new root (/mnt) from an embedded payload.

The payload is a tar (base64 in a here-document, so `bash -n` and the installer's `source`
read it as text) of: the agent's wheel and its runtime dependencies (a wheelhouse built for
the DPU: aarch64, the image's Python; scripts/build-wheelhouse.sh), the agent config, the SPDK
JSON config from its [spdk] section, the firmware profiles, the systemd units and the
sysusers entry. Secrets never go in: tokens and XTS keys are generated on the DPU.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shlex
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpu_agent import __version__
from dpu_agent.provision import _units as units
from kvproto.tomlfile import TomlFileError, load_toml

__all__ = [
    "INSTALLER_KEYS",
    "MST_DEVICE",
    "PAYLOAD_BYTES_MAX",
    "SECRET_KEYS",
    "ProvisionError",
    "ProvisionInputs",
    "build_payload",
    "render_bf_cfg",
    "write_bf_cfg",
]

# bf.cfg settings the BFB installer knows (BLUEFIELD.md); others are refused as typos
INSTALLER_KEYS = frozenset({
    "UPDATE_ATF_UEFI", "UPDATE_DPU_OS", "UPGRADE_EMMC_FIRMWARE", "WITH_NIC_FW_UPDATE",
    "ERASE_PARTITIONS", "BMC_USER", "BMC_PASSWORD", "UPDATE_BMC_FW", "DUAL_BOOT",
    "ubuntu_PASSWORD",
})  # fmt: skip
# settings that are secrets: a bf.cfg holding one is written 0600
SECRET_KEYS = frozenset({"BMC_PASSWORD", "ubuntu_PASSWORD"})
SETTING_BYTES_MAX = 1024  # a password hash or a user name; bf.cfg is read into memory
# A wheelhouse of the agent's dependencies is ~50 MiB; the installer reads bf.cfg into memory
PAYLOAD_BYTES_MAX = 256 << 20
_HOOK = Path(__file__).with_name("_hook.sh")
# mst device names (BLUEFIELD.md) by the profile's device type: both physical functions, since
# per-function parameters (PF_TOTAL_SF, PF_SF_BAR_SIZE, ROCE_CONTROL) are set on each; global
# ones set through the first are already in place (a no-op) when the second is planned
MST_DEVICE = {
    "BlueField3": ("/dev/mst/mt41692_pciconf0", "/dev/mst/mt41692_pciconf0.1"),
    "BlueField2": ("/dev/mst/mt41686_pciconf0", "/dev/mst/mt41686_pciconf0.1"),
}


class ProvisionError(Exception):
    """The inputs cannot make a bf.cfg; the message says which and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvisionInputs:
    config: Path  # the agent TOML for the DPU
    wheelhouse: Path  # wheels: dpu-kvtier and its runtime dependencies
    profile: str = ""  # firmware profile name or path ("" = none at first boot)
    firmware_devices: tuple[str, ...] = ()  # default: the profile's mst devices (both PFs)
    installer: dict[str, str] | None = None  # extra bf.cfg settings (INSTALLER_KEYS)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _check_config(path: Path) -> dict[str, Any]:
    from dpu_agent.config import ConfigError, load_config

    try:
        cfg = load_config(path, environ={})
    except ConfigError as e:
        raise ProvisionError(str(e)) from None
    inline = [n for n, t in cfg.tenants.items() if t.token]
    if inline:
        raise ProvisionError(
            f"{path}: tenants {inline} have inline tokens; bf.cfg must not carry secrets: "
            "use token_file (the DPU generates the token at first start)"
        )
    try:
        return load_toml(path)
    except TomlFileError as e:  # changed since load_config read it
        raise ProvisionError(str(e)) from None


def _spdk_json(path: Path, doc: dict[str, Any]) -> bytes | None:
    if "spdk" not in doc:
        return None
    from dpu_agent.spdk_ops import run_boot_config

    return (json.dumps(run_boot_config(path), indent=2) + "\n").encode()


def _profiles(inputs: ProvisionInputs) -> tuple[dict[str, bytes], str, tuple[str, ...]]:
    """Every shipped profile plus the chosen one; its name; the devices to apply it to."""
    if not inputs.profile:
        return {}, "", ()
    from dpu_agent.firmware import PROFILE_DIRS, ProfileError, load_profile

    try:
        chosen = load_profile(inputs.profile)
    except ProfileError as e:
        raise ProvisionError(str(e)) from None
    files = {p.name: p.read_bytes() for d in PROFILE_DIRS if d.is_dir() for p in d.glob("*.toml")}
    files[f"{chosen.name}.toml"] = Path(chosen.source).read_bytes()
    bad = [d for d in inputs.firmware_devices if not units.DEVICE_RE.fullmatch(d)]
    if bad:
        raise ProvisionError(
            f"--firmware-device {bad}: an mst device (/dev/mst/NAME), a PCI address "
            "([domain:]bus:dev.fn, e.g. 0000:03:00.0) or an RDMA device (mlx5_N)"
        )
    devices = inputs.firmware_devices or next(
        (MST_DEVICE[t] for t in chosen.device_types if t in MST_DEVICE), ("03:00.0", "03:00.1")
    )
    return files, chosen.name, devices


def build_payload(inputs: ProvisionInputs) -> tuple[bytes, dict[str, Any]]:
    """The payload tar and its manifest (what is in it, for the report)."""
    doc = _check_config(inputs.config)
    wheels = sorted(inputs.wheelhouse.glob("*.whl"))
    if not any(w.name.startswith("dpu_kvtier-") for w in wheels):
        raise ProvisionError(
            f"{inputs.wheelhouse} has no dpu_kvtier wheel: run scripts/build-wheelhouse.sh"
        )
    profiles, profile, devices = _profiles(inputs)
    spdk = _spdk_json(inputs.config, doc)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for w in wheels:
            _add(tar, f"wheels/{w.name}", w.read_bytes())
        _add(tar, "etc/dpukv/agent.toml", inputs.config.read_bytes())
        if spdk is not None:
            _add(tar, "etc/dpukv/spdk.json", spdk)
        for name, data in profiles.items():
            _add(tar, f"etc/dpukv/firmware_profiles/{name}", data)
        _add(tar, f"systemd/{units.AGENT_UNIT}", units.agent_unit().encode())
        if profile or "net" in doc:
            try:
                text = units.firstboot_unit(profile, devices, with_net="net" in doc)
            except units.UnitValueError as e:
                raise ProvisionError(str(e)) from None
            _add(tar, f"systemd/{units.FIRSTBOOT_UNIT}", text.encode())
        _add(tar, f"sysusers.d/{units.SYSUSERS}", units.sysusers().encode())
    data = buf.getvalue()
    if len(data) > PAYLOAD_BYTES_MAX:
        raise ProvisionError(f"payload is {len(data) >> 20} MiB, over {PAYLOAD_BYTES_MAX >> 20}")
    manifest = {
        "wheels": [w.name for w in wheels],
        "spdk_json": spdk is not None,
        "firmware_profile": profile,
        "firmware_devices": list(devices),
        "net": "net" in doc,
        "payload_bytes": len(data),
    }
    return data, manifest


def render_bf_cfg(inputs: ProvisionInputs) -> tuple[str, dict[str, Any]]:
    payload, manifest = build_payload(inputs)
    settings = inputs.installer or {}
    unknown = set(settings) - INSTALLER_KEYS
    if unknown:
        raise ProvisionError(f"unknown bf.cfg settings {sorted(unknown)}; known: "
                             f"{', '.join(sorted(INSTALLER_KEYS))}")  # fmt: skip
    for key, value in settings.items():  # shell-quoted below; a newline is never a value
        if len(value.encode()) > SETTING_BYTES_MAX or any(
            ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value
        ):
            raise ProvisionError(
                f"bf.cfg setting {key}: at most {SETTING_BYTES_MAX} bytes, no control "
                "characters (a newline, a tab)"
            )
    manifest["holds_secrets"] = sorted(SECRET_KEYS & set(settings))
    lines = [
        f"# bf.cfg made by dpuctl provision (dpu-kvtier {__version__}).",
        "# Sourced by the BlueField BFB installer (bfb-install -c bf.cfg); check with bash -n.",
        *(f"{k}={shlex.quote(v)}" for k, v in sorted(settings.items())),
        "",
        _HOOK.read_text().rstrip(),
        "",
        "dpukv_payload() {",
        "base64 -d <<'DPUKV_PAYLOAD_END'",
        base64.encodebytes(payload).decode().rstrip(),
        "DPUKV_PAYLOAD_END",
        "}",
        "",
    ]
    return "\n".join(lines), manifest


def write_bf_cfg(path: Path, text: str, *, secret: bool) -> None:
    """Write bf.cfg: 0600 when it holds a secret (a password), else 0644; an existing file
    gets the mode before the text goes in."""
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, mode)
        f.write(text)
