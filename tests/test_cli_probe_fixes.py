"""What a user on a shared server met with the CLI: another user's root given as ``--root``
(or ``$SHMCACHE_ROOT``) is the core's clear refusal, not a usage error; ``shmcache demo``
fails with a one-line message, never a traceback; suggested commands exist.

The other-user cases run as a real second user (``useradd``; skipped where users cannot be
made), the CLI in a forked child that drops to that user.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import CLI, cli
from service_helpers import clean_env
from team_helpers import User, as_user, made_users
from typer.testing import CliRunner

from shmcache._cli.app import app
from shmcache._disk.layout import ENV_ROOT, ENV_TEAM, SHM_DIR

RUNNER = CliRunner()
_HANG_S = 60


@pytest.fixture(scope="module")
def stranger() -> Iterator[User]:
    with made_users("probe") as users:
        yield users["probe"]


@pytest.fixture
def private_root() -> Iterator[Path]:
    """A root another user (this test's account) keeps private: 0700."""
    path = Path(SHM_DIR) / f"shmcache-test-private-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _cli_as(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """The CLI in this (forked, dropped) process; killed by SIGALRM if it hangs."""
    signal.alarm(_HANG_S)
    try:
        result = RUNNER.invoke(app, list(args), env=env)
    finally:
        signal.alarm(0)
    return result.exit_code, result.output


def _import_serve(root: Path) -> None:
    """What ``serve`` imports on demand, imported before a child drops to another user
    (its settings refused: nothing is served)."""
    import shmcache.service.server  # noqa: F401

    RUNNER.invoke(app, ["serve", "--root", str(root), "--port", "1"])


@pytest.mark.parametrize(
    "command",
    [["ls"], ["stats"], ["doctor"], ["evict", "k"], ["demo", "--rows", "10"], ["cleanup"], ["budget"]],
)
def test_another_users_root_is_refused_by_the_core_not_called_unreadable(
    stranger: User, private_root: Path, command: list[str], root: Path
) -> None:
    RUNNER.invoke(app, [*command, "--root", str(root)])  # imports what the child needs (see as_user)
    for args, env in (
        ([*command, "--root", str(private_root)], None),
        (command, {ENV_ROOT: str(private_root)}),
    ):
        code, out = as_user(stranger, _cli_as, args, env)
        assert code == 1, (args, out)
        assert "Invalid value" not in out and "not readable" not in out and "Traceback" not in out, out
        assert "belongs to uid 0" in out, out


def test_serve_on_another_users_root_is_refused_by_the_core(
    stranger: User, private_root: Path, root: Path
) -> None:
    _import_serve(root)
    code, out = as_user(stranger, _cli_as, ["serve", "--root", str(private_root)])
    assert code == 1 and "Invalid value" not in out and "belongs to uid 0" in out, out


# ---------------------------------------------------------------------- demo


def test_demo_rows_below_one_is_a_usage_error(root: Path) -> None:
    for rows in ("0", "-5"):
        code, _, err = cli("demo", "--root", str(root), "--rows", rows)
        assert code == 2 and "--rows" in err and "Traceback" not in err, err


def test_demo_on_a_root_that_is_a_file_fails_with_one_line(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    done = subprocess.run(
        [*CLI, "demo", "--root", str(not_a_dir), "--rows", "10"],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and str(not_a_dir) in done.stderr, done.stderr


def test_demo_on_a_full_root_fails_with_one_line(root: Path) -> None:
    code, _, _ = cli("budget", "set", "64KiB", "--root", str(root), "--local")
    assert code == 0
    done = subprocess.run(
        [*CLI, "demo", "--root", str(root), "--rows", "100000"],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.search(r"^error: .*budget", done.stderr), done.stderr
    assert not os.path.exists(root / "demo")


def test_demo_with_an_unknown_team_exported_fails_with_one_line() -> None:
    code, _, err = cli("demo", "--rows", "10", env={"SHMCACHE_TEAM": "no-such-team", ENV_ROOT: ""})
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err, err


# ---------------------------------------------------------------------- --root vs $SHMCACHE_TEAM


def test_an_explicit_root_wins_over_the_exported_team(root: Path) -> None:
    env = {ENV_TEAM: "no-such-team", ENV_ROOT: ""}
    code, out, err = cli("ls", "--root", str(root), env=env)
    assert code == 0 and "KEY" in out, err
    code, out, err = cli("budget", "--root", str(root), "set", "1MiB", "--local", env=env)
    assert code == 0 and "1.0 MiB" in out, err
    code, _, err = cli("ls", env=env)  # without --root, the exported team is the root
    assert code == 1 and "teams file" in err, err


def test_an_explicit_team_with_a_root_and_both_variables_stay_refused(root: Path) -> None:
    code, _, err = cli("--team", "no-such-team", "ls", "--root", str(root), env={ENV_ROOT: ""})
    assert code == 2 and "not both" in err, err  # usage errors
    code, _, err = cli("put", "/etc/hostname", "--key", "k", "--team", "x", "--root", str(root))
    assert code == 2 and "not both" in err, err
    code, _, err = cli("ls", env={ENV_TEAM: "no-such-team", ENV_ROOT: str(root)})
    assert code == 1 and f"both {ENV_ROOT} and {ENV_TEAM}" in err, err


def test_fixes_said_to_a_team_member_name_the_team() -> None:
    from shmcache._team.commands import for_team

    text = ("Evict some (`shmcache evict KEY`) or raise the budget (`shmcache budget set SIZE`); "
            "shmcache ls / evict unused entries; `shmcache serve --team vision`, shmcache.put_array, "
            "`shmcache --team vision ls`, `shmcache put PATH --key KEY --team NAME`")
    assert for_team(text, "vision") == (
        "Evict some (`shmcache --team vision evict KEY`) or raise the budget (`shmcache --team vision "
        "budget set SIZE`); shmcache --team vision ls / evict unused entries; `shmcache serve --team "
        "vision`, shmcache.put_array, `shmcache --team vision ls`, `shmcache put PATH --key KEY --team NAME`"
    )
    assert for_team(text, None) == text


# ---------------------------------------------------------------------- the guide vs --help


def _guide_rows() -> dict[str, str]:
    """docs/command-line.md's table: the first cell of each ``shmcache COMMAND`` row."""
    guide = Path(__file__).resolve().parents[1] / "docs" / "command-line.md"
    rows = {}
    for line in guide.read_text().splitlines():
        if line.startswith("| `shmcache "):
            cell = re.split(r"(?<!\\)\|", line)[1]
            rows[cell.split()[1].strip("`")] = cell
    return rows


def test_the_command_line_guide_lists_every_command_and_option() -> None:
    import typer

    command = typer.main.get_command(app)
    rows = _guide_rows()
    for name, sub in command.commands.items():  # type: ignore[attr-defined]
        assert name in rows, f"docs/command-line.md has no row for `shmcache {name}`"
        flags = {o for p in sub.params for o in getattr(p, "opts", ()) if o.startswith("--")}
        missing = sorted(flags - {"--help", "--root", "--local"} - set(re.findall(r"--[\w-]+", rows[name])))
        assert not missing, f"`shmcache {name}` row of docs/command-line.md lacks {missing}"


def test_the_guide_shows_the_columns_ls_prints(root: Path) -> None:
    code, out, _ = cli("ls", "--root", str(root))
    header = " ".join(out.splitlines()[0].split())
    guide = (Path(__file__).resolve().parents[1] / "docs" / "command-line.md").read_text()
    assert code == 0 and f"# {header}" in guide, header
    described = next(line for line in guide.splitlines() if line.startswith("| `shmcache ls"))
    assert "size, owner (who loaded it), pinned" in described, described


@pytest.mark.parametrize(
    "args",
    [
        ["--team", "vision", "--root", "{root}", "ls"],
        ["--team", "vision", "ls", "--root", "{root}"],
        ["--root", "{root}", "--team", "vision", "stats"],
    ],
)
def test_root_and_team_together_is_a_usage_error_in_flags(tmp_path: Path, args: list[str]) -> None:
    root = tmp_path / "never-made"
    code, _, err = cli(*(a.format(root=root) for a in args))
    assert code == 2
    assert err.strip() == (
        "error: pass --root or --team, not both: a team's root comes from the administrator's "
        "teams file (shmcache --team NAME COMMAND works on it)"
    )
    assert "PosixPath" not in err and not root.exists()
