"""`dpuctl provision`: bf.cfg for a BlueField (agent, config, SPDK JSON, firmware profile,
systemd units) and `bfb-install` with a progress bar.

Exit codes: 0 done; 1 bfb-install failed (the JSON has its last lines); 2 usage; 3 bfb-install
is not installed; 4 the config, profile or wheelhouse is invalid.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dpu_agent import provision as pv
from dpu_agent.cli._common import fail as _fail

__all__ = ["provision_cmd"]

EXIT_OK, EXIT_FAILED, EXIT_MISSING, EXIT_CONFIG = 0, 1, 3, 4
_err = Console(stderr=True)


def _settings(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for kv in values:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{kv!r}: expected KEY=VALUE", param_hint="--set")
        out[key] = value
    return out


def _install(argv: list[str], as_json: bool) -> list[str]:
    if as_json:
        return pv.run_bfb_install(argv, lambda _: None)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=_err,
    ) as bar:
        task = bar.add_task("bfb-install", total=100)

        def show(p: pv.BfbProgress) -> None:
            bar.update(task, description=p.step[:40], completed=p.percent)

        return pv.run_bfb_install(argv, show)


@click.command(
    "provision",
    help="Make bf.cfg (agent, config, units, firmware profile) and flash the DPU with bfb-install.",
)
@click.option(
    "--config",
    "config",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The agent TOML for the DPU.",
)
@click.option("--bfb", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The BFB image.")  # fmt: skip
@click.option("--rshim", help="rshimN, or HOST[:PORT]:rshimN through the BMC.")
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("dist/wheelhouse"),
    show_default=True,
    help="dpu-kvtier's wheel and its dependencies (scripts/build-wheelhouse.sh).",
)
@click.option("--profile", default="", help="Firmware profile applied at first boot.")
@click.option("--firmware-device", "firmware_devices", multiple=True,
              help="Device(s) to apply it to (default: both PFs' mst devices).")  # fmt: skip
@click.option("--set", "settings", multiple=True, help="bf.cfg setting KEY=VALUE (repeat).")
@click.option(
    "--write-cfg",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write bf.cfg here (without --bfb/--rshim: only that).",
)
@click.option("--bfb-install", "bfb_install", default="bfb-install", help="The installer.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def provision_cmd(
    config: Path,
    bfb: Path | None,
    rshim: str | None,
    wheelhouse: Path,
    profile: str,
    firmware_devices: tuple[str, ...],
    settings: tuple[str, ...],
    write_cfg: Path | None,
    bfb_install: str,
    as_json: bool,
) -> None:
    if (bfb is None) != (rshim is None) or (bfb is None and write_cfg is None):
        raise click.UsageError("give --bfb FILE and --rshim rshimN (and/or --write-cfg PATH)")
    inputs = pv.ProvisionInputs(
        config=config,
        wheelhouse=wheelhouse,
        profile=profile,
        firmware_devices=firmware_devices,
        installer=_settings(settings),
    )
    try:
        text, manifest = pv.render_bf_cfg(inputs)
    except (pv.ProvisionError, OSError) as e:
        _fail(EXIT_CONFIG, str(e), as_json)
    report: dict[str, Any] = {"ok": True, "manifest": manifest}
    with tempfile.TemporaryDirectory(prefix="dpukv-bfcfg-") as tmp:
        path = write_cfg or Path(tmp) / "bf.cfg"
        pv.write_bf_cfg(path, text, secret=bool(manifest["holds_secrets"]))
        report["bf_cfg"] = str(path) if write_cfg else None
        if bfb is not None and rshim is not None:
            try:
                argv = pv.bfb_install_argv(bfb, rshim, path, bfb_install)
                report["installer_tail"] = _install(argv, as_json)
            except pv.BfbInstallError as e:
                code = (
                    EXIT_MISSING if e.returncode is None and "not found" in str(e) else EXIT_FAILED
                )
                _fail(code, str(e), as_json, tail=e.tail)
    click.echo(
        json.dumps(report, indent=2)
        if as_json
        else f"bf.cfg: {report['bf_cfg'] or '(temporary)'}; payload "
        f"{manifest['payload_bytes'] >> 20} MiB, {len(manifest['wheels'])} wheels"
    )
