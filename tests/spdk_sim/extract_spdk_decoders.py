"""Record the JSON-RPC decoders of the SPDK methods the mlx5 crypto plan sends, from SPDK's source.

Reads a git clone of github.com/spdk/spdk at a tag (no build needed) and writes
tests/data/spdk/mlx5_crypto_rpcs_v26_05.json: for each method, the C file and decoder table
it came from and each parameter's name, decoder and whether it is optional (the fourth field
of SPDK's `spdk_json_object_decoder`), cross-checked against the tag's schema/schema.json (the
names, types and required flags the decoders are generated from); the cipher and tweak-mode
names; and what the mlx5 accel module accepts (accel_mlx5.c, lib/accel/accel.c). Run from the
repo root: `python3 tests/spdk_sim/extract_spdk_decoders.py /path/to/spdk.git v26.05`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "data" / "spdk" / "mlx5_crypto_rpcs_v26_05.json"

# method -> (C file, decoder table; None: the handler takes no parameters)
METHODS: dict[str, tuple[str, str | None]] = {
    "mlx5_scan_accel_module": (
        "module/accel/mlx5/accel_mlx5_rpc.c",
        "rpc_mlx5_scan_accel_module_decoders",
    ),
    "framework_start_init": ("lib/event/app.c", None),
    "accel_get_module_info": ("lib/accel/accel_rpc.c", None),
    "accel_get_opc_assignments": ("lib/accel/accel_rpc.c", None),
    "accel_crypto_key_create": ("lib/accel/accel_rpc.c", "rpc_accel_crypto_key_create_decoders"),
    "accel_crypto_keys_get": ("lib/accel/accel_rpc.c", "rpc_accel_crypto_keys_get_decoders"),
    "accel_crypto_key_destroy": ("lib/accel/accel_rpc.c", "rpc_accel_crypto_key_destroy_decoders"),
    "bdev_crypto_create": (
        "module/bdev/crypto/vbdev_crypto_rpc.c",
        "rpc_bdev_crypto_create_decoders",
    ),
    "bdev_crypto_delete": (
        "module/bdev/crypto/vbdev_crypto_rpc.c",
        "rpc_bdev_crypto_delete_decoders",
    ),
}
# SPDK's decoder functions -> the schema's type names
DECODER_TYPES = {
    "spdk_json_decode_string": "string",
    "spdk_json_decode_bool": "boolean",
    "spdk_json_decode_uint16": "uint16",
    "spdk_json_decode_uint32": "uint32",
    "spdk_json_decode_uint64": "uint64",
    "rpc_decode_accel_crypto_cipher": "enum",
    "rpc_decode_accel_crypto_tweak_mode": "enum",
}
_TABLE = r"spdk_json_object_decoder\s+{name}\[\]\s*=\s*\{{(.*?)\n\}};"
_ENTRY = re.compile(
    r'\{\s*"(\w+)"\s*,\s*offsetof\([^)]*\)\s*,\s*(\w+)\s*(?:,\s*(true|false))?\s*\}'
)


def _show(repo: Path, tag: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"{tag}:{path}"], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip


def _decoders(source: str, table: str) -> list[dict[str, Any]]:
    found = re.search(_TABLE.format(name=re.escape(table)), source, re.S)
    if found is None:
        raise SystemExit(f"decoder table {table} not found")
    out = []
    for name, decoder, optional in _ENTRY.findall(found.group(1)):
        out.append({"name": name, "decoder": decoder, "type": DECODER_TYPES[decoder],
                    "required": optional != "true"})  # fmt: skip
    return out


def main(repo: Path, tag: str) -> None:
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", f"{tag}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    schema = json.loads(_show(repo, tag, "schema/schema.json"))
    by_name = {m["name"]: m for m in schema["methods"]}
    methods: dict[str, Any] = {}
    for method, (path, table) in METHODS.items():
        source = _show(repo, tag, path)
        if f'SPDK_RPC_REGISTER("{method}"' not in source:
            raise SystemExit(f"{method} is not registered in {path}")
        state = re.search(rf'SPDK_RPC_REGISTER\("{method}",\s*\w+,\s*(\w+)\)', source)
        params = _decoders(source, table) if table else []
        want = [(p["name"], p["type"], bool(p.get("required"))) for p in by_name[method]["params"]]
        got = [(p["name"], p["type"], p["required"]) for p in params]
        if sorted(want) != sorted(got):
            raise SystemExit(f"{method}: C decoders {got} differ from schema.json {want}")
        methods[method] = {"file": path, "decoders": table, "params": params,
                           "state": state.group(1) if state else "?"}  # fmt: skip
    enums = {e["name"]: [f["name"] for f in e["fields"]] for e in schema["enums"]
             if e["name"] in ("accel_crypto_cipher", "accel_crypto_tweak_mode")}  # fmt: skip
    mlx5 = _show(repo, tag, "module/accel/mlx5/accel_mlx5.c")
    accel = _show(repo, tag, "lib/accel/accel.c")
    # the facts "mlx5_module" below states, as the source says them
    facts = [
        (mlx5, "key_size == SPDK_ACCEL_AES_XTS_128_KEY_SIZE || "
               "key_size == SPDK_ACCEL_AES_XTS_256_KEY_SIZE", True),
        (mlx5, ".crypto_supports_tweak_mode", False),
        (accel, "!module->crypto_supports_tweak_mode && "
                "key->tweak_mode != ACCEL_CRYPTO_TWEAK_MODE_DEFAULT", True),
    ]  # fmt: skip
    for text, needle, present in facts:
        if (needle in text) != present:
            raise SystemExit(f"{tag}: the mlx5 facts changed ({needle!r}); update mlx5_module")
    doc = {
        "_comment": (
            "Generated by tests/spdk_sim/extract_spdk_decoders.py from SPDK's source (C decoder "
            "tables, cross-checked against schema/schema.json of the same tag). 'required' is "
            "the negation of the decoder's optional flag."
        ),
        "spdk": {"repository": "https://github.com/spdk/spdk", "tag": tag, "commit": commit},
        "methods": methods,
        "enums": enums,
        "mlx5_module": {
            "ciphers": {"AES_XTS": [16, 32]},  # bytes per key half (128/256-bit XTS)
            "tweak_modes": ["SIMPLE_LBA"],
            "why": (
                "accel_mlx5.c: accel_mlx5_crypto_supports_cipher accepts AES_XTS with "
                "SPDK_ACCEL_AES_XTS_128_KEY_SIZE or _256_KEY_SIZE only; the module has no "
                "crypto_supports_tweak_mode, so lib/accel/accel.c refuses every tweak mode but "
                "the default (SIMPLE_LBA). mlx5_scan_accel_module is an SPDK_RPC_STARTUP method: "
                "served only before framework_start_init. framework_start_init refuses any "
                "params (lib/event/app.c)."
            ),
        },
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "v26.05")
