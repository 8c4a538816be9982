"""Clients talk only to this user's own towerd, and within their time and size limits.

Another local user (a real uid: ``nobody`` through setpriv) that listens where a client
looks for towerd is refused before a single byte is sent: through the socket directory
(owned by another uid, open to others) or, in a private directory, through the
listener's ``SO_PEERCRED``. A fake server that answers like towerd would otherwise make
``towerctl run`` skip its command (a forged ``completed``) or run it on every retry (a
forged ``claimed``) and would receive every hook payload. Servers of this user that
trickle their answers or announce absurd frames cannot hold a client past its timeout
or make it buffer a gigabyte.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from towerd.client import Client, Unauthorized, Unavailable
from towerd.client.aio import AsyncClient
from towerd_testing import TOWERCTL, TOWERD, NotifySocket, wait_for

NOBODY_UID = 65534
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a server as nobody")

# A server that answers like towerd: hello, then forged idem.claim answers. It records
# every byte each connection sent (one JSON line per connection, written when the
# connection ends); a connection that sends exactly SENTINEL marks the end of the record.
FAKE_SERVER = r"""
import json, os, socket, struct, sys, time
from towerd.protocol import lite
from towerd.protocol.framing import FrameDecoder, encode_frame

cfg = json.loads(sys.argv[1])
if cfg.get("make_dir"):
    directory = os.path.dirname(cfg["socket"])
    os.mkdir(directory)
    os.chmod(directory, 0o777)
if cfg.get("listen_fd") is not None:
    server = socket.socket(fileno=cfg["listen_fd"])  # bound by someone else
else:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(cfg["socket"])
    os.chmod(cfg["socket"], 0o777)
server.listen(16)
open(cfg["ready"], "w").close()

CLAIMS = {
    "completed": {"state": "completed", "effect_ref": "forged",
                  "result": {"exit_status": 0, "output_sha256": "0" * 64}},
    "claimed": {"state": "claimed", "effect_ref": "00000000-0000-4000-8000-000000000000"},
}

def result_for(method):
    if method == "hello":
        return {"protocol": 1, "max_frame": cfg.get("max_frame", 1 << 20),
                "server": {"name": "towerd", "version": "0.1.0"}}
    if method == "idem.claim":
        return CLAIMS[cfg.get("claim", "completed")]
    return {"pong": True, "now": 0, "event_id": "forged", "state": "completed"}

def send(conn, method, frame):
    if cfg.get("huge_prefix") and method != "hello":
        conn.sendall(struct.pack(">I", 1 << 30))  # a 1 GiB frame is coming...
        while True:
            conn.sendall(b"\0" * (1 << 20))
    if cfg.get("trickle") and (method != "hello" or cfg.get("trickle_hello")):
        for byte in frame:
            conn.sendall(bytes([byte]))
            time.sleep(cfg["trickle"])
        return
    conn.sendall(frame)

while True:
    conn, _ = server.accept()
    got = b""
    decoder = FrameDecoder(1 << 20)
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                break
            got += data
            for payload in decoder.feed(data):
                request = lite.unpackb(payload)
                answer = {"id": request["id"], "result": result_for(request["method"])}
                send(conn, request["method"], encode_frame(lite.packb(answer)))
    except OSError:
        pass
    conn.close()
    with open(cfg["record"], "a") as record:
        record.write(json.dumps({"sentinel": got == b"SENTINEL", "got": got.hex()}) + "\n")
