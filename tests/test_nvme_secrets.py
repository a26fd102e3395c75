"""DHHC-1 secrets and NVMeTLSkey-1 PSKs: formats, CRC, transforms, and nvme-cli both ways."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvproto.nvme import DhchapHash, DhchapSecret, SecretFormatError, TlsPsk, parse_identity
from kvproto.nvme._secrets import hkdf_expand_label_info

DATA = Path(__file__).parent / "data" / "nvme_auth"
NVME = shutil.which("nvme") or ""
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3ccabcd"
SUBNQN = "nqn.2026-11.io.dpu-kvtier:tenant:a"


def test_dhchap_secret_matches_nvme_cli_for_a_given_secret() -> None:
    # `nvme gen-dhchap-key -s 000102...1f -m 0` (nvme-cli 2.3), recorded in the data file
    s = DhchapSecret(secret=bytes(range(32)))
    assert s.format() == "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
    assert s.format() in (DATA / "nvme_cli_2.3_keys.txt").read_text().split()


def test_recorded_nvme_cli_keys_parse() -> None:
    lines = (DATA / "nvme_cli_2.3_keys.txt").read_text().split()
    dh = [DhchapSecret.parse(x) for x in lines if x.startswith("DHHC-1")]
    tls = [TlsPsk.parse(x) for x in lines if x.startswith("NVMeTLSkey-1")]
    assert [s.hash for s in dh[:4]] == list(DhchapHash)
    assert [len(s.secret) for s in dh] == [32, 32, 48, 64, 32, 64]
    assert [(p.hash, len(p.psk)) for p in tls] == [(DhchapHash.SHA256, 32), (DhchapHash.SHA384, 48)]
    assert [s.format() for s in dh] == [x for x in lines if x.startswith("DHHC-1")]


@pytest.mark.parametrize("h", list(DhchapHash))
def test_dhchap_round_trip_and_transform(h: DhchapHash) -> None:
    s = DhchapSecret.generate(h)
    assert DhchapSecret.parse(s.format()) == s
    t = s.transformed(HOSTNQN)
    if h is DhchapHash.NONE:
        assert t == s.secret
    else:
        assert len(t) == h.length and t != s.secret and t != s.transformed(HOSTNQN + "x")


@pytest.mark.parametrize(
    "text",
    [
        "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:",  # CRC off by one
        "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR",  # no trailing colon
        "DHHC-1:04:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",  # unknown hash
        "DHHC-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",  # 32 bytes for SHA-384
        "DHHC-2:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
        "DHHC-1:00:not base64!:",
        "DHHC-1:00:AAAA:",
        "DHHC-1:0:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
        "",
        "DHHC-1:00:" + "A" * 400 + ":",
    ],
)
def test_bad_dhchap_secrets_are_refused_with_a_reason(text: str) -> None:
    with pytest.raises(SecretFormatError):
        DhchapSecret.parse(text)


def _draw(hash: DhchapHash, blind: bool) -> bytes:
    """Random bytes that, as a PSK for HOSTNQN on SUBNQN, derive a TLS PSK starting 0x00
    (`blind`) or not."""
    while True:
        raw = os.urandom(hash.length)
        if TlsPsk(psk=raw, hash=hash).spdk_takes_for_none(HOSTNQN, SUBNQN) == blind:
            return raw


@pytest.mark.parametrize("h", [DhchapHash.SHA256, DhchapHash.SHA384])
def test_generated_psk_is_never_one_spdk_takes_for_no_key(
    h: DhchapHash, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first draw derives a TLS PSK beginning 0x00 (SPDK's initiator would go plaintext):
    # generate draws again and returns the second
    blind, good = _draw(h, True), _draw(h, False)
    draws = iter([blind, good])
    monkeypatch.setattr("kvproto.nvme._secrets.os.urandom", lambda n: next(draws))
    p = TlsPsk.generate(HOSTNQN, SUBNQN, h)
    assert p.psk == good and not p.spdk_takes_for_none(HOSTNQN, SUBNQN)
    assert TlsPsk(psk=blind, hash=h).tls_psk(HOSTNQN, SUBNQN)[0] == 0


def test_secret_repr_does_not_leak_the_key() -> None:
    s = DhchapSecret.generate()
    p = TlsPsk.generate(HOSTNQN, SUBNQN)
    assert s.format()[10:20] not in repr(s) and p.format()[16:26] not in repr(p)


@pytest.mark.parametrize("h", [DhchapHash.NONE, DhchapHash.SHA256, DhchapHash.SHA384])
def test_tls_psk_round_trip_and_derivations(h: DhchapHash) -> None:
    p = TlsPsk.generate(HOSTNQN, SUBNQN, h)
    assert TlsPsk.parse(p.format()) == p
    ident = p.identity(HOSTNQN, "nqn.2026-11.io.dpu-kvtier:tenant:a")
    assert ident.startswith("NVMe0R0") and parse_identity(ident)[1:] == (
        HOSTNQN,
        "nqn.2026-11.io.dpu-kvtier:tenant:a",
    )
    derived = p.tls_psk(HOSTNQN, "nqn.2026-11.io.dpu-kvtier:tenant:a")
    assert len(derived) == p.cipher_hash.length
    assert derived != p.tls_psk(HOSTNQN, "nqn.2026-11.io.dpu-kvtier:tenant:b")
    assert (p.retained(HOSTNQN) == p.psk) == (h is DhchapHash.NONE)


def test_hkdf_label_layout() -> None:
    # RFC 8446 HkdfLabel: uint16 length, opaque label<7..255> ("tls13 " + label), context<0..255>
    assert hkdf_expand_label_info(32, "HostNQN", b"nqn.x") == (
        b"\x00\x20\x0dtls13 HostNQN\x05nqn.x"
    )


def test_bad_psk_identity() -> None:
    for ident in ["NVMe0R03 a b", "NVMe1R01 a b c", "NVMe0R01 a", ""]:
        with pytest.raises(SecretFormatError):
            parse_identity(ident)


@pytest.mark.skipif(not NVME, reason="nvme-cli is not installed (apt-get install nvme-cli)")
class TestNvmeCli:
    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([NVME, *args], capture_output=True, text=True, timeout=30)

    @pytest.mark.parametrize("h", list(DhchapHash))
    def test_nvme_cli_accepts_our_dhchap_secrets(self, h: DhchapHash) -> None:
        out = self._run("check-dhchap-key", "-k", DhchapSecret.generate(h).format())
        assert out.returncode == 0 and "Key is valid" in out.stdout, out

    def test_nvme_cli_refuses_a_corrupted_one(self) -> None:
        text = DhchapSecret.generate().format()
        bad = text[:12] + ("A" if text[12] != "A" else "B") + text[13:]
        assert self._run("check-dhchap-key", "-k", bad).returncode != 0

    @pytest.mark.parametrize("m", [0, 1, 2, 3])
    def test_we_accept_nvme_cli_dhchap_secrets(self, m: int) -> None:
        out = self._run("gen-dhchap-key", "-m", str(m), "-n", HOSTNQN)
        assert DhchapSecret.parse(out.stdout.strip()).hash == DhchapHash(m)

    def test_nvme_cli_dhchap_secret_from_hex_is_ours(self) -> None:
        raw = os.urandom(48)
        out = self._run("gen-dhchap-key", "-s", raw.hex(), "-l", "48", "-m", "0")
        assert out.stdout.strip() == DhchapSecret(secret=raw).format()

    @pytest.mark.parametrize("h", [DhchapHash.SHA256, DhchapHash.SHA384])
    def test_tls_keys_both_ways(self, h: DhchapHash) -> None:
        ours = TlsPsk.generate(HOSTNQN, SUBNQN, h).format()
        out = self._run("check-tls-key", "-k", ours)
        assert out.returncode == 0 and "Key is valid" in out.stdout, out
        theirs = self._run("gen-tls-key", "-m", str(h.value)).stdout.strip()
        assert TlsPsk.parse(theirs).hash is h
