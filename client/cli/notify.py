"""``towerctl notify``: a command, or a desktop notification, each time a session starts to
need you. The watching and the commands live in :mod:`towerd.client.notify`, imported
when the command runs."""

from __future__ import annotations

from towerd.client.cli.registry import Commands, arg
from towerd.client.cli.seconds import Seconds

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse

COMMANDS = Commands()

EPILOG = (
    "A session needs you when its newest event is a Notification (a permission prompt, an "
    "idle prompt, an elicitation). Each move into that state after notify started notifies "
    "once: not again while the session stays there, again once it moved on and came back. "
    "Sessions that need you already when notify starts are not notified; after a reconnect "
    "(a daemon restart, a dropped watch) nothing notified or seen needing you before is "
    "notified again, and a session that came to need you while notify was away is notified "
    "once. --exec runs `sh -c CMD` with the session's fields as one line of JSON on stdin "
    "and as TOWERD_SESSION_ID, TOWERD_SESSION_NAME, TOWERD_AGENT, TOWERD_CWD, "
    "TOWERD_AGENT_SESSION_ID, TOWERD_ATTENTION, TOWERD_MESSAGE (and TOWERD_SOCKET) in its "
    "environment; commands run one at a time. Runs until SIGTERM or Ctrl-C (exit 0); a lost "
    "daemon is reconnected to, with backoff."
)


@COMMANDS.command(
    "notify",
    help="run a command, or notify-send, each time a session starts to need you",
    options=[
        arg(
            "--exec",
            dest="exec_command",
            default=None,
            metavar="CMD",
            help="a shell command line (run with sh -c) for each notification",
            local_path=True,
        ),
        arg(
            "--desktop",
            action="store_true",
            help='notify-send "towerd: NAME needs you" "MESSAGE" for each notification',
        ),
        arg(
            "--exec-timeout",
            type=Seconds(),
            default=30.0,
            metavar="SECONDS",
            help="kill a command (and what it started) still running after this long (default 30)",
        ),
    ],
    offline=True,
    raw=True,
    epilog=EPILOG,
)
def cmd_notify(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.notify import run_notify

    return run_notify(args)
