"""Whether a cache root may be used: a real directory of this user that no one else can
write to.

The default root ``/dev/shm/shmcache-<uid>`` is a predictable name in a world-writable
directory: another local user can create it first (a directory of theirs, or a symlink
to one) and fill it with entries of their choosing, or truncate a file the victim maps
(SIGBUS). So reads refuse such a root just as writes do. ``check_root`` costs one
``lstat``: readers call it once per root directory (they keep its inode), never on the
warm path.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

from ..errors import CacheRootError

__all__ = ["check_root", "describe_uid", "refuse_untrusted", "untrusted_reason"]

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_ELSEWHERE = "pick another root with root= or SHMCACHE_ROOT (--root)"


def describe_uid(uid: int) -> str:
    """``uid 1001 (mallory)``, or ``uid 1001`` without a passwd entry."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def untrusted_reason(
    path: str | os.PathLike[str], st: os.stat_result, owner: tuple[int, int] | None = None
) -> tuple[str, str] | None:
    """Why the directory at ``path`` (``st`` from ``lstat``) must not be used, and the fix;
    None if it is ours to use. ``owner``: the ``(uid, gid)`` a team root must have (from
    the administrator's teams file) instead of ours."""
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return (
            f"{path} is a symlink (to {target}, made by {describe_uid(st.st_uid)}); shmcache never "
            "follows a link as its root, since anyone can plant one in /dev/shm",
            f"use the real path {os.path.realpath(path)} if it is yours, else remove the link "
            f"(rm {path}) or {_ELSEWHERE}",
        )
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} exists but is not a directory", f"remove it or {_ELSEWHERE}"
    if owner is not None:
        return _team_reason(path, st, owner)
    me = os.geteuid()
    if st.st_uid != me:  # root included: a root-owned process must not read planted data either
        return (
            f"{path} belongs to {describe_uid(st.st_uid)}, not to you ({describe_uid(me)}); another "
            "user may have planted it to feed you their data",
            f"{_ELSEWHERE}, or have {describe_uid(st.st_uid)} or root remove it (rm -rf {path})",
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & _WRITABLE_BY_OTHERS:
        return (
            f"{path} is mode {mode:04o}: other users can write to it and plant entries",
            f"chmod go-w {path} (shmcache makes its directories 0700)",
        )
    return None


def _team_reason(
    path: str | os.PathLike[str], st: os.stat_result, owner: tuple[int, int]
) -> tuple[str, str] | None:
    uid, gid = owner
    fix = "ask the team's administrator: `shmcache serve --team NAME` run as the service account creates it"
    if st.st_uid != uid:
        return (
            f"{path} belongs to {describe_uid(st.st_uid)}, not to the team's service account "
            f"({describe_uid(uid)}); someone may have planted it to feed the team their data",
            f"have root remove it (rm -rf {path}), then {fix}",
        )
    if st.st_gid != gid:
        return f"{path} has group {_describe_gid(st.st_gid)}, not the team's ({_describe_gid(gid)})", fix
    mode = stat.S_IMODE(st.st_mode)
    if mode & _WRITABLE_BY_OTHERS:
        return (
            f"{path} is mode {mode:04o}: users other than the service account can write to it",
            f"chmod 0750 {path} (shmcache makes a team's directories 0750)",
        )
    return None


def _describe_gid(gid: int) -> str:
    try:
        return f"gid {gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return f"gid {gid}"


def refuse_untrusted(
    path: str | os.PathLike[str],
    st: os.stat_result,
    what: str = "cache root",
    owner: tuple[int, int] | None = None,
) -> None:
    """Raise :class:`CacheRootError` (problem and fix) unless ``path`` is ours (or the
    team's, for ``owner``) to use."""
    reason = untrusted_reason(path, st, owner)
    if reason is not None:
        raise CacheRootError(f"{what} {reason[0]}: {reason[1]}")


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_root(root: str, owner: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``root`` if it is ours (or, for ``owner``, that team
    account's) to read; None if it does not exist yet (nothing to read); raises
    :class:`CacheRootError` otherwise."""
    try:
        st = os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # e.g. a parent directory another user keeps private
        raise CacheRootError(
            f"cannot reach cache root {root}: {exc.strerror}; it is not yours to use: {_ELSEWHERE}"
        ) from exc
    refuse_untrusted(root, st, owner=owner)
    if owner is not None and not os.access(root, os.R_OK | os.X_OK):
        group, user = _group_name(owner[1]), _user_name(os.getuid())
        raise CacheRootError(
            f"cannot read team root {root}: {user} is not in its group {group}; ask an "
            f"administrator to add you (usermod -aG {group} {user}), then log in again"
        )
    return st.st_dev, st.st_ino
