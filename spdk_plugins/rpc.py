"""Typed SPDK JSON-RPC client: one wrapper per RPC, SPDK's parameter names verbatim.

Framing goes through the official `spdk` package (`spdk.rpc.client.JSONRPCClient`); this module
adds what it lacks: structured errors (method, params, JSON-RPC code), a wall-clock bound on
every call (the package's timeout counts CPU time, so a stalled target would block forever),
and `None` = omit handled in one place (`_omit.omit_none`), so `0` and `False` are sent.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any

from spdk.rpc.client import JSONRPCClient, JSONRPCException

from spdk_plugins._log import get_logger
from spdk_plugins._omit import omit_none

__all__ = [
    "SECRET_PARAM_NAMES",
    "SpdkClient",
    "SpdkConnectionError",
    "SpdkError",
    "SpdkRpcError",
    "SpdkTimeout",
    "redact_params",
]

_log = get_logger("spdk_plugins.rpc")

# Parameters that carry key material; never logged, never printed.
SECRET_PARAM_NAMES = frozenset({"key", "key2"})
REDACTED = "<redacted>"
# A create or delete on a loaded target answers in well under a second; lvstore creation with
# unmap on a large NVMe drive is the slow one (tens of seconds), hence 60 s.
RPC_TIMEOUT_S_DEFAULT = 60.0
RPC_TIMEOUT_S_MAX = 600.0


def redact_params(params: Any) -> Any:
    """A deep copy of params with every key-material field replaced by `<redacted>`."""
    if isinstance(params, dict):
        return {
            k: (REDACTED if k in SECRET_PARAM_NAMES else redact_params(v))
            for k, v in params.items()
        }
    if isinstance(params, list):
        return [redact_params(v) for v in params]
    return params


class SpdkError(Exception):
    """Base class of everything this driver raises about the SPDK target."""


class SpdkConnectionError(SpdkError):
    """The socket could not be reached, or the target closed the connection."""


class SpdkTimeout(SpdkError):
    """No reply within the wall-clock bound; the connection is closed and unusable."""


class SpdkRpcError(SpdkError):
    """A JSON-RPC error response: `code` is SPDK's (negative errno or -326xx)."""

    def __init__(self, method: str, params: dict[str, Any] | None, code: int, message: str):
        self.method = method
        self.params = redact_params(params or {})
        self.code = code
        self.message = message
        super().__init__(f"{method} failed: SPDK error {code} {message!r} (params {self.params})")

    @property
    def is_exists(self) -> bool:
        return self.code == -errno.EEXIST


