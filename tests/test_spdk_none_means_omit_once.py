"""SPDK's "None means omit" is decided in one place (spdk_plugins/_omit.py): the RPC client and
the plan/boot-config calls each had their own copy, so a change to what is sent (0, False, "")
could reach one and not the other."""

from __future__ import annotations

import ast
from pathlib import Path

from spdk_plugins._omit import omit_none
from spdk_plugins.calls import call

SPDK_PLUGINS = Path(__file__).resolve().parents[1] / "spdk_plugins"


def test_none_is_left_out_and_falsy_values_are_sent() -> None:
    assert omit_none(a=None, b=0, c=False, d="", e=[]) == {"b": 0, "c": False, "d": "", "e": []}
    assert call("m", a=None, b=0) == ("m", {"b": 0})


def test_no_other_none_filter_in_spdk_plugins() -> None:
    """A `{k: v ... if v is not None}` comprehension anywhere else is a second copy."""
    copies = []
    for path in sorted(SPDK_PLUGINS.rglob("*.py")):
        if path.name == "_omit.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.DictComp):
                for gen in node.generators:
                    for cond in gen.ifs:
                        if (
                            isinstance(cond, ast.Compare)
                            and isinstance(cond.ops[0], ast.IsNot)
                            and isinstance(cond.comparators[0], ast.Constant)
                            and cond.comparators[0].value is None
                        ):
                            copies.append(f"{path.name}:{node.lineno}")
    assert not copies, copies