"""


class FakeServer:
    """The fake towerd as a subprocess, possibly as another uid."""

    def __init__(self, socket_path: Path, notes: Path, *, as_nobody: bool, **cfg: object) -> None:
        self.socket_path = socket_path
        self.record = notes / f"record-{uuid.uuid4().hex[:8]}"
        ready = notes / f"ready-{uuid.uuid4().hex[:8]}"
        config = {"socket": str(socket_path), "record": str(self.record), "ready": str(ready)}
        fd = cfg.get("listen_fd")
        command = [sys.executable, "-c", FAKE_SERVER, json.dumps({**config, **cfg})]
        self.proc = subprocess.Popen(
            (AS_NOBODY + command) if as_nobody else command,
            pass_fds=(fd,) if isinstance(fd, int) else (),
            cwd=notes,
        )
        wait_for(lambda: ready.exists() or self.proc.poll() is not None, what="the fake server")
        assert self.proc.poll() is None, "the fake server did not start"

    def received(self) -> list[bytes]:
        """What each connection sent, once all connections before a sentinel are done."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(self.socket_path))
        probe.sendall(b"SENTINEL")
        probe.close()

        def lines() -> list[dict] | None:
            if not self.record.exists():
                return None
            entries = [json.loads(line) for line in self.record.read_text().splitlines()]
            return entries if entries and entries[-1]["sentinel"] else None

        entries = wait_for(lines, what="the fake server's record")
        return [bytes.fromhex(entry["got"]) for entry in entries[:-1]]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def arena() -> Iterator[Path]:
    """A root-owned directory others may enter, with ``shared`` (mode 1777, like /tmp),
    ``notes`` (nobody's, for the fake's record) and ``victim`` (private to us)."""
    root = Path(tempfile.mkdtemp(prefix="tt-", dir="/tmp"))
    root.chmod(0o755)
    (root / "shared").mkdir()
    (root / "shared").chmod(0o1777)
    (root / "notes").mkdir(mode=0o700)
    os.chown(root / "notes", NOBODY_UID, NOBODY_UID)
    (root / "victim").mkdir(mode=0o700)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    started: list[FakeServer] = []
    yield started
    for server in started:
        server.close()


@pytest.fixture
def squatter(arena: Path, servers: list[FakeServer]):
    """nobody made ``shared/towerd-<uid>`` (mode 0777) and listens in it, as towerd would."""

    def start(**cfg: object) -> FakeServer:
        path = arena / "shared" / f"towerd-{os.geteuid()}" / "towerd.sock"
        server = FakeServer(path, arena / "notes", as_nobody=True, make_dir=True, **cfg)
        servers.append(server)
        return server

    return start


@pytest.fixture
def impostor(arena: Path, servers: list[FakeServer]):
    """A socket in our own private directory, bound by us, but put into listen() (and
    served) by nobody: only SO_PEERCRED tells it apart."""

    def start(**cfg: object) -> FakeServer:
        path = arena / "victim" / "towerd.sock"
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound.bind(str(path))
        try:
            server = FakeServer(
                path, arena / "notes", as_nobody=True, listen_fd=bound.fileno(), **cfg
            )
        finally:
            bound.close()
        servers.append(server)
        return server

    return start


@pytest.fixture
def own_server(short_tmp: Path, servers: list[FakeServer]):
    """A fake towerd of this very user in a private directory: trusted, but hostile."""

    def start(**cfg: object) -> FakeServer:
        directory = short_tmp / "run"
        directory.mkdir(mode=0o700, exist_ok=True)
        server = FakeServer(
            directory / f"{uuid.uuid4().hex[:6]}.sock", short_tmp, as_nobody=False, **cfg
        )
        servers.append(server)
        return server

    return start


def plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "XDG_"))}
    return {**env, **extra}


def run_towerctl(socket_path: Path, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TOWERCTL, "--socket", str(socket_path), *args],
        capture_output=True,
        check=False,
        text=True,
        env=plain_env(),
        timeout=30,
        **kwargs,
    )


def hook_report(
    socket_path: Path, timeout: float = 15
) -> tuple[subprocess.CompletedProcess, float]:
    hook = {"hook_event_name": "UserPromptSubmit", "session_id": "agent-1", "prompt": "secret"}
    started = time.monotonic()
    done = subprocess.run(
        [TOWERCTL, "hook-report"],
        input=json.dumps(hook).encode(),
        capture_output=True,
        check=False,
        env=plain_env(TOWERD_SOCKET=str(socket_path), TOWERD_SESSION_ID=str(uuid.uuid4())),
        timeout=timeout,
    )
    return done, time.monotonic() - started


