"""Path leases by hand: ``claim`` and ``release``.

Run by an agent from its own shell tool, towerctl's nearest non-shell ancestor is the
agent process, so the claim is that agent's current session's; a person names the
session with ``--session``. Paths are taken as real paths (relative ones from here),
and a directory claim covers every path below it. ``towerctl leases`` lists them.
"""

from __future__ import annotations

from towerd.client.agents import agent_process, resolve
from towerd.client.cli.output import UsageError, table
from towerd.client.cli.registry import Commands, arg

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from towerd.client.sync import Client

COMMANDS = Commands()

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_TTL_SECONDS = 7 * 86400  # the daemon's bound on a path lease's TTL


def duration_ms(text: str) -> int:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``: milliseconds (a bare number is seconds)."""
    number, unit = text.strip(), "s"
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if number.endswith(suffix):
            number, unit = number[: -len(suffix)], suffix
            break
    try:
        value = float(number)
    except ValueError:
        raise UsageError(f"--ttl {text!r}: give a duration such as 90s, 30m or 2h") from None
    if not 0 < value < float("inf") or value * _UNITS[unit] > MAX_TTL_SECONDS:
        raise UsageError(f"--ttl {text!r}: a duration must be positive and at most 7 days")
    return int(value * _UNITS[unit] * 1000)


PATHS = arg("paths", nargs="+", metavar="PATH", local_path=True, help="files or directories")
SESSION = arg(
    "--session",
    metavar="S",
    help="the session to act for (default: the agent session this runs in)",
)


def _whose(args: argparse.Namespace) -> dict[str, Any]:
    """``session_id`` (--session, else TOWERD_SESSION_ID as the hooks take it), else
    this process's agent as ``agent_pid``. The daemon checks either against the agent
    session this runs inside, if any (it acts for itself only)."""
    from towerd.client.hook_report import _session_from_env

    session = args.session or _session_from_env()
    if session:
        return {"session_id": session}
    pid = agent_process()
    return {} if pid is None else {"agent_pid": pid}


def _real(paths: list[str]) -> list[str]:
    return [resolve(path, None) for path in paths]  # as the hook spells them


def render_claim(result: dict[str, Any]) -> str:
    return f"session {result['session_id']}\n" + table(
        result["leases"],
        [("path", "PATH"), ("fencing_token", "TOKEN"), ("expires_at", "EXPIRES")],
    )


@COMMANDS.command(
    "claim",
    help="lease paths to an agent session (every other session's edits of them, and "
    "of what is below a directory, are denied)",
    render=render_claim,
    options=[
        PATHS,
        SESSION,
        arg(
            "--ttl",
            metavar="D",
            help="idle time before it lapses (default: the daemon's --path-lease-ttl, 30m)",
        ),
    ],  # fmt: skip
)
def cmd_claim(client: Client, args: argparse.Namespace) -> Any:
    ttl = None if args.ttl is None else duration_ms(args.ttl)
    return client.path_claim(_real(args.paths), **_whose(args), ttl_ms=ttl)


def render_release(result: dict[str, Any]) -> str:
    released = result["released"]
    return "\n".join(f"released {path}" for path in released) or "nothing was leased there"


@COMMANDS.command(
    "release",
    help="give path leases back (a person, outside any agent session: whoever holds them)",
    render=render_release,
    options=[PATHS, SESSION],
)
def cmd_release(client: Client, args: argparse.Namespace) -> Any:
    return client.path_release(_real(args.paths), **_whose(args))
