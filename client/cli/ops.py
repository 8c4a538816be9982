"""The daemon's own commands (ping, status, shutdown, boxes, backup) and the offline tools
(doctor, install-systemd, branch cleanup).

The offline tools import what they use when run: pathlib, sqlite3 and git's helpers
would cost every ``towerctl ping``.
"""

from __future__ import annotations

import os
import time

from towerd.client.cli.output import LocalFailure, Unhealthy, UsageError, table
from towerd.client.cli.registry import REPO, Commands, arg

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from towerd.client.sync import Client

COMMANDS = Commands()


def render_pong(_result: Any) -> str:
    return "pong"


@COMMANDS.command("ping", help="check that the daemon answers", render=render_pong)
def cmd_ping(client: Client, _args: argparse.Namespace) -> Any:
    return client.ping()


@COMMANDS.command("status", help="daemon identity, counts, last reconciliation")
def cmd_status(client: Client, _args: argparse.Namespace) -> Any:
    return client.status()


@COMMANDS.command("shutdown", help="stop the daemon gracefully")
def cmd_shutdown(client: Client, _args: argparse.Namespace) -> Any:
    return client.shutdown()


def age(millis: Any, now_ms: int) -> str:
    """How long ago ``millis`` was, as ``3s ago`` (``-`` for none recorded: 0 or null)."""
    if not isinstance(millis, int) or millis <= 0:
        return "-"
    if millis > now_ms + 1000:  # another box's clock, or the server's set ahead once
        return f"in {(millis - now_ms) // 1000}s"
    seconds = max(0, now_ms - millis) // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def render_boxes(result: dict[str, Any]) -> str:
    now = int(time.time() * 1000)
    rows = [
        {
            "box": ("* " if box["self"] else "  ") + box["daemon_id"],
            "host": box["host"],
            "epoch": box["owner_epoch"],
            "state": box["state"],
            "presence": age(box["presence_at"], now),
            "started_at": box["started_at"],
        }
        for box in result["boxes"]
    ]
    text = table(
        rows,
        [("box", "  BOX"), ("host", "HOST"), ("epoch", "EPOCH"), ("state", "STATE"),
         ("presence", "LAST PRESENCE"), ("started_at", "STARTED")],
    )  # fmt: skip
    return text + ("\n(more boxes than fit in one answer)" if result.get("truncated") else "")


@COMMANDS.command(
    "boxes",
    help="every box (daemon id) of the store: host, epoch, state (present, lapsed: silent "
    "past the presence TTL, dead), last presence; * marks this daemon",
    render=render_boxes,
)
def cmd_boxes(client: Client, _args: argparse.Namespace) -> Any:
    return client.boxes_list()


@COMMANDS.command(
    "backup",
    help="an online, checked copy of the database",
    options=[
        arg("path", help="where the copy goes (on the daemon's host)"),
        arg("--overwrite", action="store_true", help="replace an existing file"),
    ],
)
def cmd_backup(client: Client, args: argparse.Namespace) -> Any:
    return client.backup(os.path.abspath(args.path), overwrite=args.overwrite)


def render_doctor(result: dict[str, Any]) -> str:
    from towerd.client.doctor import render as render_report

    return render_report(result)


@COMMANDS.command(
    "doctor",
    help="what is wrong, and what to do about it (exit 1 if anything is)",
    render=render_doctor,
    options=[
        arg("--full", action="store_true", help="integrity_check instead of quick_check"),
        arg(
            "--state-dir",
            default=None,
            help="checked directly when no daemon answers",
            local_path=True,
        ),
    ],
    offline=True,
)
def cmd_doctor(_client: None, args: argparse.Namespace) -> Any:
    from pathlib import Path

    from towerd.client.doctor import examine

    result = examine(
        Path(args.socket) if args.socket else None,
        Path(args.state_dir) if args.state_dir else None,
        args.principal,
        args.full,
    )
    if not result["ok"]:
        raise Unhealthy(result)
    return result


