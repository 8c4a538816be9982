"""Process identity from /proc: a pid plus its start time names one process for good.

A pid alone is reused by the kernel; the start time (clock ticks after boot,
field 22 of /proc/PID/stat) tells a reused pid from the process that claimed
a key. A zombie is dead for our purposes: it will never complete anything.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that holds a key, a lease or an effect: pid plus start time, so a
    reused pid is not it."""

    pid: int
    start: int


@dataclass(frozen=True, slots=True)
class RemoteHolder(Holder):
    """A process of another box (daemon ``box``) on a store several boxes share. Nobody
    checks a pid of another box: it counts as alive while its box is present, and when
    that box's presence lapses, a live box settles everything it held
    (daemon/store/presence.py). Never equal to a local Holder with the same pid."""

    box: str


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connecting process's pid, uid and gid, as the kernel recorded them at connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return PeerCredentials(*_PEERCRED.unpack(raw))


class LivenessUnknown(OSError):
    """/proc could not be read (out of file descriptors, say): the process may be
    alive. Never a reason to call it dead."""


def _stat_fields(pid: int) -> list[str] | None:
    """The fields after the command name, or None when there is no such process.
    Raises ``LivenessUnknown`` when /proc cannot tell (EMFILE, ENFILE, EACCES...)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        raise LivenessUnknown(exc.errno, f"cannot read /proc/{pid}/stat: {exc.strerror}") from None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return data[data.rindex(b")") + 2 :].decode("ascii", "replace").split()


def process_start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process, or None if there is none; raises
    ``LivenessUnknown`` when /proc cannot tell."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])


def holder_of(pid: int) -> Holder | None:
    """The live process ``pid`` as a holder; raises ``LivenessUnknown`` when /proc cannot
    tell (the caller refuses what needed it, rather than guess)."""
    start = process_start_time(pid)
    return None if start is None else Holder(pid, start)


def is_alive(holder: Holder) -> bool:
    """False only on evidence that the process is gone (no such pid, a zombie, another
    start time); a holder whose liveness cannot be read counts as alive, and so does
    another box's process (see RemoteHolder)."""
    if isinstance(holder, RemoteHolder):
        return True
    try:
        return process_start_time(holder.pid) == holder.start
    except LivenessUnknown:
        return True


@dataclass(frozen=True)
class Carriers:
    """What :func:`carried_values` found."""

    values: dict[str, int]  # each value of the variable -> one pid carrying it
    # Processes of this daemon's own user whose environment it may not read (a setuid or
    # setgid program, one that made itself non-dumpable): any may carry any value.
    unreadable: list[Holder]

    def may_carry(self, value: str, started_from: int | None) -> tuple[str, int] | None:
        """(why, pid) if a process carries ``value`` or may: one of ``unreadable`` that
        started at or after ``started_from`` (the start time of the process that set the
        value: what it started began later), with None any of them; else None."""
        if (pid := self.values.get(value)) is not None:
            return "command_running", pid
        for holder in self.unreadable:
            if started_from is None or holder.start >= started_from:
                return "command_may_run", holder.pid
        return None


def carried_values(variable: str) -> Carriers:
    """Each value of ``variable`` in a live process's environment, and the processes of
    this user whose environment cannot be read.

    Why: a command towerctl ran outlives it when towerctl is killed, and so do the
    commands it started (a script's own steps); the environment is what all of them
    inherit. Only processes whose environment this daemon may read are seen (its own
    user's, in its pid namespace); one that cleared or rewrote its environment is not.
    Its own user's processes it may not read are listed apart: taking them for "not
    running" let a probe say "not done" while a non-dumpable command still ran."""
    prefix = f"{variable}=".encode()
    found: dict[str, int] = {}
    unreadable: list[Holder] = []
    own = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                entries = environ.read().split(b"\0")
        except PermissionError:  # another user's, or ours made unreadable
            if (holder := _own_unreadable(int(name))) is not None:
                unreadable.append(holder)
            continue
        except OSError:  # gone, a zombie's
            continue
        for entry in entries:
            if entry.startswith(prefix):  # tokens: one per marked command it runs inside
                for token in entry[len(prefix) :].split():
                    found.setdefault(token.decode("utf-8", "replace"), int(name))
    return Carriers(found, unreadable)


def _own_unreadable(pid: int) -> Holder | None:
    """``pid`` as a holder if its real user is this process's (its /proc/PID/status says
    so: the files of a non-dumpable process are root's whoever runs it)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Uid:"):
                    if int(line.split()[1]) != os.getuid():
                        return None
                    break
        return holder_of(pid)
    except (OSError, ValueError, IndexError, LivenessUnknown):
        return None


MAX_LINEAGE = 4096  # ancestors walked at most (pid chains are short; this bounds a loop)


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def ancestors(pid: int) -> list[int]:
    """``pid``'s parent, its parent's parent, ... up to (not including) pid 1."""
    chain: list[int] = []
    current = parent_pid(pid)
    while current is not None and current > 1 and len(chain) < MAX_LINEAGE:
        chain.append(current)
        current = parent_pid(current)
    return chain


def may_hold_for(caller_pid: int, pid: int) -> bool:
    """Whether ``pid`` may hold a key that ``caller_pid`` claims: the caller itself, one
    of its ancestors, or a descendant of the caller or of the caller's parent (a shell
    passing ``$!`` to towerctl), of this daemon's uid, and never pid 1. A key held by an
    unrelated or long-lived process (init, another user's daemon) would never be settled
    by its holder's death: it would stay in progress for good."""
    if pid == caller_pid:
        return True
    if pid <= 1:
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
    except FileNotFoundError:
        return False
    lineage = ancestors(caller_pid)
    if pid in lineage:
        return True
    roots = {caller_pid, *lineage[:1]}  # the caller, and its parent unless that is pid 1
    return not roots.isdisjoint(ancestors(pid))
