"""``towerctl run`` and ``towerctl effect run``: shell commands that run at most once.

For hooks and scripts that are not Python. ``towerctl run --key KEY -- CMD ...``
claims the idempotency key (holder: this towerctl process, which lives while CMD
runs; payload: CMD's argv, an argument that is not UTF-8 as its bytes, so another
command under the same key is an ``idempotency_conflict``), runs CMD with exactly the
bytes given, and completes the key with
``{"exit_status", "output_sha256"}``. ``towerctl effect run`` does the same through
the effects ledger: claim (with the target's lease for shared kinds), heartbeats
while CMD runs, then commit on exit 0 or fail otherwise.

CMD's stdin is inherited; its stdout and stderr go through pipes so they can be
hashed, and are copied to towerctl's as they come (with ``--json``, CMD's stdout
goes to towerctl's stderr, so stdout carries only the JSON result). Being pipes,
CMD sees no terminal there.

``output_sha256`` = SHA-256 of the two raw 32-byte SHA-256 digests of CMD's whole
stdout and of its whole stderr, in that order:
``sha256(sha256(stdout).digest() + sha256(stderr).digest()).hexdigest()``
(:func:`output_digest`). Each stream is hashed on its own, so the digest does not
depend on how the two interleaved.

While CMD runs, towerctl forwards SIGTERM and SIGHUP to it and ignores SIGINT and
SIGQUIT (CMD is in the same process group and gets those from the terminal itself),
then records CMD's exit; a CMD killed by signal N exits 128+N. Exit statuses are
in the module constants and documented in ``towerctl --help``.
"""

from __future__ import annotations

import os
import selectors  # CMD's pipes and its pidfd, in _pump
import signal
import sys

from towerd.client.cli.output import EXIT_UNAVAILABLE, UsageError, dumps_json, emit, say
from towerd.client.cli.output import is_utf8 as _is_utf8
from towerd.client.cli.output import json_arg as _json_arg
from towerd.client.cli.registry import call_timeout
from towerd.client.idempotent import EffectNotStarted, SyncDriver
from towerd.client.record import Record
from towerd.client.retry import FAIL_FAST, PATIENT, RetryPolicy
from towerd.client.sync import Client
from towerd.protocol.errors import (
    Conflict,
    EffectAlreadyCommitted,
    EffectInFlight,
    EffectLeaseHeld,
    EffectUncertain,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    OutcomeUnknown,
    TowerdError,
    Unavailable,
)

# What `towerctl run` imports is what every run of a hook's step pays: no subprocess
# (CMD is started with posix_spawnp), dataclasses, typing, shlex or hashlib's OpenSSL
# binding (~12 ms together); SHA-256 from the interpreter's own module when it has one.
try:
    from _sha256 import sha256 as _sha256  # CPython 3.11
except ImportError:  # pragma: no cover - other versions and interpreters
    try:
        from _sha2 import sha256 as _sha256  # CPython 3.12+
    except ImportError:
        from hashlib import sha256 as _sha256

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    import subprocess
    from collections.abc import Callable
    from typing import Any

EXIT_UNKNOWN = 120  # the outcome is unknown or uncertain: a person must decide, CMD not run
EXIT_BUSY = 121  # in progress, in flight or held elsewhere: retry later, CMD not run
EXIT_NOT_EXECUTABLE = 126  # CMD could not be executed: nothing ran, the key is released
EXIT_NOT_FOUND = 127  # CMD was not found: nothing ran, the key is released


# --- running CMD ----------------------------------------------------------------------------


def output_digest(stdout: bytes, stderr: bytes) -> str:
    """The ``output_sha256`` recorded for a command that wrote ``stdout`` and ``stderr``."""
    return _combine(_sha256(stdout), _sha256(stderr))


def _combine(stdout: Any, stderr: Any) -> str:
    return str(_sha256(stdout.digest() + stderr.digest()).hexdigest())


class Outcome(Record):
    __slots__ = ("exit_status", "output_sha256", "signal")
    exit_status: int  # 0..255; 128+N for a command killed by signal N
    output_sha256: str
    signal: int | None

    def __init__(self, exit_status: int, output_sha256: str, signal: int | None = None) -> None:
        object.__setattr__(self, "exit_status", exit_status)
        object.__setattr__(self, "output_sha256", output_sha256)
        object.__setattr__(self, "signal", signal)

    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "exit_status": self.exit_status,
            "output_sha256": self.output_sha256,
        }
        if self.signal is not None:
            result["signal"] = self.signal
        return result


