"""MkDocs hooks (``hooks:`` in mkdocs.yml): the pages made at build time.

- ``reference/cli.md``: the CLI reference, from the Typer app itself (typer's own Markdown
  renderer), so every command and option is there the moment it exists;
- ``reference/openapi.json`` and ``reference/openapi.md``: the daemon's OpenAPI schema, as
  ``shmcache api-docs`` prints it, and a table of its operations;
- ``architecture.md``, ``security.md``, ``benchmarks.md``: ARCHITECTURE.md, SECURITY.md and
  BENCHMARKS.md of the repository (one source for GitHub and the site), their links
  rewritten for the site.

Nothing is written into docs/: the pages are added to MkDocs' file list in memory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["cli_markdown", "on_files", "openapi_markdown", "site_markdown"]

REPO = Path(__file__).resolve().parents[1]
ROOT_PAGES = {
    "architecture.md": "ARCHITECTURE.md",
    "security.md": "SECURITY.md",
    "benchmarks.md": "BENCHMARKS.md",
}
"""Site page -> the repository's top-level document it shows."""
_SITE_NAME = {source: page for page, source in ROOT_PAGES.items()}
_LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?P<anchor>#[^)\s]*)?\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)*\1")
_LONE_STAR = re.compile(r"(?<!\*)\*(?!\*)")  # a glob's: "**Usage**:" headings stay bold


def site_markdown(text: str) -> str:
    """A top-level document's Markdown with links that work on the site: ``docs/x.png`` ->
    ``x.png``, ``SECURITY.md`` -> ``security.md``."""

    def link(match: re.Match[str]) -> str:
        target, anchor = match["target"], match["anchor"] or ""
        if target.startswith("docs/"):
            target = target.removeprefix("docs/")
        target = _SITE_NAME.get(target, target)
        return f"]({target}{anchor})"

    return _LINK.sub(link, text)


def _escape_html(line: str) -> str:
    """``<`` and ``>`` outside code spans as entities (help texts say ``shmcache-<uid>``),
    and ``*`` as itself (globs: ``'data/*.npy'``), past a list item's leading ``* ``."""
    bullet = re.match(r"\s*\* ", line)
    start = bullet.end() if bullet else 0
    pieces, last = [line[:start]], start

    def plain(text: str) -> str:
        return _LONE_STAR.sub(r"\\*", text.replace("<", "&lt;").replace(">", "&gt;"))

    for span in _CODE_SPAN.finditer(line, start):
        pieces.append(plain(line[last : span.start()]))
        pieces.append(span.group(0))
        last = span.end()
    pieces.append(plain(line[last:]))
    return "".join(pieces)


def cli_markdown() -> str:
    """The ``shmcache`` command's reference: every command, argument and option, with help."""
    import typer
    from typer.cli import get_docs_for_click

    from shmcache.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="shmcache", title="CLI reference")
    lines, fenced = [], False
    for line in text.strip().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            line = _escape_html(line.replace("\\[", "["))
        lines.append(line)
    intro = (
        "Generated from the Typer app at every build of this site (`scripts/docs_hooks.py`); "
        "`shmcache COMMAND --help` prints the same. The [command-line guide](../command-line.md) "
        "explains the commands with examples."
    )
    return lines[0] + "\n\n" + intro + "\n\n" + "\n".join(lines[1:]) + "\n"


def openapi_markdown(schema: dict[str, Any]) -> str:
    """A page listing the schema's operations, with the schema itself linked."""
    rows = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            statuses = ", ".join(sorted(operation.get("responses", {})))
            summary = operation.get("summary", "").replace("|", "\\|")
            rows.append(f"| `{method.upper()} {path}` | {summary} | {statuses} |")
    return (
        "# OpenAPI schema\n\n"
        f"The daemon's API, version {schema['info'].get('version', '')}: "
        "[openapi.json](openapi.json) is the schema that `GET /openapi.json` serves and "
        "`shmcache api-docs` prints (generated at every build of this site). The "
        "[HTTP API guide](../http-api.md) explains each request and every error status.\n\n"
        "| operation | summary | statuses |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """Add the generated pages to the site's files."""
    from mkdocs.structure.files import File
    from shmcache.service.app import openapi_schema

    for page, source in ROOT_PAGES.items():
        text = site_markdown((REPO / source).read_text(encoding="utf-8"))
        files.append(File.generated(config, page, content=text))
    files.append(File.generated(config, "reference/cli.md", content=cli_markdown()))
    schema = openapi_schema()
    files.append(
        File.generated(config, "reference/openapi.json", content=json.dumps(schema, indent=2) + "\n")
    )
    files.append(File.generated(config, "reference/openapi.md", content=openapi_markdown(schema)))
    return files
