"""Comments in runtime code say why, not when: no reference to a work session, a stop or an
issue number (they mean nothing to a reader of the code, and the reason they stood for was
lost with them). Lab results belong in docs/, with a one-line pointer in the code."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("dpu_agent", "host_shim", "kvproto", "spdk_plugins")
ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
WHEN = re.compile(
    rf"\b(?:issue|session|stop)s?\s*#?\d+|\(issue\b|#\d{{2,}}\b|\b{ORDINAL}\s+session\b",
    re.IGNORECASE,
)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))
        ):
            out.append((tok.start[0], tok.string))
    return out


def test_no_comment_cites_a_session_stop_or_issue() -> None:
    found = []
    for pkg in RUNTIME:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for line, text in _comments_and_docstrings(path.read_text()):
                for m in WHEN.finditer(text):
                    found.append(f"{rel}:{line}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_must_and_spares_protocol_words() -> None:
    for bad in ("(issue 9)", "issue 14", "# fixed in session 3", "stop 2", "the seventh session"):
        assert WHEN.search(bad), bad
    for ok in ("this session's tenant", "a stop request", "keys are issued", "#0x10"):
        assert not WHEN.search(ok), ok