def _die_with_parent(signum: int) -> Callable[[], None] | None:
    """A preexec function sending the child ``signum`` when towerctl dies (Linux
    PR_SET_PDEATHSIG), so a command run under a lease never outlives it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signum, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # towerctl died before the call took hold
            os.kill(os.getpid(), signum)

    return preexec


class Spawned:
    """CMD started with ``os.posix_spawnp`` (no subprocess module, no fork of towerctl):
    what :class:`Child` needs of a ``subprocess.Popen``, with its semantics. ``argv[0]``
    is looked up on PATH; it cannot be started: ``OSError`` (``FileNotFoundError``,
    ``PermissionError``, ...), nothing ran. As Popen does, the child gets SIGPIPE and
    SIGXFSZ at their defaults (Python ignores them) and none of towerctl's inheritable
    descriptors beyond 0, 1 and 2 (``close_fds``); ``capture``: its stdout and stderr
    are pipes, read through ``stdout_fd`` and ``stderr_fd``. One difference: glibc's
    posix_spawn leaves its two internal signals (32 and 33) ignored in the child, which
    glibc programs reinstall at start (tests/client/test_spawn.py)."""

    def __init__(self, argv: list[str], *, capture: bool) -> None:
        self.returncode: int | None = None
        self.stdout_fd = self.stderr_fd = -1
        actions: list[tuple[int, ...]] = []
        ours: list[int] = []
        try:
            if capture:
                self.stdout_fd, out_w = os.pipe()  # non-inheritable: closed at exec
                self.stderr_fd, err_w = os.pipe()
                ours = [out_w, err_w]
                actions += [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
            actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds()]
            self.pid = os.posix_spawnp(
                argv[0],
                argv,
                os.environ,
                file_actions=actions,
                setsigdef=_DEFAULT_IN_CHILD,
            )
        except BaseException:
            for fd in (self.stdout_fd, self.stderr_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in ours:
                os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _pid, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # never a reaped pid (it may be another process now)
            os.kill(self.pid, signum)


_DEFAULT_IN_CHILD = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)
)  # what subprocess's restore_signals resets


def _inheritable_fds() -> list[int]:
    """towerctl's descriptors above 2 that CMD would inherit (Popen's close_fds)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    fds = []
    for name in names:
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    fds.append(fd)
            except OSError:  # the listing's own descriptor, closed by now
                pass
    return fds


class Child:
    """CMD as towerctl's child. Raises ``OSError`` when it cannot be started (nothing ran).

    ``capture``: read its stdout and stderr through pipes, hash them and copy them to
    ``stdout_fd`` and fd 2. ``die_with_parent``: the signal CMD gets if towerctl dies
    (that needs subprocess's preexec_fn; without it CMD is started by :class:`Spawned`).
    Create it from the main thread, before starting any other (``preexec_fn``).
    """

    _FORWARDED = (signal.SIGTERM, signal.SIGHUP)
    _IGNORED = (signal.SIGINT, signal.SIGQUIT)

    def __init__(
        self,
        argv: list[str],
        *,
        capture: bool = False,
        stdout_fd: int = 1,
        die_with_parent: int | None = None,
    ) -> None:
        self._watchdog: Any = None
        self._stopped = False  # a stop was forwarded to CMD: what it started goes too
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: started with that descriptor closed (`>&-`)
                stream.flush()
        self._capture = capture
        self._stdout_fd = stdout_fd
        self.proc: Spawned | subprocess.Popen[bytes]
        self._pipes: tuple[int, int] | None = None
        if die_with_parent is None:
            spawned = Spawned(argv, capture=capture)
            self.proc = spawned
            if capture:
                self._pipes = (spawned.stdout_fd, spawned.stderr_fd)
        else:
            import subprocess

            from towerd.client.watchdog import Watchdog, add_mark

            # What CMD starts goes with towerctl too (client/watchdog.py).
            mark = f"child:{os.urandom(8).hex()}"
            add_mark(mark)
            self._watchdog = Watchdog(mark, die_with_parent)
            pipe = subprocess.PIPE if capture else None
            popen = subprocess.Popen(
                argv,
                stdout=pipe,
                stderr=pipe,
                bufsize=0,
                preexec_fn=_die_with_parent(die_with_parent),
            )
            self.proc = popen
            if capture:
                assert popen.stdout is not None and popen.stderr is not None
                self._pipes = (popen.stdout.fileno(), popen.stderr.fileno())
        self._saved: dict[int, Any] = {}
        try:
            for signum in self._FORWARDED:
                self._saved[signum] = signal.signal(signum, self._forward)
            for signum in self._IGNORED:
                # A Python handler, not SIG_IGN: an ignored disposition would be inherited
                # by commands CMD starts later.
                self._saved[signum] = signal.signal(signum, _ignore)
        except ValueError:  # not the main thread: leave signals alone
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _forward(self, signum: int, frame: Any) -> None:
        if self.proc.returncode is not None:
            # CMD has ended (reaped, the handlers not yet handed back): the signal is
            # towerctl's own, for the handler it had before (a stop deferred to the record).
            handler = self._saved.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:  # as if it had come once the handlers were back
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self._stopped = True
        try:
            self.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def wait(self) -> Outcome:
        """Copy and hash CMD's output until it exits; its outcome."""
        out, err = _sha256(), _sha256()
        try:
            if self._pipes is not None:
                stdout, stderr = self._pipes
                try:
                    _pump(self.proc, {stdout: (out, self._stdout_fd), stderr: (err, 2)})
                finally:
                    self._close_pipes()
            code = self.proc.wait()
            if self._watchdog is not None:
                # Stopped by a signal, CMD's shell is gone but a step it ran may not be:
                # the watchdog ends them before the lease goes (towerctl's caller
                # releases it after this), as when towerctl itself dies.
                self._watchdog.stand_down(end_the_rest=self._stopped)
        finally:
            for signum, handler in self._saved.items():
                signal.signal(signum, handler)
        if code < 0:
            return Outcome(128 - code, _combine(out, err), -code)
        return Outcome(code, _combine(out, err))

    def _close_pipes(self) -> None:
        if isinstance(self.proc, Spawned):
            for fd in (self.proc.stdout_fd, self.proc.stderr_fd):
                os.close(fd)
        else:
            assert self.proc.stdout is not None and self.proc.stderr is not None
            self.proc.stdout.close()
            self.proc.stderr.close()