@COMMANDS.command(
    "install-systemd",
    help="install towerd.service and towerd.socket as user units (--notify: and "
    "towerd-notify.service)",
    options=[
        arg(
            "--dir",
            default=None,
            help="unit directory (default ~/.config/systemd/user)",
            local_path=True,
        ),
        arg(
            "--enable",
            action="store_true",
            help="also run systemctl --user daemon-reload and enable --now towerd.socket "
            "(and towerd-notify.service)",
        ),
        arg(
            "--notify",
            action="store_true",
            help="also install towerd-notify.service, running `towerctl notify` (with "
            "--notify-exec CMD, else --desktop)",
        ),
        arg(
            "--notify-exec",
            default=None,
            metavar="CMD",
            help="the service runs `towerctl notify --exec CMD` (implies --notify)",
        ),
        arg(
            "--notify-desktop",
            action="store_true",
            help="the service runs `towerctl notify --desktop` (implies --notify; the default)",
        ),
    ],
    offline=True,
)
def cmd_install_systemd(_client: None, args: argparse.Namespace) -> Any:
    from pathlib import Path

    from towerd.client.systemd_units import SystemctlFailed, install_units

    notify_args = None
    if args.notify_exec is not None and args.notify_desktop:
        raise UsageError("give --notify-exec CMD or --notify-desktop, not both")
    if args.notify_exec is not None:
        if not args.notify_exec.strip():
            raise UsageError("--notify-exec needs a command")
        notify_args = ["--exec", args.notify_exec]
    elif args.notify or args.notify_desktop:
        notify_args = ["--desktop"]
    try:
        return install_units(
            Path(args.dir) if args.dir else None, enable=args.enable, notify_args=notify_args
        )
    except SystemctlFailed as exc:
        raise LocalFailure("systemctl_failed", str(exc), exc.data()) from None


COMMANDS.group("branch", "git branches of runs (offline: no daemon)")


def render_branch_cleanup(result: dict[str, Any]) -> str:
    """One line per step: what was done, found absent, skipped, or failed."""
    errors = result["errors"]
    lines = [f"branch {result['branch']} in {result['repo']}"]
    if "worktree" in errors:
        worktree = f"FAILED: {errors['worktree']}"
    elif result["worktree_removed"]:
        worktree = f"removed {result['worktree_removed']}"
    elif result["worktree_kept"]:
        worktree = f"kept {result['worktree_kept']}"
    else:
        worktree = "none has the branch checked out"
    lines.append(f"  worktree: {worktree}")
    if "local_branch" in errors:
        local = f"FAILED: {errors['local_branch']}"
    else:
        local = "deleted" if result["local_branch_deleted"] else "not found"
    lines.append(f"  local branch: {local}")
    if result["remote"] is None:
        lines.append("  remote branch: left alone (no --delete-remote)")
    else:
        if "remote_branch" in errors:
            remote = f"FAILED: {errors['remote_branch']}"
        else:
            remote = "deleted" if result["remote_branch_deleted"] else "not found"
        lines.append(f"  remote branch on {result['remote']}: {remote}")
    return "\n".join(lines)


@COMMANDS.command(
    "branch",
    "cleanup",
    help="remove the worktree that has BRANCH checked out (uncommitted changes included) "
    "and delete the branch; exit 1 if a step failed",
    render=render_branch_cleanup,
    options=[
        arg(
            "branch",
            nargs="?",
            default=None,
            metavar="BRANCH",
            help="the branch, e.g. kxm/run-42 (required)",
        ),
        arg(
            "--keep-worktree",
            action="store_true",
            help="leave the worktree (git then refuses to delete the branch checked out there)",
        ),
        arg("--delete-remote", action="store_true", help="also delete the branch on the remote"),
        arg(
            "--remote", default=None, metavar="NAME", help="with --delete-remote (default: origin)"
        ),
        REPO,
    ],
    offline=True,
)
def cmd_branch_cleanup(_client: None, args: argparse.Namespace) -> Any:
    from towerd.client.git_tools import GitError, cleanup_branch

    if args.branch is None:
        # Optional in the parser only so that every command parses with no arguments.
        raise UsageError("branch cleanup: give the BRANCH to clean up")
    if args.remote is not None and not args.delete_remote:
        raise UsageError("branch cleanup: --remote only applies with --delete-remote")
    try:
        result = cleanup_branch(
            args.repo,
            args.branch,
            keep_worktree=args.keep_worktree,
            delete_remote=args.delete_remote,
            remote=args.remote or "origin",
        )
    except (GitError, ValueError) as exc:
        raise UsageError(f"branch cleanup: {exc}") from None
    if not result["ok"]:
        raise Unhealthy(result)
    return result
