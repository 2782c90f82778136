"""A team daemon serves at most 64 writes at once, 16 per member: a member holding many
connections (a grid search of theirs, or a stuck process) leaves the others room, and a
write beyond the limit waits for its turn instead of failing.

Real users and groups, a trusted teams file (``tests/team_helpers.py``); skipped where
users cannot be made. Children import nothing new: what they run is imported here.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from team_helpers import Team, TeamDaemon, as_user, forked_as, team_in_env

import shmcache
from shmcache._store.fd_messages import FDS_SOCKET


@pytest.fixture(scope="module")
def team() -> Iterator[Team]:
    with team_in_env() as made:
        daemon = TeamDaemon(made, made.service).wait_ready()
        try:
            yield made
        finally:
            assert daemon.stop() == 0


def _holder(root: str, count: int) -> Callable[[int, int], None]:
    """Connect ``count`` times to the daemon's write socket, say how many connections it
    kept (a refused one has its answer waiting and is closed), hold them until released."""

    def work(report: int, hold: int) -> None:
        conns = []
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(f"{root}/{FDS_SOCKET}")
            conns.append(sock)
        time.sleep(1.0)  # the daemon accepts (or refuses) each by now
        readable, _, _ = select.select(conns, [], [], 0)
        os.write(report, f"{count - len(readable)}\n".encode())
        os.read(hold, 1)

    return work


def _put(team: str, key: str) -> int | None:
    return shmcache.put_array(key, np.arange(1000), team=team, overwrite=True).owner_uid


def _putter(team: str, key: str) -> Callable[[int, int], None]:
    def work(report: int, hold: int) -> None:
        try:
            outcome = f"ok {_put(team, key)}"
        except Exception as exc:
            outcome = f"failed {type(exc).__name__}: {exc}"
        os.write(report, outcome.encode())

    return work


def test_a_member_holding_many_connections_leaves_the_others_room_and_their_own_writes_wait(
    team: Team,
) -> None:
    holder, holder_report, release = forked_as(team.a, _holder(str(team.root), 64))
    putter = None
    try:
        kept = int(os.read(holder_report, 64).decode())
        assert kept == 16, kept  # a member's share of the daemon's 64 sessions
        assert as_user(team.b, _put, team.name, "b/x") == team.b.uid  # another member: room

        others = (release, holder_report)  # the putter must not hold the holder's release end
        putter, putter_report, _ = forked_as(team.a, _putter(team.name, "a/x"), close=others)
        time.sleep(1.0)
        waiting, _, _ = select.select([putter_report], [], [], 0)
        assert not waiting, os.read(putter_report, 4096)  # no refusal: it waits for its turn
    finally:
        os.close(release)
        os.waitpid(holder, 0)
    if putter is not None:
        assert os.read(putter_report, 4096).decode() == f"ok {team.a.uid}"
        os.waitpid(putter, 0)
    assert shmcache.open_array("a/x", team=team.name)[:3].tolist() == [0, 1, 2]