def _ignore(_signum: int, _frame: Any) -> None:
    pass


def _pump(proc: Spawned | subprocess.Popen[bytes], streams: dict[int, tuple[Any, int]]) -> None:
    """Read each pipe until EOF, hashing it and copying it to its sink fd. Once CMD has
    exited, what it wrote is in the pipes: that is drained, and a process CMD left
    behind holding a pipe open does not keep towerctl waiting."""
    selector = selectors.DefaultSelector()
    dead_sinks: set[int] = set()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    pidfd = None
    try:
        pidfd = os.pidfd_open(proc.pid)
        selector.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pass  # no pidfd: poll for the exit instead
    try:
        exited = False
        while streams and not exited:
            for key, _events in selector.select(None if pidfd is not None else 0.05):
                if key.fd == pidfd:
                    exited = True
                elif not _copy(key.fd, streams, dead_sinks):
                    selector.unregister(key.fd)
                    del streams[key.fd]
            if pidfd is None and proc.poll() is not None:
                exited = True
        for fd in list(streams):
            os.set_blocking(fd, False)
            try:
                while _copy(fd, streams, dead_sinks):
                    pass
            except BlockingIOError:
                pass
    finally:
        selector.close()
        if pidfd is not None:
            os.close(pidfd)


def _copy(fd: int, streams: dict[int, tuple[Any, int]], dead_sinks: set[int]) -> bool:
    """One read from ``fd``; False at EOF."""
    data = os.read(fd, 65536)
    if not data:
        return False
    digest, sink = streams[fd]
    digest.update(data)
    if sink not in dead_sinks:
        try:
            _write_all(sink, data)
        except OSError:  # towerctl's own output is gone (a closed pipe): keep hashing
            dead_sinks.add(sink)
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # a non-blocking terminal or pipe we inherited: wait for room
            import select

            select.select([], [fd], [])


# --- talking to the daemon --------------------------------------------------------------------


