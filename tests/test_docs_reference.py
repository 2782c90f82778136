"""The generated CLI reference page says what ``--help`` says: globs and ``<uid>`` literally."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from docs_hooks import cli_markdown


def test_globs_and_placeholders_in_help_are_not_markdown() -> None:
    page = cli_markdown()
    assert r"a quoted glob ('data/\*.npy')" in page and r"'shards/\*.tar'" in page
    assert "shmcache-&lt;uid&gt;" in page
    outside_code = re.sub(r"`[^`]*`", "", page).replace("\n* ", "\n")
    assert not re.search(r"(?<![\\*])\*(?![ *])", outside_code), "a lone * left unescaped"
    assert "**Usage**:" in page and r"\*\*Usage" not in page  # headings stay bold
    assert any(line.startswith("* `--root") for line in page.splitlines())  # list items stay items
