"""Provisioning a BlueField with the agent: bf.cfg with a `bfb_modify_os` hook that installs
the agent, its config, SPDK JSON config, firmware profile and systemd units into the new root,
and `bfb-install` wrapped with a progress bar (`dpuctl provision`)."""

from dpu_agent.provision._bfb import (
    BFB_INSTALL_TIMEOUT_S,
    BfbInstallError,
    BfbProgress,
    bfb_install_argv,
    parse_progress,
    run_bfb_install,
)
from dpu_agent.provision._bfcfg import (
    INSTALLER_KEYS,
    MST_DEVICE,
    ProvisionError,
    ProvisionInputs,
    build_payload,
    render_bf_cfg,
    write_bf_cfg,
)
from dpu_agent.provision._units import (
    AGENT_UNIT,
    FIRSTBOOT_UNIT,
    agent_unit,
    firstboot_unit,
    sysusers,
)

__all__ = [
    "AGENT_UNIT",
    "BFB_INSTALL_TIMEOUT_S",
    "FIRSTBOOT_UNIT",
    "INSTALLER_KEYS",
    "MST_DEVICE",
    "BfbInstallError",
    "BfbProgress",
    "ProvisionError",
    "ProvisionInputs",
    "agent_unit",
    "bfb_install_argv",
    "build_payload",
    "firstboot_unit",
    "parse_progress",
    "render_bf_cfg",
    "run_bfb_install",
    "sysusers",
    "write_bf_cfg",
]
