"""Wiring towerd into Claude Code and Codex: ``hooks install|uninstall|status``.

The file work is towerd.client.hooks_install's, imported when a command runs. A refusal
keeps its own exit status: 65 for a settings file that is not valid JSON, 69 when there
is no Python executable to wire in (the hooks run it with towerd's launcher).
``status`` asks the daemon when each event last arrived, and reports the files all the
same when no daemon answers.
"""

from __future__ import annotations

from towerd.client.agents import AGENTS, DEFAULT_GUARD, GUARD_POLICIES, SCOPES
from towerd.client.cli.output import LocalFailure, UsageError, when
from towerd.client.cli.registry import Commands, arg, call_timeout

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from typing import Any

COMMANDS = Commands()
COMMANDS.group("hooks", "wire towerd into Claude Code's and Codex's hooks, and check them")

AGENT = arg(
    "--agent",
    choices=("all", *AGENTS),
    default="all",
    help="which agent's settings (default: all)",
)
PROJECT = arg(
    "--project",
    default=None,
    metavar="DIR",
    help="the project of --scope project (default: the current directory)",
    local_path=True,
)
SCOPE = arg(
    "--scope",
    choices=SCOPES,
    default="user",
    help="user: ~/.claude/settings.json and $CODEX_HOME (else ~/.codex)/hooks.json; "
    "project: DIR/.claude/settings.json and DIR/.codex/hooks.json (default: user)",
)