class RetryingConnection:
    """towerctl's connection, reopened after a lost connection where a retry is safe.

    A call fails fast by default (:data:`~towerd.client.retry.FAIL_FAST`: before CMD
    runs, no daemon should not keep a hook waiting); once CMD ran, its outcome is sent
    with ``policy=PATIENT``. ``driver`` carries out an effect's steps on the same
    connection.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.driver = SyncDriver(PATIENT, connect=self.new_client)

    def new_client(self, role: str = "") -> Client:
        return Client(
            self.args.socket,
            timeout=call_timeout(self.args),
            principal=self.args.principal,
            client_name=f"towerctl{role}",
        )

    def open(self) -> Client:
        return self.driver.connected()

    def call(self, method: str, *args: Any, policy: RetryPolicy = FAIL_FAST, **kwargs: Any) -> Any:
        """``client.METHOD(*args, **kwargs)``, sent again after a lost connection."""
        return self.driver.request(
            lambda client: getattr(client, method)(*args, **kwargs), policy=policy
        )

    def close(self) -> None:
        self.driver.close()


# --- output ---------------------------------------------------------------------------------


def _dumps(value: Any, **kwargs: Any) -> str:
    return dumps_json(value, **kwargs)


def _say(text: str) -> None:
    """A line for the person, on stderr (stdout is CMD's), safe for a terminal."""
    say(f"towerctl: {text}", to_stderr=True)


def print_json(result: Any) -> None:
    emit(_dumps(result, indent=2, sort_keys=True), sys.stdout)


def error_out(
    args: argparse.Namespace, error: TowerdError, status: int, hint: str | None = None
) -> int:
    """Report ``error`` as towerctl reports any error, with a hint in text mode."""
    if args.json:
        emit(_dumps({"error": error.to_wire()}), sys.stdout)
    else:
        _say(f"{error.code}: {error.message}")
        if hint:
            _say(hint)
    return status


def _warn_rare_heartbeat(args: argparse.Namespace) -> None:
    """Say so when ``--heartbeat`` is more than half the effect's lease (``--lease-ttl``,
    else the daemon's default; the effect's own timeout is that default too): the lease
    can lapse while CMD runs, and a CMD that then succeeds ends ``uncertain`` (exit 120)
    for a person to resolve. Not refused: a test of that lapse wants it."""
    from towerd.protocol.schema.effects import DEFAULT_LEASE_TTL_MS

    silence_s = min(args.lease_ttl or DEFAULT_LEASE_TTL_MS, DEFAULT_LEASE_TTL_MS) / 1000
    if args.heartbeat and args.heartbeat > silence_s / 2:
        note(args, f"--heartbeat {args.heartbeat:g} s is more than half the effect's lease "
             f"({silence_s:g} s): the lease can lapse while CMD runs, and the effect then "
             f"ends uncertain (exit 120); give at most {silence_s / 2:g}")  # fmt: skip


def note(args: argparse.Namespace, text: str) -> None:
    """A line for the person in text mode (stderr: stdout is CMD's)."""
    if not args.json:
        _say(text)


def not_started(args: argparse.Namespace, argv: list[str], exc: OSError, what: str) -> int:
    """CMD could not be started: nothing ran."""
    missing = isinstance(exc, FileNotFoundError)
    code = "command_not_found" if missing else "command_not_executable"
    message = f"cannot run '{shown(argv[0])}': {exc.strerror or exc}; nothing ran, {what}"
    if args.json:
        data = {"argv": [shown(arg) for arg in argv]}
        emit(_dumps({"error": {"code": code, "message": message, "data": data}}), sys.stdout)
    else:
        _say(f"{code}: {message}")
    return EXIT_NOT_FOUND if missing else EXIT_NOT_EXECUTABLE


def command_payload(argv: list[str]) -> list[str | bytes]:
    """CMD's argv as its key's payload: each argument as text, or as its exact bytes
    (msgpack bin) when it is not UTF-8. Python hands undecodable argv bytes over as lone
    surrogates, which no wire string can carry; as bytes, the same argv always hashes
    the same and a different one never does."""
    return [arg if _is_utf8(arg) else os.fsencode(arg) for arg in argv]


def shown(arg: str) -> str:
    """An argument as text for messages: bytes that are not UTF-8 as ``\\xNN``."""
    return os.fsencode(arg).decode("utf-8", "backslashreplace")


def command_argv(args: argparse.Namespace, command: str) -> list[str]:
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError(f"{command}: give the command to run after --, e.g. -- git push")
    return argv


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)


# --- towerctl run ---------------------------------------------------------------------------


def stored_status(result: Any) -> int:
    """The exit status a completed key replays: its ``exit_status``, or 0 for a key a
    person settled as completed without one."""
    status = result.get("exit_status") if isinstance(result, dict) else None
    if isinstance(status, int) and not isinstance(status, bool) and 0 <= status <= 255:
        return status
    return 0


