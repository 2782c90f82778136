"""Who holds a lock we wait for, and whether it can still let go: the holder's pid comes
from the kernel (``F_GETLK``), its name and state from ``/proc/<pid>/stat``; a wait gives
up, with a message that names the holder and the fix, once the holder has been stopped
(SIGSTOP, Ctrl+Z, a debugger) for :data:`STOPPED_GRACE_S` or the wait's bound has passed."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ..errors import LockTimeoutError

__all__ = ["STOPPED_GRACE_S", "Holder", "LockWait", "holder"]

logger = logging.getLogger(__name__)

STOPPED_GRACE_S = 3.0
"""How long a holder must stay stopped before its waiters give up: long enough for a
``kill -STOP``/``kill -CONT`` pair or a shell's ``bg`` after Ctrl+Z, short enough that a
forgotten Ctrl+Z is named at once."""

_STATES = {
    "R": "running",
    "S": "running (sleeping)",
    "I": "running (idle)",
    "D": "in uninterruptible sleep (D: blocked in the kernel, often on a hung file system)",
    "T": "stopped (by SIGSTOP or Ctrl+Z)",
    "t": "stopped by a debugger or tracer",
    "Z": "exiting",
    "X": "exiting",
    "": "in a state this process may not read (/proc mounted with hidepid, or it just exited)",
}


@dataclass(frozen=True)
class Holder:
    """A process holding a lock, as seen now."""

    pid: int
    """0 when the holder is not visible from here (another PID namespace: a container)."""
    name: str
    state: str
    """The state letter of ``/proc/<pid>/stat`` ("" if unknown)."""

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def describe(self) -> str:
        if self.pid == 0:
            return "a process outside this one's PID namespace (e.g. in another container)"
        what = _STATES.get(self.state, f"in state {self.state}")
        return f"process {self.pid} ({self.name or '?'}), {what}"


def holder(pid: int) -> Holder:
    """What ``/proc`` says of ``pid`` now (state "" when it cannot be read)."""
    if pid <= 0:
        return Holder(0, "", "")
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            stat = fp.read().decode("utf-8", "replace")
    except OSError:
        return Holder(pid, "", "")
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    return Holder(pid, name, state)


class LockWait:
    """One wait for one lock: its bound (``timeout`` seconds, None for none) and what it
    has seen of the holder. :meth:`check` raises :class:`LockTimeoutError` when the wait
    should end; ``what`` names the lock in messages ("the lock of key 'k'")."""

    def __init__(self, timeout: float | None, what: str) -> None:
        self.timeout = timeout
        self.what = what
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self._stopped: tuple[int, float] | None = None  # (pid, seen stopped since)
        self._warned = False

    def left(self) -> float | None:
        """Seconds left before the bound (None: no bound)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def check(self, pid: int) -> None:
        """The lock is held by ``pid`` (0: not visible): raise if the wait should end."""
        now = time.monotonic()
        seen = holder(pid)
        if not seen.stopped:
            self._stopped = None
        elif self._stopped is None or self._stopped[0] != pid:
            self._stopped = (pid, now)
        if self._stopped is not None:
            stopped_for = now - self._stopped[1]
            if self.timeout is None:
                if not self._warned and stopped_for >= STOPPED_GRACE_S:
                    self._warned = True
                    logger.warning(
                        "waiting without a bound (lock_timeout=None) for %s, held by %s; resume it "
                        "with `kill -CONT %d`",
                        self.what,
                        seen.describe(),
                        pid,
                    )
            elif stopped_for >= STOPPED_GRACE_S or (self.deadline is not None and now >= self.deadline):
                raise LockTimeoutError(
                    f"gave up waiting for {self.what}: it is held by {seen.describe()} for "
                    f"{stopped_for:.0f} s now, which cannot release it until it runs again; "
                    f"resume it with `kill -CONT {pid}` (or `fg` in its shell), or end it "
                    f"(`kill {pid}`: the kernel releases its locks when it exits)"
                )
        if self.deadline is not None and now >= self.deadline:
            raise LockTimeoutError(
                f"gave up after {self.timeout:g} s waiting for {self.what}, held by "
                f"{seen.describe()}; it may be a long load or put: wait longer with a larger "
                "lock_timeout (timeout= for cache(); None waits as long as it takes), or see "
                f"what that process is doing"
            )

    def give_up_on_thread(self) -> LockTimeoutError:
        """The error when another thread of this process holds the lock past the bound."""
        return LockTimeoutError(
            f"gave up after {self.timeout:g} s waiting for {self.what}, held by another thread "
            f"of this process ({os.getpid()}); wait longer with a larger lock_timeout (timeout= "
            "for cache(); None waits as long as it takes)"
        )