def _refusals_reported(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()``, its refusal reported as towerctl reports every local failure, with the
    refusal's own exit status."""
    from towerd.client.hooks_install import HooksError

    try:
        return work()
    except HooksError as exc:
        raise LocalFailure(exc.code, exc.message, exc.data, exc.exit_status) from None


def _project(args: argparse.Namespace) -> str | None:
    if args.project is not None and args.scope != "project":
        raise UsageError("hooks: --project only applies with --scope project")
    return args.project


# --- install, uninstall --------------------------------------------------------------------

CHANGES = {
    "already_installed": "already installed",
    "not_installed": "not installed",
    "no_file": "no such file: nothing to do",
}


def render_changes(result: dict[str, Any]) -> str:
    """One line per file: which agent, which file, what changed."""
    lines = []
    for done in result["files"]:
        change = done["change"]
        if change == "installed":
            text = f"installed {len(done['events'])} events"
            if done["replaced"]:
                text += f" (replacing towerd's {done['replaced']} earlier handlers)"
        elif change == "removed":
            text = f"removed ({done['removed']} handlers)"
        else:
            text = CHANGES[change]
        lines.append(f"{done['agent']:6} {done['path']}: {text}")
        if done.get("command") and change == "installed":
            lines.append(f"{'':6} runs: {done['command']}")
        if done["backup"]:
            lines.append(f"{'':6} previous file kept as {done['backup']}")
        lines += [f"{'':6} note: {note}" for note in done["notes"]]
    return "\n".join(lines)


@COMMANDS.command(
    "hooks",
    "install",
    help="wire `towerctl hook` into every hook event of each agent's settings (keeping "
    "everything else; reinstalling changes nothing); exit 65 if a file is not valid JSON",
    options=[
        AGENT,
        SCOPE,
        PROJECT,
        arg(
            "--guard",
            choices=GUARD_POLICIES,
            default=DEFAULT_GUARD,
            help="an edit of a path another live session holds: deny it, warn the agent, "
            f"or guard nothing (default: {DEFAULT_GUARD})",
        ),
    ],
    offline=True,
    render=render_changes,
)
def cmd_hooks_install(_client: None, args: argparse.Namespace) -> dict[str, Any]:
    from towerd.client.hooks_install import install

    project = _project(args)
    return _refusals_reported(lambda: install(args.agent, args.scope, project, args.guard))


@COMMANDS.command(
    "hooks",
    "uninstall",
    help="take towerd's hook handlers out of each agent's settings (nothing else)",
    options=[AGENT, SCOPE, PROJECT],
    offline=True,
    render=render_changes,
)
def cmd_hooks_uninstall(_client: None, args: argparse.Namespace) -> dict[str, Any]:
    from towerd.client.hooks_install import uninstall

    project = _project(args)
    return _refusals_reported(lambda: uninstall(args.agent, args.scope, project))


# --- status --------------------------------------------------------------------------------


def ask_daemon(args: argparse.Namespace) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """(the daemon's ``event.last_seen`` kinds, what came of asking): None when it could
    not be asked, which status reports rather than fails on."""
    from towerd.client.sync import Client
    from towerd.protocol.errors import TowerdError
    from towerd.protocol.paths import default_socket_path

    socket_path = args.socket or default_socket_path()
    try:
        with Client(
            socket_path,
            timeout=call_timeout(args),
            principal=args.principal,
            client_name="towerctl",
        ) as client:
            kinds: list[Any] = client.event_last_seen()["kinds"]
    except (TowerdError, OSError) as exc:
        error = f"{exc.code}: {exc.message}" if isinstance(exc, TowerdError) else str(exc)
        return None, {"asked": False, "socket": socket_path, "error": error}
    return kinds, {"asked": True, "socket": socket_path, "error": None}


def render_status(result: dict[str, Any]) -> str:
    """Per agent: its verdict, each file, each event's last arrival, notes and hints."""
    daemon = result["daemon"]
    if daemon["asked"]:
        lines = [f"daemon at {daemon['socket']}: asked when each event last arrived"]
    else:
        lines = [f"daemon at {daemon['socket']}: could not be asked ({daemon['error']})"]
    for agent, found in result["agents"].items():
        lines.append(f"{agent}: {found['state']}: {found['detail']}")
        for file in found["files"]:
            lines.append(f"  {file['scope']:8} {file['path']}: {_file_summary(file)}")
            for command in file["commands"]:
                version = command["version"] or "?"
                lines.append(
                    f"  {'':8} runs towerctl {version} at {command['towerctl']}, "
                    f"guard {command['guard']}" + (" (stale)" if command["stale"] else "")
                )
        if daemon["asked"] and (found["installed"] or any(e["count"] for e in found["events"])):
            for event in found["events"]:
                wired = "wired" if event["wired"] else "not wired"
                last = (
                    f"last {when(event['last_at'])} ({event['count']} kept)"
                    if event["last_at"] is not None
                    else "never arrived"
                )
                lines.append(f"  {event['event']:18} {wired:9}  {last}")
        lines += [f"  note: {note}" for note in found["notes"]]
        if found["hint"] and found["hint"] not in found["fix"]:
            lines.append(f"  hint: {found['hint']}")
        if found["fix"] and found["state"] != "ok":
            lines.append(f"  -> {found['fix']}")
    return "\n".join(lines)


def _file_summary(file: dict[str, Any]) -> str:
    if file["error"]:
        return f"UNREADABLE: {file['error']}"
    if not file["exists"]:
        return "no file"
    if not file["wired"]:
        return "towerd not wired"
    total = len(file["wired"]) + len(file["missing"])
    missing = f"; missing {', '.join(file['missing'])}" if file["missing"] else ""
    return f"{len(file['wired'])}/{total} events wired{missing}"


@COMMANDS.command(
    "hooks",
    "status",
    help="which events of each agent run towerd, with which towerctl, and when each last "
    "arrived (asked of the daemon; reported without it when none answers)",
    options=[AGENT, PROJECT],
    offline=True,
    render=render_status,
)
def cmd_hooks_status(_client: None, args: argparse.Namespace) -> dict[str, Any]:
    from towerd.client.hooks_install import hooks_status, selected_agents

    def work() -> dict[str, Any]:
        last_seen, daemon = ask_daemon(args)
        result = hooks_status(selected_agents(args.agent), args.project, last_seen)
        return {**result, "daemon": daemon}

    return _refusals_reported(work)
