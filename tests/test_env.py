"""The environment-variable registry (tokenspeed_worker/env.py): the only place the package reads
TOKENSPEED_* variables, each documented in docs/operations.md, with errors that name the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenspeed_worker import env

REPO = Path(__file__).resolve().parent.parent


def test_every_variable_is_documented_and_nothing_else_is():
    text = (REPO / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"`(TOKENSPEED_[A-Z0-9_]+)`", text))
    assert documented == {var.name for var in env.ALL}


def test_the_package_reads_tokenspeed_variables_only_through_the_registry():
    readers = []
    for path in (REPO / "tokenspeed_worker").rglob("*.py"):
        if path.name == "env.py" or "proto" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*[\"']TOKENSPEED_", line):
                readers.append(f"{path.relative_to(REPO)}:{number}")
    assert readers == []


def test_unset_or_empty_is_the_default_and_bad_text_names_the_variable(monkeypatch):
    monkeypatch.delenv(env.OVERLAP_SCHEDULE.name, raising=False)
    assert env.OVERLAP_SCHEDULE.get() is None
    monkeypatch.setenv(env.OVERLAP_SCHEDULE.name, " ")
    assert env.OVERLAP_SCHEDULE.get() is None
    monkeypatch.setenv(env.OVERLAP_SCHEDULE.name, "off")
    assert env.OVERLAP_SCHEDULE.get() is False
    monkeypatch.setenv(env.DIST_TIMEOUT_S.name, "2.5")
    assert env.DIST_TIMEOUT_S.get() == 2.5
    monkeypatch.setenv(env.OVERLAP_SCHEDULE.name, "maybe")
    with pytest.raises(ValueError, match="TOKENSPEED_OVERLAP_SCHEDULE"):
        env.OVERLAP_SCHEDULE.get()