class SpdkClient:
    """A connection to one SPDK target's JSON-RPC socket. Not thread-safe: one caller at a time."""

    def __init__(self, socket_path: str, *, timeout_s: float = RPC_TIMEOUT_S_DEFAULT) -> None:
        if not 0 < timeout_s <= RPC_TIMEOUT_S_MAX:
            raise ValueError(f"timeout_s {timeout_s} not in (0, {RPC_TIMEOUT_S_MAX}]")
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        # The package's client logs "Setting log level" at INFO on its own logger before it
        # applies log_level; set that logger's level first so connecting stays quiet.
        logging.getLogger(f"JSONRPCClient({socket_path})").setLevel(logging.ERROR)
        try:
            self._client = JSONRPCClient(socket_path, timeout=timeout_s)
        except JSONRPCException as e:
            raise SpdkConnectionError(
                f"cannot connect to SPDK at {socket_path}: {e.message.splitlines()[-1]}; "
                "is spdk_tgt running with -r pointing there?"
            ) from e
        self._broken = False

    def close(self) -> None:
        if self._client.sock is not None:
            try:
                self._client.close()
            except OSError:
                self._client.sock = None

    def __enter__(self) -> SpdkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """Send one request and wait for its reply, at most `timeout_s` of wall-clock time."""
        if self._broken or self._client.sock is None:
            raise SpdkConnectionError(f"connection to {self.socket_path} is closed; reconnect")
        fired = threading.Event()
        sock = self._client.sock

        def _expire() -> None:
            fired.set()
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        watchdog = threading.Timer(self.timeout_s, _expire)
        watchdog.daemon = True
        start = time.monotonic()
        watchdog.start()
        try:
            req_id = self._client.send(method, params or None)
            response = self._client.recv()
        except (JSONRPCException, OSError) as e:
            self._broken = True
            if fired.is_set():
                raise SpdkTimeout(
                    f"{method}: no reply from {self.socket_path} within {self.timeout_s} s"
                ) from e
            detail = e.message if isinstance(e, JSONRPCException) else str(e)
            raise SpdkConnectionError(
                f"{method}: connection to {self.socket_path} lost: {detail.splitlines()[0]}"
            ) from e
        finally:
            watchdog.cancel()
        elapsed_ms = round((time.monotonic() - start) * 1000, 3)
        if response.get("id") != req_id:
            self._broken = True
            raise SpdkConnectionError(f"{method}: reply id {response.get('id')} != {req_id}")
        if "error" in response:
            err = response["error"]
            _log.info("spdk_rpc_error", method=method, code=err.get("code"), ms=elapsed_ms)
            raise SpdkRpcError(method, params, int(err.get("code", 0)), str(err.get("message")))
        _log.debug("spdk_rpc", method=method, ms=elapsed_ms)
        return response.get("result")

    # --- framework ---

    def spdk_get_version(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("spdk_get_version")
        return result

    def rpc_get_methods(
        self, *, current: bool | None = None, include_aliases: bool | None = None
    ) -> list[str]:
        result: list[str] = self.call(
            "rpc_get_methods", omit_none(current=current, include_aliases=include_aliases)
        )
        return result

    def framework_start_init(self) -> bool:
        result: bool = self.call("framework_start_init")
        return result

    def framework_get_subsystems(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("framework_get_subsystems")
        return result

    def framework_get_config(self, *, name: str, with_batches: bool | None = None) -> Any:
        return self.call("framework_get_config", omit_none(name=name, with_batches=with_batches))

    # --- accel ---

    def accel_get_module_info(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("accel_get_module_info")
        return result

    def accel_get_opc_assignments(self) -> dict[str, str]:
        result: dict[str, str] = self.call("accel_get_opc_assignments")
        return result

    def mlx5_scan_accel_module(
        self,
        *,
        qp_size: int | None = None,
        num_requests: int | None = None,
        allowed_devs: str | None = None,
        crypto_split_blocks: int | None = None,
        enable_driver: bool | None = None,
    ) -> bool:
        result: bool = self.call(
            "mlx5_scan_accel_module",
            omit_none(
                qp_size=qp_size,
                num_requests=num_requests,
                allowed_devs=allowed_devs,
                crypto_split_blocks=crypto_split_blocks,
                enable_driver=enable_driver,
            ),
        )
        return result

    def accel_crypto_key_create(
        self,
        *,
        cipher: str,
        key: str,
        name: str,
        key2: str | None = None,
        tweak_mode: str | None = None,
    ) -> bool:
        result: bool = self.call(
            "accel_crypto_key_create",
            omit_none(cipher=cipher, key=key, key2=key2, tweak_mode=tweak_mode, name=name),
        )
        return result

    def accel_crypto_key_destroy(self, *, key_name: str) -> bool:
        result: bool = self.call("accel_crypto_key_destroy", omit_none(key_name=key_name))
        return result

    def accel_crypto_keys_get(self, *, key_name: str | None = None) -> list[dict[str, Any]]:
        """Key metadata. SPDK returns key material in clear: it is dropped here, never kept."""
        keys: list[dict[str, Any]] = self.call(
            "accel_crypto_keys_get", omit_none(key_name=key_name)
        )
        return [{k: v for k, v in entry.items() if k not in SECRET_PARAM_NAMES} for entry in keys]

    def accel_crypto_keys_fingerprint(self) -> dict[str, tuple[str, str]]:
        """name -> (key, key2) for comparing with the key store; the caller must not log it."""
        keys: list[dict[str, Any]] = self.call("accel_crypto_keys_get")
        return {e["name"]: (str(e.get("key", "")), str(e.get("key2", ""))) for e in keys}

    # --- bdev ---

    def bdev_get_bdevs(
        self, *, name: str | None = None, timeout: int | None = None
    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call(
            "bdev_get_bdevs", omit_none(name=name, timeout=timeout)
        )
        return result

    def bdev_malloc_create(
        self,
        *,
        block_size: int,
        num_blocks: int,
        name: str | None = None,
        uuid: str | None = None,
        optimal_io_boundary: int | None = None,
        physical_block_size: int | None = None,
        numa_id: int | None = None,
    ) -> str:
        result: str = self.call(
            "bdev_malloc_create",
            omit_none(
                name=name,
                block_size=block_size,
                num_blocks=num_blocks,
                uuid=uuid,
                optimal_io_boundary=optimal_io_boundary,
                physical_block_size=physical_block_size,
                numa_id=numa_id,
            ),
        )
        return result

    def bdev_malloc_delete(self, *, name: str) -> bool:
        result: bool = self.call("bdev_malloc_delete", omit_none(name=name))
        return result

    def bdev_aio_create(
        self,
        *,
        name: str,
        filename: str,
        block_size: int | None = None,
        readonly: bool | None = None,
        fallocate: bool | None = None,
        uuid: str | None = None,
        nowait: bool | None = None,
    ) -> str:
        result: str = self.call(
            "bdev_aio_create",
            omit_none(
                name=name,
                filename=filename,
                block_size=block_size,
                readonly=readonly,
                fallocate=fallocate,
                uuid=uuid,
                nowait=nowait,
            ),
        )
        return result

    def bdev_aio_delete(self, *, name: str) -> bool:
        result: bool = self.call("bdev_aio_delete", omit_none(name=name))
        return result

    def bdev_uring_create(
        self, *, name: str, filename: str, block_size: int | None = None, uuid: str | None = None
    ) -> str:
        result: str = self.call(
            "bdev_uring_create",
            omit_none(name=name, filename=filename, block_size=block_size, uuid=uuid),
        )
        return result

    def bdev_uring_delete(self, *, name: str) -> bool:
        result: bool = self.call("bdev_uring_delete", omit_none(name=name))
        return result

    def bdev_nvme_attach_controller(
        self,
        *,
        name: str,
        trtype: str,
        traddr: str,
        adrfam: str | None = None,
        trsvcid: str | None = None,
        subnqn: str | None = None,
        hostnqn: str | None = None,
        hdgst: bool | None = None,
        ddgst: bool | None = None,
        num_io_queues: int | None = None,
        ctrlr_loss_timeout_sec: int | None = None,
        reconnect_delay_sec: int | None = None,
        fast_io_fail_timeout_sec: int | None = None,
    ) -> list[str]:
        result: list[str] = self.call(
            "bdev_nvme_attach_controller",
            omit_none(
                name=name,
                trtype=trtype,
                traddr=traddr,
                adrfam=adrfam,
                trsvcid=trsvcid,
                subnqn=subnqn,
                hostnqn=hostnqn,
                hdgst=hdgst,
                ddgst=ddgst,
                num_io_queues=num_io_queues,
                ctrlr_loss_timeout_sec=ctrlr_loss_timeout_sec,
                reconnect_delay_sec=reconnect_delay_sec,
                fast_io_fail_timeout_sec=fast_io_fail_timeout_sec,
            ),
        )
        return result

    def bdev_nvme_detach_controller(self, *, name: str) -> bool:
        result: bool = self.call("bdev_nvme_detach_controller", omit_none(name=name))
        return result

    def bdev_crypto_create(self, *, base_bdev_name: str, name: str, key_name: str) -> str:
        result: str = self.call(
            "bdev_crypto_create",
            omit_none(base_bdev_name=base_bdev_name, name=name, key_name=key_name),
        )
        return result

    def bdev_crypto_delete(self, *, name: str) -> bool:
        result: bool = self.call("bdev_crypto_delete", omit_none(name=name))
        return result

    def bdev_lvol_get_lvstores(
        self, *, uuid: str | None = None, lvs_name: str | None = None
    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call(
            "bdev_lvol_get_lvstores", omit_none(uuid=uuid, lvs_name=lvs_name)
        )
        return result

    def bdev_lvol_create_lvstore(
        self,
        *,
        bdev_name: str,
        lvs_name: str,
        cluster_sz: int | None = None,
        clear_method: str | None = None,
        num_md_pages_per_cluster_ratio: int | None = None,
    ) -> str:
        result: str = self.call(
            "bdev_lvol_create_lvstore",
            omit_none(
                bdev_name=bdev_name,
                lvs_name=lvs_name,
                cluster_sz=cluster_sz,
                clear_method=clear_method,
                num_md_pages_per_cluster_ratio=num_md_pages_per_cluster_ratio,
            ),
        )
        return result

    def bdev_lvol_delete_lvstore(
        self, *, uuid: str | None = None, lvs_name: str | None = None
    ) -> bool:
        result: bool = self.call(
            "bdev_lvol_delete_lvstore", omit_none(uuid=uuid, lvs_name=lvs_name)
        )
        return result

    def bdev_lvol_create(
        self,
        *,
        lvol_name: str,
        size_in_mib: int,
        thin_provision: bool | None = None,
        uuid: str | None = None,
        lvs_name: str | None = None,
        clear_method: str | None = None,
    ) -> str:
        result: str = self.call(
            "bdev_lvol_create",
            omit_none(
                lvol_name=lvol_name,
                size_in_mib=size_in_mib,
                thin_provision=thin_provision,
                uuid=uuid,
                lvs_name=lvs_name,
                clear_method=clear_method,
            ),
        )
        return result

    def bdev_lvol_delete(self, *, name: str) -> bool:
        result: bool = self.call("bdev_lvol_delete", omit_none(name=name))
        return result

    # --- nvmf ---

    def nvmf_create_transport(self, *, trtype: str, **tuning: Any) -> bool:
        """Transport tuning parameters go through by SPDK name (max_queue_depth, zcopy, ...)."""
        result: bool = self.call("nvmf_create_transport", omit_none(trtype=trtype, **tuning))
        return result

    def nvmf_get_transports(
        self, *, trtype: str | None = None, tgt_name: str | None = None
    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call(
            "nvmf_get_transports", omit_none(trtype=trtype, tgt_name=tgt_name)
        )
        return result

    def nvmf_get_subsystems(
        self, *, nqn: str | None = None, tgt_name: str | None = None
    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call(
            "nvmf_get_subsystems", omit_none(nqn=nqn, tgt_name=tgt_name)
        )
        return result

    def nvmf_create_subsystem(
        self,
        *,
        nqn: str,
        serial_number: str | None = None,
        model_number: str | None = None,
        max_namespaces: int | None = None,
        allow_any_host: bool | None = None,
        ana_reporting: bool | None = None,
    ) -> bool:
        result: bool = self.call(
            "nvmf_create_subsystem",
            omit_none(
                nqn=nqn,
                serial_number=serial_number,
                model_number=model_number,
                max_namespaces=max_namespaces,
                allow_any_host=allow_any_host,
                ana_reporting=ana_reporting,
            ),
        )
        return result

    def nvmf_delete_subsystem(self, *, nqn: str) -> bool:
        result: bool = self.call("nvmf_delete_subsystem", omit_none(nqn=nqn))
        return result

    def nvmf_subsystem_add_ns(self, *, nqn: str, namespace: dict[str, Any]) -> int:
        """`namespace` is SPDK's rpc_nvmf_namespace object: bdev_name, nsid, uuid, nguid..."""
        result: int = self.call("nvmf_subsystem_add_ns", omit_none(nqn=nqn, namespace=namespace))
        return result

    def nvmf_subsystem_remove_ns(self, *, nqn: str, nsid: int) -> bool:
        result: bool = self.call("nvmf_subsystem_remove_ns", omit_none(nqn=nqn, nsid=nsid))
        return result

    def nvmf_subsystem_add_listener(
        self, *, nqn: str, listen_address: dict[str, str], secure_channel: bool | None = None
    ) -> bool:
        result: bool = self.call(
            "nvmf_subsystem_add_listener",
            omit_none(nqn=nqn, listen_address=listen_address, secure_channel=secure_channel),
        )
        return result

    def nvmf_subsystem_remove_listener(self, *, nqn: str, listen_address: dict[str, str]) -> bool:
        result: bool = self.call(
            "nvmf_subsystem_remove_listener", omit_none(nqn=nqn, listen_address=listen_address)
        )
        return result

    def nvmf_subsystem_add_host(self, *, nqn: str, host: str) -> bool:
        result: bool = self.call("nvmf_subsystem_add_host", omit_none(nqn=nqn, host=host))
        return result

    def nvmf_subsystem_remove_host(self, *, nqn: str, host: str) -> bool:
        result: bool = self.call("nvmf_subsystem_remove_host", omit_none(nqn=nqn, host=host))
        return result

    def nvmf_subsystem_allow_any_host(self, *, nqn: str, allow_any_host: bool) -> bool:
        result: bool = self.call(
            "nvmf_subsystem_allow_any_host", omit_none(nqn=nqn, allow_any_host=allow_any_host)
        )
        return result