def json_error(done: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(done.stdout)["error"]


# --- another user's server -------------------------------------------------------------------


@needs_root
def test_client_refuses_a_socket_dir_of_another_user_and_sends_nothing(squatter):
    server = squatter(claim="completed")
    directory = server.socket_path.parent
    with pytest.raises(Unauthorized) as raised:
        Client(server.socket_path, timeout=5)
    message = raised.value.message
    assert str(directory) in message and f"owner uid {NOBODY_UID}" in message, message
    assert raised.value.data == {
        "socket": str(server.socket_path),
        "directory": str(directory),
        "owner_uid": NOBODY_UID,
        "mode": "0777",
        "reason": "socket_dir",
    }
    assert server.received() == []  # not even a connection


@needs_root
def test_towerctl_idem_claim_refuses_the_squatter(squatter):
    server = squatter(claim="completed")
    done = run_towerctl(server.socket_path, "--json", "idem", "claim", "op", "k1")
    assert done.returncode == 1, done
    error = json_error(done)
    assert error["code"] == "unauthorized" and f"owner uid {NOBODY_UID}" in error["message"]
    assert server.received() == []


@needs_root
@pytest.mark.parametrize("forged", ["completed", "claimed"])
def test_towerctl_run_neither_skips_nor_runs_on_a_forged_answer(squatter, arena, forged):
    """A forged `completed` would skip CMD, a forged `claimed` run it on every retry:
    towerctl refuses the server instead (exit 1, unauthorized) and CMD does not run."""
    server = squatter(claim=forged)
    marker = arena / "victim" / "ran"
    command = ["sh", "-c", f"touch {marker}"]
    done = run_towerctl(server.socket_path, "--json", "run", "--key", "K", "--", *command)
    assert done.returncode == 1, done
    assert json_error(done)["code"] == "unauthorized"
    assert not marker.exists(), "CMD ran on a forged answer"
    assert server.received() == []


@needs_root
def test_hook_report_is_silent_and_sends_no_payload_to_the_squatter(squatter):
    server = squatter()
    done, _ = hook_report(server.socket_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    assert server.received() == []


@needs_root
def test_listener_of_another_uid_in_a_private_dir_is_refused_by_its_credentials(impostor):
    """Our own 0700 directory and our own socket file, but nobody called listen() and
    answers: Client, towerctl and hook-report connect, read SO_PEERCRED and send
    nothing at all."""
    server = impostor(claim="completed")
    with pytest.raises(Unauthorized) as raised:
        Client(server.socket_path, timeout=5)
    assert f"runs as uid {NOBODY_UID}" in raised.value.message
    assert raised.value.data["reason"] == "peer_uid"
    assert raised.value.data["peer_uid"] == NOBODY_UID
    assert raised.value.data["peer_pid"] > 0
    done = run_towerctl(server.socket_path, "--json", "idem", "claim", "op", "k1")
    assert done.returncode == 1 and json_error(done)["code"] == "unauthorized", done
    done, _ = hook_report(server.socket_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    received = server.received()
    assert len(received) == 3 and received == [b"", b"", b""], received


@needs_root
@pytest.mark.anyio
async def test_async_client_refuses_both_kinds_of_impostor(squatter, impostor):
    for server, reason in ((squatter(), "socket_dir"), (impostor(), "peer_uid")):
        with pytest.raises(Unauthorized) as raised:
            async with AsyncClient.open(server.socket_path, timeout=5):
                pass
        assert raised.value.data["reason"] == reason
        assert str(NOBODY_UID) in raised.value.message
        # (in a thread: the loop must run to close the refused connection)
        assert set(await anyio.to_thread.run_sync(server.received)) <= {b""}


# --- this user's server, slow or greedy ---------------------------------------------------------

TRICKLE = 0.25  # seconds between two bytes of an answer: a ~40-byte answer takes ~10 s


@pytest.mark.parametrize("trickle_hello", [True, False], ids=["hello", "record"])
def test_hook_report_deadline_covers_a_trickling_server(own_server, trickle_hello):
    """One byte every 0.25 s, of the hello answer or of event.record's: hook-report still
    ends within its 2 s budget (+ start-up), silently, exit 0."""
    server = own_server(trickle=TRICKLE, trickle_hello=trickle_hello)
    done, took = hook_report(server.socket_path, timeout=10)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    assert took < 2.75, took  # DEADLINE (2 s) + interpreter start-up


@pytest.mark.parametrize("trickle_hello", [True, False], ids=["hello", "ping"])
def test_client_timeout_bounds_the_whole_call_not_each_recv(own_server, trickle_hello):
    server = own_server(trickle=TRICKLE, trickle_hello=trickle_hello)
    started = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        Client(server.socket_path, timeout=1).ping()
    assert time.monotonic() - started < 1.5
    assert raised.value.data["reason"] == "timeout"


@pytest.mark.anyio
@pytest.mark.parametrize("trickle_hello", [True, False], ids=["hello", "ping"])
async def test_async_client_timeout_bounds_the_whole_call(own_server, trickle_hello):
    server = own_server(trickle=TRICKLE, trickle_hello=trickle_hello)
    started = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        async with AsyncClient.open(server.socket_path, timeout=1) as client:
            await client.ping()
    assert time.monotonic() - started < 1.5
    assert raised.value.data["reason"] == "timeout"


def test_announced_max_frame_is_capped_and_a_1gib_prefix_refused_at_once(own_server):
    """hello says max_frame 2**40; the next answer announces 1 GiB: the client refuses
    the prefix at once (64 MiB ceiling), buffering none of it, not at its timeout."""
    server = own_server(max_frame=2**40, huge_prefix=True)
    client = Client(server.socket_path, timeout=5)
    assert client.max_request <= 64 * 1024 * 1024
    started = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        client.ping()
    assert time.monotonic() - started < 1.0
    assert "1073741824" in raised.value.message and "67108864" in raised.value.message
    assert client._decoder.buffered == 0


@pytest.mark.anyio
async def test_async_client_refuses_a_1gib_prefix_at_once(own_server):
    server = own_server(max_frame=2**40, huge_prefix=True)
    async with AsyncClient.open(server.socket_path, timeout=5) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            await client.ping()
        assert time.monotonic() - started < 1.0
        assert "1073741824" in raised.value.message
        assert client._decoder.buffered == 0


# --- the default path ---------------------------------------------------------------------------


def test_default_socket_without_xdg_runtime_dir_is_in_the_state_home(short_tmp):
    """No XDG_RUNTIME_DIR, no --socket: the daemon listens under $HOME/.local/state/towerd
    (not /tmp), and towerctl finds it there, with the same TOWERD_STATE_DIR or another."""
    home = short_tmp / "home"
    home.mkdir(mode=0o700)
    notify = NotifySocket(short_tmp / "notify")
    env = plain_env(HOME=str(home), NOTIFY_SOCKET=str(notify.path))
    daemon_env = {**env, "TOWERD_STATE_DIR": str(short_tmp / "state")}
    log = open(short_tmp / "log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [TOWERD, "--log-format", "json"], env=daemon_env, stdout=log, stderr=log
    )
    try:
        notify.wait_for("READY=1", timeout=20, alive=lambda: proc.poll() is None)
        expected = home / ".local" / "state" / "towerd" / "towerd.sock"
        for client_env in (daemon_env, env, {**env, "TOWERD_STATE_DIR": str(short_tmp / "x")}):
            done = subprocess.run(
                [TOWERCTL, "--json", "status"],
                capture_output=True,
                check=False,
                text=True,
                env=client_env,
                timeout=30,
            )
            assert done.returncode == 0, (done, (short_tmp / "log").read_text())
            status = json.loads(done.stdout)
            assert status["socket_path"] == str(expected)
            assert status["db_path"] == str(short_tmp / "state" / "towerd.db")
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        notify.close()
