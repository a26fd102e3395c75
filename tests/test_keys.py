"""Chunk keys: deterministic across processes, salted, layout-bound, chained."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvproto.keys import ChunkLayout, chunk_keys

SALT = bytes(range(32))
LAYOUT = ChunkLayout("meta-llama/Llama-3.1-8B", "bfloat16", 32, 8, 128)
TOKENS = [(i * 7919) % 128256 for i in range(1000)]


def test_layout_id_and_shape() -> None:
    assert len(LAYOUT.layout_id) == 16
    assert LAYOUT.chunk_shape == (32, 2, 8, 256, 128)
    assert LAYOUT.itemsize == 2
    assert LAYOUT.chunk_bytes == 32 * 2 * 8 * 256 * 128 * 2
    assert ChunkLayout("m", "torch.float16", 1, 1, 1).dtype == "float16"


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_id", "other"),
        ("dtype", "float16"),
        ("num_layers", 31),
        ("num_kv_heads", 4),
        ("head_dim", 64),
        ("tp_rank", 1),
        ("chunk_tokens", 128),
    ],
)
def test_every_layout_field_changes_layout_id(field: str, value: object) -> None:
    fields = {
        "model_id": LAYOUT.model_id,
        "dtype": LAYOUT.dtype,
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "tp_rank": 0,
        "chunk_tokens": 256,
    }
    fields[field] = value
    assert ChunkLayout(**fields).layout_id != LAYOUT.layout_id  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float64"}, "dtype"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"model_id": ""}, "model_id"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
    ],
)
def test_layout_validation(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "model_id": "m",
        "dtype": "float16",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 1,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ChunkLayout(**fields)  # type: ignore[arg-type]


def _keys(tokens: object = TOKENS, salt: bytes = SALT, layout: ChunkLayout = LAYOUT) -> list[bytes]:
    return chunk_keys(tokens, salt=salt, layout_id=layout.layout_id, chunk_tokens=256)  # type: ignore[arg-type]


def test_one_key_per_full_chunk_only() -> None:
    assert len(_keys()) == 3  # 1000 tokens: 3 full chunks of 256, the 232-token tail gets none
    assert _keys(TOKENS[:255]) == []
    assert len(_keys(TOKENS[:768])) == 3
    assert all(len(k) == 16 for k in _keys())
    assert _keys(TOKENS[:512]) == _keys()[:2]


def test_list_and_numpy_tokens_agree() -> None:
    assert _keys(np.array(TOKENS, dtype=np.int64)) == _keys()
    assert _keys(np.array(TOKENS, dtype=np.uint32)) == _keys()


def test_same_keys_in_another_process() -> None:
    code = (
        "import json,sys; from kvproto.keys import ChunkLayout, chunk_keys; "
        "a=json.loads(sys.stdin.read()); "
        "L=ChunkLayout('meta-llama/Llama-3.1-8B','bfloat16',32,8,128); "
        "print(json.dumps([k.hex() for k in chunk_keys(a['t'], salt=bytes.fromhex(a['s']), "
        "layout_id=L.layout_id)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps({"t": TOKENS, "s": SALT.hex()}),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert [bytes.fromhex(k) for k in json.loads(out.stdout)] == _keys()


def test_salt_and_layout_change_every_key() -> None:
    base = _keys()
    other_salt = _keys(salt=bytes(32))
    other_layout = _keys(layout=ChunkLayout(LAYOUT.model_id, "float16", 32, 8, 128))
    assert not set(base) & set(other_salt)
    assert not set(base) & set(other_layout)


def test_changed_token_changes_its_key_and_later_keys_only() -> None:
    tokens = list(TOKENS)
    tokens[300] += 1  # inside chunk 1
    changed = _keys(tokens)
    base = _keys()
    assert changed[0] == base[0]
    assert changed[1] != base[1]
    assert changed[2] != base[2]


def test_token_change_in_tail_changes_nothing() -> None:
    tokens = list(TOKENS)
    tokens[999] += 1
    assert _keys(tokens) == _keys()


@pytest.mark.parametrize(
    "tokens, message",
    [([-1] * 256, "outside"), ([1 << 32] * 256, "outside"), ([0.5] * 256, "integers")],
)
def test_bad_tokens_rejected(tokens: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _keys(tokens)


def test_short_salt_rejected() -> None:
    with pytest.raises(ValueError, match=r"salt must be 16\.\.64 bytes"):
        _keys(salt=b"short")


def test_bad_layout_id_rejected() -> None:
    with pytest.raises(ValueError, match="layout_id"):
        chunk_keys(TOKENS, salt=SALT, layout_id=b"x" * 8)
