"""The docs that say they hold everything do: docs/examples/agent.toml has every key of the
configuration schema (it said so and lacked 11), and the README's Debian package list is the one
scripts/install-system-deps.sh installs."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from dpu_agent.config import _SECTIONS, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "agent.toml"


def test_example_config_holds_every_key_of_the_schema() -> None:
    doc = tomllib.loads(EXAMPLE.read_text())
    schema = {f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
    example = {f"{s}.{k}" for s, keys in doc.items() if s in _SECTIONS for k in keys}
    assert not schema - example, f"missing from {EXAMPLE.name}: {sorted(schema - example)}"
    assert not example - schema, f"not in the schema: {sorted(example - schema)}"
    load_config(str(EXAMPLE))  # and it loads


def test_example_values_are_the_defaults_except_node_name() -> None:
    doc = tomllib.loads(EXAMPLE.read_text())
    cfg, default = load_config(str(EXAMPLE)), load_config(None)
    for section in _SECTIONS:
        for f in dataclasses.fields(_SECTIONS[section]):
            if f.name == "node_name":  # the hostname by default; the example names one
                continue
            got = getattr(getattr(cfg, section), f.name)
            assert got == getattr(getattr(default, section), f.name), (section, f.name, got)
    assert doc["agent"]["node_name"]


def test_readme_debian_packages_are_the_install_scripts() -> None:
    script = (ROOT / "scripts" / "install-system-deps.sh").read_text()
    pkgs = re.search(r"^PKGS=\(([^)]*)\)", script, re.M)
    assert pkgs is not None
    readme = (ROOT / "README.md").read_text()
    para = readme[readme.index("Debian packages (") : readme.index("install-system-deps.sh`)")]
    listed = re.findall(r"`([a-z0-9.+-]+)`", para)
    assert listed == pkgs.group(1).split()
