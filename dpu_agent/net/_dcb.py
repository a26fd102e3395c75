"""iproute2 `dcb`: command lines for PFC, DSCP->priority (app table) and ETS, and the parsers
of its JSON (`dcb -j -N ... show`, numbers rather than DSCP names).

The JSON shapes (iproute2 dcb_pfc.c, dcb_app.c, dcb_ets.c): `pfc show` gives
``{"pfc_cap": 8, "macsec_bypass": false, "delay": 0, "prio_pfc": [false, ..., true, ...]}``;
`app show` gives ``{"dscp_prio": [[26, 3], [48, 6]], ...}`` (a DSCP name like "CS6" without
-N); `ets show` gives ``{"willing": ..., "ets_cap": 8, "cbs": false, "tc_bw": [...],
"tc_tsa": ["ets", ...], "prio_tc": [...], ...}``. A driver without DCB (veth, virtio) makes
every call fail with "Operation not supported".
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from dpu_agent.net._desired import PRIOS, EtsSpec

__all__ = [
    "DCB_TIMEOUT_S",
    "DcbError",
    "DcbState",
    "app_argv",
    "ets_argv",
    "parse_app",
    "parse_ets",
    "parse_pfc",
    "pfc_argv",
    "read_dcb",
    "run_dcb",
    "show_argv",
]

DCB_TIMEOUT_S = 10.0  # one dcbnl netlink round trip; a hung driver must not hang dpuctl
OUTPUT_BYTES_MAX = 1 << 20
# RFC 2474/2597/3246 names `dcb app show` prints without -N
_DSCP_NAMES = (
    {f"CS{i}": i * 8 for i in range(8)}
    | {"EF": 46}
    | {f"AF{c}{d}": c * 8 + d * 2 for c in range(1, 5) for d in range(1, 4)}
)


class DcbError(Exception):
    """`dcb` is missing or refused: the command line and its message."""

    def __init__(self, argv: list[str], message: str, returncode: int = -1) -> None:
        self.argv, self.message, self.returncode = argv, message, returncode
        super().__init__(f"{' '.join(argv)}: {message}")

    @property
    def unsupported(self) -> bool:
        return "Operation not supported" in self.message


@dataclass(frozen=True, slots=True, kw_only=True)
class DcbState:
    pfc: tuple[int, ...] | None = None  # priorities with PFC on
    dscp_prio: dict[int, int] | None = None
    ets: EtsSpec | None = None
    error: str = ""  # why the state could not be read ("" = read)


def _base(netns: str) -> list[str]:
    return ["dcb", *(["-n", netns] if netns else [])]


def show_argv(what: str, dev: str, netns: str = "") -> list[str]:
    assert what in ("pfc", "app", "ets"), what
    return [*_base(netns), "-j", "-N", what, "show", "dev", dev]


def pfc_argv(dev: str, prios: tuple[int, ...], netns: str = "") -> list[str]:
    """Exactly `prios` lossless: all off first, then each on (one netlink set)."""
    return [*_base(netns), "pfc", "set", "dev", dev, "prio-pfc", "all:off",
            *(f"{p}:on" for p in prios)]  # fmt: skip


def app_argv(op: str, dev: str, dscp_prio: dict[int, int], netns: str = "") -> list[str]:
    assert op in ("add", "del") and dscp_prio, (op, dscp_prio)
    pairs = (f"{d}:{p}" for d, p in sorted(dscp_prio.items()))
    return [*_base(netns), "app", op, "dev", dev, "dscp-prio", *pairs]


def ets_argv(dev: str, ets: EtsSpec, netns: str = "") -> list[str]:
    def kv(values: tuple[Any, ...]) -> list[str]:
        return [f"{i}:{v}" for i, v in enumerate(values)]

    return [*_base(netns), "ets", "set", "dev", dev, "prio-tc", *kv(ets.prio_tc),
            "tc-tsa", *kv(ets.tc_tsa), "tc-bw", *kv(ets.tc_bw)]  # fmt: skip


def run_dcb(argv: list[str]) -> Any:
    """Run one dcb command; the parsed JSON for `show`, None otherwise."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise DcbError(argv, "dcb not installed (apt-get install iproute2)")
    try:
        out = subprocess.run(
            [exe, *argv[1:]], capture_output=True, text=True, timeout=DCB_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise DcbError(argv, f"no answer within {DCB_TIMEOUT_S:.0f} s") from None
    if out.returncode != 0:
        raise DcbError(argv, out.stderr.strip() or out.stdout.strip(), out.returncode)
    if "-j" not in argv:
        return None
    try:
        return json.loads(out.stdout[:OUTPUT_BYTES_MAX] or "{}")
    except ValueError as e:
        raise DcbError(argv, f"unparsable JSON: {e}") from None


def parse_pfc(doc: Any) -> tuple[int, ...]:
    flags = doc.get("prio_pfc") if isinstance(doc, dict) else None
    if not isinstance(flags, list) or len(flags) != PRIOS:
        raise ValueError(f"dcb pfc JSON: no prio_pfc list of {PRIOS}: {doc!r}")
    return tuple(i for i, on in enumerate(flags) if on is True or on == "on")


def _dscp(key: Any) -> int:
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    if isinstance(key, str) and key.upper() in _DSCP_NAMES:
        return _DSCP_NAMES[key.upper()]
    raise ValueError(f"dcb app JSON: unknown DSCP {key!r}")


def parse_app(doc: Any) -> dict[int, int]:
    if not isinstance(doc, dict):
        raise ValueError(f"dcb app JSON: expected an object, not {doc!r}")
    out: dict[int, int] = {}
    for pair in doc.get("dscp_prio", []):
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], int):
            raise ValueError(f"dcb app JSON: dscp_prio entry {pair!r} is not [dscp, prio]")
        out[_dscp(pair[0])] = pair[1]
    return dict(sorted(out.items()))


def parse_ets(doc: Any) -> EtsSpec:
    if not isinstance(doc, dict):
        raise ValueError(f"dcb ets JSON: expected an object, not {doc!r}")
    try:
        return EtsSpec(
            prio_tc=tuple(int(v) for v in doc["prio_tc"]),
            tc_tsa=tuple(str(v) for v in doc["tc_tsa"]),
            tc_bw=tuple(int(v) for v in doc["tc_bw"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"dcb ets JSON: {e!r} in {doc!r}") from None


def read_dcb(dev: str, netns: str = "") -> DcbState:
    """PFC, the DSCP app table and ETS of `dev`; `error` says why not (e.g. no DCB driver)."""
    try:
        pfc = parse_pfc(run_dcb(show_argv("pfc", dev, netns)))
        app = parse_app(run_dcb(show_argv("app", dev, netns)))
        ets = parse_ets(run_dcb(show_argv("ets", dev, netns)))
    except DcbError as e:
        return DcbState(error=str(e))
    except ValueError as e:
        return DcbState(error=str(e))
    return DcbState(pfc=pfc, dscp_prio=app, ets=ets)