def _claim_run(
    conn: RetryingConnection, args: argparse.Namespace, operation: str, key: str, argv: list[str]
) -> dict[str, Any] | int:
    """The claim of ``towerctl run``: its answer, or the exit status to leave with."""
    # a repeated claim after a lost answer is ours (secrets.token_hex, unimported)
    attempt = os.urandom(16).hex()
    if getattr(args, "probe", None):
        from towerd.client.watchdog import add_mark  # protocol.naming's re: only with a probe

        # CMD and all it starts inherit it: the daemon does not probe the key while any
        # of them still runs (towerctl killed, CMD not), daemon/probes.py.
        add_mark(attempt)
    sent = False  # a claim reached a connected daemon: from then on it may be recorded

    def claim(client: Client) -> Any:
        nonlocal sent
        sent = True
        return client.idem_claim(
            operation,
            key,
            payload=command_payload(argv),
            holder_pid=os.getpid(),
            attempt=attempt,
            probe=getattr(args, "probe", None),
            probe_cwd=os.getcwd() if getattr(args, "probe", None) else None,
        )

    try:
        return conn.driver.request(claim, policy=FAIL_FAST)
    except OutcomeUnknown as exc:
        return error_out(
            args,
            exc,
            EXIT_UNKNOWN,
            "CMD was not run. If the key has a probe, towerctl effects settle runs it now; "
            "else check whether it ran, then settle the key: "
            f"towerctl idem resolve {_q(operation)} {_q(key)} --outcome completed "
            "--result '{\"exit_status\": 0}' (it ran) or --outcome abandoned "
            "(it did not: the next run runs it)",
        )
    except IdempotencyInProgress as exc:
        pid = (exc.data or {}).get("holder_pid")
        return error_out(
            args, exc, EXIT_BUSY, f"CMD was not run: process {pid} is running it; retry later"
        )
    except Unavailable as exc:
        if not sent:
            raise  # no daemon answered hello (none running, or stalled): nothing was claimed
        # Sent, unanswered (a stalled or restarting daemon): the claim may commit later,
        # and the key then reads outcome_unknown once this towerctl has exited.
        return error_out(
            args,
            exc,
            EXIT_UNAVAILABLE,
            "CMD was not run. The claim may have been recorded after towerctl stopped "
            "waiting: if a retry then exits 120 (outcome_unknown), CMD never started here; "
            f"settle it with towerctl idem resolve {_q(operation)} {_q(key)} "
            "--outcome abandoned (the next run runs it)",
        )


def _reopen_failed_run(
    conn: RetryingConnection,
    args: argparse.Namespace,
    operation: str,
    key: str,
    failed: Any,
    effect_ref: str,
) -> None:
    """--retry-failed: forget the failed outcome (the operator log says so). A retry
    that got there first (reopened it, maybe ran it) is no error: the next claim says
    what the key holds now. The outcome is named by its effect_ref too: a racing retry
    that reran CMD and failed the same way left the same result under a new one."""
    try:
        conn.call(
            "idem_reopen", operation, key, failed, reason="towerctl run --retry-failed",
            effect_ref=effect_ref,
        )  # fmt: skip
    except (Conflict, IdempotencyKeyUnknown):
        return
    note(args, f"{key} ({operation}) failed before (exit {stored_status(failed)}): running again")


def shell_run(args: argparse.Namespace) -> int:
    """``towerctl run --key KEY [--operation OP] -- CMD ...``."""
    argv = command_argv(args, "run")
    if not args.key:
        raise UsageError("run: give --key KEY (the name of what CMD does, the same on a retry)")
    operation, key = args.operation, args.key
    conn = RetryingConnection(args)
    claim = _claim_run(conn, args, operation, key, argv)
    if isinstance(claim, int):
        return claim
    if claim["state"] == "completed" and args.retry_failed:
        failed = claim.get("result")
        if stored_status(failed) != 0:
            _reopen_failed_run(conn, args, operation, key, failed, claim["effect_ref"])
            claim = _claim_run(conn, args, operation, key, argv)
            if isinstance(claim, int):
                return claim
    answer = {"operation": operation, "key": key, "effect_ref": claim["effect_ref"]}
    if claim["state"] == "completed":
        result = claim.get("result")
        status = stored_status(result)
        shown = result.get("output_sha256") if isinstance(result, dict) else None
        if args.json:
            print_json({**answer, "state": "replayed", "exit_status": status,
                        "output_sha256": shown, "result": result})  # fmt: skip
        else:
            note(
                args,
                f"{key} ({operation}) already ran: exit status {status}"
                + (f", output sha256 {shown}" if shown else "")
                + "; not running it again"
                + (" (--retry-failed reruns a failed one)" if status else ""),
            )
        return status

    # From here to the record, a stop request waits (CMD gets it while it runs: Child's
    # handlers, which hand back to these when it ends): no gap where it loses the outcome.
    with _SignalsDeferred() as caught:
        try:
            child = Child(argv, capture=True, stdout_fd=2 if args.json else 1)
        except OSError as exc:
            conn.call("idem_release", operation, key, policy=PATIENT)
            return not_started(args, argv, exc, "the key is released")
        for signum in caught:  # came while CMD was being started: CMD gets it now
            child._forward(signum, None)
        caught.clear()
        outcome = child.wait()
        result = outcome.result()
        try:
            conn.call("idem_complete", operation, key, result, policy=PATIENT)
        except TowerdError as exc:
            return error_out(
                args,
                exc,
                EXIT_UNKNOWN,
                f"CMD ran and exited {outcome.exit_status}, but that could not be recorded; "
                "once this towerctl exits the key reads outcome_unknown. Record it with: "
                f"towerctl idem resolve {_q(operation)} {_q(key)} --outcome completed "
                f"--result {_q(_dumps(result, sort_keys=True))}",
            )
    if args.json:
        print_json({**answer, "state": "ran", "exit_status": outcome.exit_status,
                    "output_sha256": outcome.output_sha256, "result": result})  # fmt: skip
    if caught:
        _say(f"{key} ({operation}) recorded (exit {outcome.exit_status}); "
             f"stopping for signal {caught[0]}")  # fmt: skip
        return 128 + caught[0]
    return outcome.exit_status


