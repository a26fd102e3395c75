"""A real etcd (Debian's etcd-server) on loopback ephemeral ports, with auth on: a root user
for the test and a `dpukv` user allowed only the cluster's prefix. And a TCP proxy that can
black-hole a node's way to etcd (a partition between that node and etcd only)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dpu_agent.cluster import free_port

ETCD_BIN = shutil.which("etcd")
ETCD_START_TIMEOUT_S = 30.0  # a loaded 2-core box: etcd's first Raft election and fsyncs
PROXY_CONNECTIONS_MAX = 64  # a node opens one per etcd call plus one watch


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    return _b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))


@dataclass
class Etcd:
    proc: subprocess.Popen[bytes]
    url: str
    root_password: str
    user: str
    password_file: Path
    prefix: str
    tls: dict[str, Path] = field(default_factory=dict)  # ca, cert, key (the nodes' client cert)

    def call(self, path: str, body: dict, token: str = "") -> dict:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers)
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.tls["ca"]))
            ctx.load_cert_chain(self.tls["cert"], self.tls["key"])
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return json.loads(r.read())

    def root_token(self) -> str:
        doc = self.call("/v3/auth/authenticate", {"name": "root", "password": self.root_password})
        return str(doc["token"])

    def tenant_names(self) -> list[str]:
        """The tenant records under the cluster's prefix, read as root."""
        p = self.prefix + "/tenants/"
        doc = self.call("/v3/kv/range", {"key": _b64(p), "range_end": _prefix_end(p)},
                        self.root_token())  # fmt: skip
        return sorted(base64.b64decode(kv["key"]).decode()[len(p) :] for kv in doc.get("kvs", []))

    def env(self, url: str = "") -> dict[str, str]:
        """An agent's [cluster] etcd_* settings as environment overrides."""
        env = {
            "DPUKV_CLUSTER_ETCD_ENDPOINTS": url or self.url,
            "DPUKV_CLUSTER_ETCD_PREFIX": self.prefix,
            "DPUKV_CLUSTER_ETCD_USER": self.user,
            "DPUKV_CLUSTER_ETCD_PASSWORD_FILE": str(self.password_file),
        }
        if self.tls:
            env["DPUKV_CLUSTER_ETCD_CA_FILE"] = str(self.tls["ca"])
            env["DPUKV_CLUSTER_ETCD_CERT_FILE"] = str(self.tls["cert"])
            env["DPUKV_CLUSTER_ETCD_KEY_FILE"] = str(self.tls["key"])
        return env

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def start_etcd(root: Path, *, tls: bool = False) -> Etcd:
    """With `tls`: https only, and etcd demands a client certificate its CA signed."""
    assert ETCD_BIN is not None
    root.mkdir(parents=True, exist_ok=True)
    client, peer = free_port("127.0.0.1"), free_port("127.0.0.1")
    name = f"t{secrets.token_hex(3)}"
    url = f"{'https' if tls else 'http'}://127.0.0.1:{client}"
    args = [
        ETCD_BIN, "--name", name, "--data-dir", str(root / "etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"{name}=http://127.0.0.1:{peer}",
        "--unsafe-no-fsync",  # a test's etcd: durability is not what is under test
    ]  # fmt: skip
    files = _certificates(root) if tls else {}
    if tls:
        args += ["--cert-file", str(files["server"]), "--key-file", str(files["server_key"]),
                 "--trusted-ca-file", str(files["ca"]), "--client-cert-auth"]  # fmt: skip
    with open(root / "etcd.log", "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    pw_file = root / "etcd-dpukv.password"
    fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    password = secrets.token_urlsafe(16)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    e = Etcd(proc, url, secrets.token_urlsafe(16), "dpukv", pw_file,
             f"/dpukv-{secrets.token_hex(4)}")  # fmt: skip
    if tls:
        e.tls = {"ca": files["ca"], "cert": files["client"], "key": files["client_key"]}
    deadline = time.monotonic() + ETCD_START_TIMEOUT_S
    while True:
        try:
            e.call("/v3/kv/range", {"key": _b64("/")})
            break
        except (OSError, urllib.error.URLError, ssl.SSLError):
            if proc.poll() is not None or time.monotonic() > deadline:
                e.stop()
                tail = (root / "etcd.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"etcd did not start:\n{tail}") from None
            time.sleep(0.1)
    _enable_auth(e, password)
    return e


def _certificates(root: Path) -> dict[str, Path]:
    """A CA, etcd's server certificate (127.0.0.1) and the nodes' client certificate (no CN:
    etcd's JSON gateway refuses a CN; the user is the password-authenticated one)."""
    now = datetime.datetime.now(datetime.UTC)

    def build(
        subject: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        issuer: x509.Name,
        signer: ec.EllipticCurvePrivateKey,
        ca: bool,
        ip: bool,
    ) -> x509.Certificate:
        b = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )  # fmt: skip
        if ip:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            b = b.add_extension(san, critical=False)
        return b.sign(signer, hashes.SHA256())

    def save(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
        fd = os.open(root / f"{name}-key.pem", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dpukv-test-ca")])
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build(ca_name, ca_key, ca_name, ca_key, ca=True, ip=False)
    save("ca", ca, ca_key)
    server_key, client_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd")])
    save("server", build(server_name, server_key, ca_name, ca_key, ca=False, ip=True), server_key)
    nodes = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dpukv-nodes")])
    save("client", build(nodes, client_key, ca_name, ca_key, ca=False, ip=False), client_key)
    return {
        "ca": root / "ca.pem", "server": root / "server.pem", "server_key": root / "server-key.pem",
        "client": root / "client.pem", "client_key": root / "client-key.pem",
    }  # fmt: skip


def _enable_auth(e: Etcd, password: str) -> None:
    e.call("/v3/auth/user/add", {"name": "root", "password": e.root_password})
    e.call("/v3/auth/role/add", {"name": "root"})
    e.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    e.call("/v3/auth/user/add", {"name": e.user, "password": password})
    e.call("/v3/auth/role/add", {"name": e.user})
    perm = {"permType": "READWRITE", "key": _b64(e.prefix + "/"),
            "range_end": _prefix_end(e.prefix + "/")}  # fmt: skip
    e.call("/v3/auth/role/grant", {"name": e.user, "perm": perm})
    e.call("/v3/auth/user/grant", {"user": e.user, "role": e.user})
    e.call("/v3/auth/enable", {})


class BlackHoleProxy:
    """Forwards loopback TCP to `target`; `cut()` closes what is open and then accepts new
    connections without ever answering them (packets dropped, as a partition looks to the
    node); `heal()` forwards again."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=PROXY_CONNECTIONS_MAX)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._cut = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            for s in list(self._open):
                with contextlib.suppress(OSError):
                    s.close()
            self._open.clear()

    def heal(self) -> None:
        self.cut()  # the held (black-holed) connections end; new ones are forwarded
        self._cut.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if len(self._open) >= PROXY_CONNECTIONS_MAX:
                    conn.close()
                    continue
                self._open.add(conn)
            if self._cut.is_set():
                continue  # held open, never answered
            try:
                up = socket.create_connection(self._target, timeout=5)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self._open.add(up)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._cut.is_set():
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()