class _SignalsDeferred:
    """While CMD's known outcome is being recorded (retried for a while if the daemon is
    restarting), SIGTERM, SIGHUP and SIGINT wait: stopping then lost an outcome towerctl
    held (the key turned outcome_unknown and every retry was refused). The signals
    caught are listed; the caller stops with the first once the outcome is recorded."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __enter__(self) -> list[int]:
        self.caught: list[int] = []
        self.saved: dict[int, Any] = {}
        try:
            for signum in self.SIGNALS:
                self.saved[signum] = signal.signal(signum, self._note)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self.caught

    def _note(self, signum: int, _frame: Any) -> None:
        self.caught.append(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        self.saved = {}  # restored once, however many exits


# --- towerctl effect run --------------------------------------------------------------------

GIT_TARGET_OPTIONS = ("--repo", "--remote", "--commit", "--ref")
# Options of git push that take a separate value (the rest are flags or --opt=value).
_PUSH_OPTIONS_WITH_VALUE = frozenset({"-o", "--push-option", "--repo", "--receive-pack",
                                      "--exec", "--signed"})  # fmt: skip


class NotProbeable(Exception):
    """What a git-push effect's probe target could not be derived from."""


def _git(cwd: str, *argv: str) -> str | None:
    """``git -C cwd ARGV`` 's first line of output, None if it failed."""
    import subprocess

    try:
        done = subprocess.run(
            ["git", "-C", cwd, *argv], capture_output=True, text=True, timeout=30,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = done.stdout.strip().splitlines()
    return out[0] if done.returncode == 0 and out else None


def parse_git_push(argv: list[str]) -> tuple[str, str | None, str | None, str | None] | None:
    """(directory, REMOTE, SRC, DST) of ``git [-C DIR] push [OPTIONS] [REMOTE] [[+]SRC:]DST``,
    None when argv is not that form. SRC is None for a bare DST (pushes the same name)."""
    if not argv or os.path.basename(argv[0]) != "git":
        return None
    directory, i = ".", 1
    while i < len(argv) and argv[i] != "push":
        if argv[i] == "-C" and i + 1 < len(argv):
            directory = os.path.join(directory, argv[i + 1])
            i += 2
        elif argv[i] == "-c" and i + 1 < len(argv):
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return None  # another subcommand
    if i >= len(argv):
        return None
    positional: list[str] = []
    rest = iter(argv[i + 1 :])
    for word in rest:
        if word == "--":
            positional += list(rest)
            break
        if word in _PUSH_OPTIONS_WITH_VALUE:
            next(rest, None)
        elif not word.startswith("-"):
            positional.append(word)
    if len(positional) > 2:
        raise NotProbeable("it pushes more than one refspec")
    remote = positional[0] if positional else None
    if len(positional) < 2:
        return directory, remote, None, None
    spec = positional[1].removeprefix("+")
    src, _, dst = spec.rpartition(":")
    if spec.startswith(":"):
        raise NotProbeable("it deletes a ref")
    return directory, remote, (src or None) if ":" in spec else None, dst


def _default_remote(repo: str) -> str:
    """The remote ``git push`` with none named pushes to (git-push(1))."""
    branch = _git(repo, "symbolic-ref", "-q", "--short", "HEAD")
    for key in (f"branch.{branch}.pushRemote" if branch else None, "remote.pushDefault",
                f"branch.{branch}.remote" if branch else None):  # fmt: skip
        value = key and _git(repo, "config", "--get", key)
        if value:
            return value
    return "origin"


def git_push_target(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    """The git-push effect's probe target: from ``--repo/--remote/--commit/--ref`` where
    given, else derived from CMD when it is ``git push [REMOTE] [SRC:]DST``."""
    parsed = parse_git_push(argv)
    given = {option: getattr(args, option[2:]) for option in GIT_TARGET_OPTIONS}
    directory, remote, src, dst = parsed or (".", None, None, None)
    start = os.path.abspath(given["--repo"] or directory)
    repo = _git(start, "rev-parse", "--show-toplevel") or _git(
        start, "rev-parse", "--absolute-git-dir"
    )
    if repo is None:
        raise NotProbeable(f"{start} is not in a git repository")
    remote = given["--remote"] or remote or _default_remote(repo)
    if remote.startswith("-"):
        raise NotProbeable(f"the remote {remote!r} is not a remote")
    url = _git(repo, "remote", "get-url", "--push", remote)
    if url is None:
        url = remote  # not a configured remote: a URL or a path
    if "://" not in url and not _scp_like(url) and os.path.exists(os.path.join(repo, url)):
        url = os.path.abspath(os.path.join(repo, url))  # a path, relative to the repository
    ref = given["--ref"] or dst
    if ref is None:
        raise NotProbeable("the destination ref is not in CMD (give --ref)")
    revision = given["--commit"] or src or (dst if src is None and parsed and dst else "HEAD")
    commit = _git(repo, "rev-parse", "--verify", "--end-of-options", f"{revision}^{{commit}}")
    if commit is None:
        raise NotProbeable(f"{revision!r} is not a commit in {repo}")
    from towerd.protocol.naming import SHORT_REF_PREFIXES  # as the lease reads them

    if ref.startswith(SHORT_REF_PREFIXES):
        # git pushes it to refs/<ref> if the remote has that ref, else makes a new one,
        # refs/heads/<ref> or (a tag pushed) refs/tags/<ref>: which, only the remote knows.
        raise NotProbeable(f"the destination {ref!r} names one of two refs (give --ref refs/...)")
    if not ref.startswith("refs/"):
        tag = _git(repo, "rev-parse", "--symbolic-full-name", "--end-of-options", revision)
        ref = f"refs/tags/{ref}" if tag and tag.startswith("refs/tags/") else f"refs/heads/{ref}"
    return {"repo": repo, "remote_url": url, "commit": commit, "ref": ref}


def _is_push(argv: list[str]) -> bool:
    """CMD is ``git ... push ...`` (whether or not its target can be derived)."""
    try:
        return parse_git_push(argv) is not None
    except NotProbeable:
        return True


def _scp_like(url: str) -> bool:
    """``host:path`` (git's scp-like syntax), not a local path with a colon after a slash."""
    head = url.split(":", 1)[0]
    return ":" in url and "/" not in head


def _resolve_hint(key: str) -> str:
    return (
        f"a git-push that recorded its target is probed by the daemon (towerctl effects "
        f"settle {key} probes it now); otherwise check whether it happened, then: "
        "towerctl effects resolve "
        f"{key} --outcome committed --receipt JSON (it did) or --outcome aborted (it did not)"
    )


def effect_run(args: argparse.Namespace) -> int:
    """``towerctl effect run --run-id R --step S --kind K --target T -- CMD ...``."""
    from towerd.client.effect import (
        LOST,
        EffectFailed,
        EffectSpec,
        beat_in_background,
        effect_steps,
    )

    argv = command_argv(args, "effect run")
    missing = [
        option
        for option, value in (
            ("--run-id", args.run_id),
            ("--step", args.step),
            ("--kind", args.kind),
            ("--target", args.target),
        )
        if not value
    ]
    if missing:
        raise UsageError(f"effect run: give {', '.join(missing)}")
    if not args.heartbeat > 0:
        raise UsageError("effect run: --heartbeat must be a positive number of seconds")
    payload = _json_arg(args.payload, "--payload")
    git = None
    if args.kind == "git-push":
        try:
            git = git_push_target(args, argv)
        except NotProbeable as exc:
            # Said where it was meant to be probeable (CMD is a git push, or a target flag
            # was given); else the record says it (effects list: not probeable).
            if _is_push(argv) or any(getattr(args, option[2:]) for option in GIT_TARGET_OPTIONS):
                note(args, f"this git-push cannot be probed if its outcome is lost ({exc}); "
                     "give --repo, --remote, --commit and --ref to make it probeable")  # fmt: skip
    elif any(getattr(args, option[2:]) for option in GIT_TARGET_OPTIONS):
        raise UsageError("effect run: --repo, --remote, --commit and --ref are for --kind git-push")
    _warn_rare_heartbeat(args)
    spec = EffectSpec(
        args.run_id, args.step, args.kind, args.target, payload, args.attempt,
        heartbeat_interval=args.heartbeat, lease_ttl_ms=args.lease_ttl, git=git,
    )  # fmt: skip
    conn = RetryingConnection(args)
    steps = effect_steps(spec)
    try:
        effect = conn.driver.advance(steps, policy=FAIL_FAST).effect
    except EffectAlreadyCommitted as exc:
        record = (exc.data or {}).get("effect", {})
        if args.json:
            print_json({"state": "already_committed", "effect": record})
        else:
            note(
                args,
                f"{args.kind} on {args.target} ({record.get('effect_key')}) was already "
                f"committed; receipt: {_dumps(record.get('receipt'), sort_keys=True)}; "
                "not running it again",
            )
        return 0
    except EffectUncertain as exc:
        key = (exc.data or {}).get("effect", {}).get("effect_key", "KEY")
        return error_out(args, exc, EXIT_UNKNOWN, "CMD was not run; " + _resolve_hint(key))
    except (EffectInFlight, EffectLeaseHeld) as exc:
        return error_out(args, exc, EXIT_BUSY, "CMD was not run; retry later")

    key = effect.effect_key
    from towerd.client.watchdog import add_mark
    from towerd.protocol.naming import effect_attempt_mark

    # CMD and all it starts inherit it: the daemon does not probe the effect while any of
    # them still runs (towerctl killed, CMD or a command it started not), daemon/probes.py.
    add_mark(effect_attempt_mark(effect.attempt_id))
    # From here to the record, a stop request waits (CMD gets it while it runs), as in
    # run: stopping then parked uncertain an effect whose outcome towerctl knew.
    with _SignalsDeferred() as caught:
        try:
            # Under a lease, CMD must not outlive towerctl (whose death frees the lease), nor
            # a local one's, which another attempt takes over once towerctl is dead.
            from towerd.protocol.naming import LOCAL_KINDS

            ends_with_us = effect.lease_resource or args.kind in LOCAL_KINDS
            child = Child(
                argv,
                capture=True,
                stdout_fd=2 if args.json else 1,
                die_with_parent=signal.SIGTERM if ends_with_us else None,
            )
        except OSError as exc:
            try:
                conn.driver.advance(steps, error=EffectNotStarted(f"cannot run {shown(argv[0])}"))
            except EffectNotStarted:
                pass  # aborted
            return not_started(args, argv, exc, "the effect is aborted")
        for signum in caught:  # came while CMD was being started: CMD gets it now
            child._forward(signum, None)
        caught.clear()
        heartbeat = beat_in_background(effect, lambda: conn.new_client("/heartbeat"))
        try:
            outcome = child.wait()
        finally:
            if heartbeat is not None:
                heartbeat.stop()
        done = outcome.result()
        lost_hint = (
            f"CMD exited {outcome.exit_status} ({_dumps(done, sort_keys=True)}) but the effect "
            f"was not recorded as done; it is parked uncertain: {_resolve_hint(key)}"
        )
        try:
            failed = None if outcome.exit_status == 0 else EffectFailed(done)
            conn.driver.advance(steps, done, failed)
        except EffectFailed:
            pass  # recorded failed: the next attempt runs it afresh
        except LOST as exc:
            return error_out(args, exc, EXIT_UNKNOWN, lost_hint)
        except TowerdError as exc:
            return error_out(
                args,
                exc,
                EXIT_UNKNOWN,
                f"CMD exited {outcome.exit_status} but that could not be recorded; the effect is "
                f"parked uncertain once this towerctl exits: {_resolve_hint(key)}",
            )
    record = effect.record
    assert record is not None
    if args.json:
        print_json({"state": record["status"], "exit_status": outcome.exit_status,
                    "output_sha256": outcome.output_sha256, "effect": record})  # fmt: skip
    if caught:
        _say(f"{key} recorded (exit {outcome.exit_status}); stopping for signal {caught[0]}")
        return 128 + caught[0]
    return outcome.exit_status
