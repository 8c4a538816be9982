"""Commands that run a command exactly once or under a lock (``run``, ``effect run``,
``lock worktree``), and the ledgers behind them (``effects list|resolve``, ``leases``).

``run``, ``effect run`` and ``lock worktree`` live in towerd.client.exactly_once and
towerd.client.locks, imported when one of them runs (subprocess, selectors, hashlib
and dataclasses would cost ``effects list`` and ``leases``).
"""

from __future__ import annotations

from towerd.client.cli.output import EXIT_EPILOG, UsageError, json_arg, table
from towerd.client.cli.registry import REPO, Commands, arg
from towerd.client.cli.seconds import Seconds
from towerd.protocol import fields

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from towerd.client.cli.registry import Arg
    from towerd.client.sync import Client

COMMANDS = Commands()

# run, effect run and lock worktree: CMD's output is theirs, and so is the exit status.
RUNS_CMD: dict[str, Any] = {"offline": True, "raw": True, "epilog": EXIT_EPILOG}
LOCK_TTL_MS = 60_000  # lock worktree's lease, renewed every third of it
SETTLE_TIMEOUT = 300.0  # effects settle's answer waits for its probes (--timeout overrides)


def command_after_dashes(what: str) -> Arg:
    """The command after ``--``: everything after it is CMD's, options included."""
    return arg(
        "argv",
        nargs="...",  # argparse.REMAINDER, without importing argparse
        metavar="-- CMD ...",
        help=f"the command {what}, after -- (required)",
        local_path=True,  # passed to CMD byte for byte, never sent as text
    )


@COMMANDS.command(
    "run",
    help="run CMD at most once under an idempotency key: a retry after it ran prints the "
    "stored outcome and exits with the stored status without running it",
    options=[
        arg(
            "--key",
            default=None,
            help="(required) names what CMD does: the same on every retry, e.g. push:app#42",
        ),
        arg("--operation", default="shell", help="the key's operation (default: shell)"),
        arg(
            "--retry-failed",
            action="store_true",
            help="if an earlier run of this key completed with a non-zero exit status, run "
            "CMD again (the failed outcome is forgotten, and that is written to the operator "
            "log); a run that succeeded is still never run again",
        ),
        arg(
            "--probe",
            default=None,
            metavar="CMD",
            help="a shell command that tells whether CMD happened, stored with the key: if "
            "the outcome is lost (towerctl killed), the daemon runs it (sh -c, in this "
            "directory): exit 0 = it happened (the key completes), 1 = it did not (the key "
            "is released: the next run runs CMD), else cannot tell (tried again later); "
            "never while CMD or what it started still runs (they carry "
            "TOWERD_RUN_ATTEMPT in their environment)",
        ),
        command_after_dashes("to run once"),
    ],
    **RUNS_CMD,
)
def cmd_run(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.exactly_once import shell_run

    return shell_run(args)


COMMANDS.group("effect", "run an external effect through the ledger")


def _effect_run_options() -> list[Arg]:
    """Built only for ``effect run`` itself: the action kinds cost an import."""
    from towerd.protocol.naming import ACTION_KINDS

    return [
        arg("--run-id", default=None, help="(required) the run"),
        arg("--step", default=None, help="(required) the run's step"),
        arg(
            "--kind",
            default=None,
            choices=ACTION_KINDS,
            metavar="KIND",
            help=f"(required) one of {', '.join(ACTION_KINDS)}",
        ),
        arg("--target", default=None, help="(required) what it acts on, e.g. refs/heads/main"),
        arg("--attempt", default=None, metavar="ID", help="this attempt's id (default: minted)"),
        arg(
            "--payload",
            default=None,
            metavar="JSON",
            help="the effect's payload; every attempt must send the same (default: none)",
        ),
        arg(
            "--heartbeat",
            type=Seconds(),
            default=30.0,
            metavar="SECONDS",
            help="heartbeat interval while CMD runs (default: 30)",
        ),
        arg(
            "--lease-ttl",
            type=int,
            default=None,
            metavar="MS",
            help="the target lease's TTL, 5000-600000 (default: the daemon's, 300000)",
        ),
        arg(
            "--repo",
            default=None,
            metavar="PATH",
            help="git-push: the local repository (default: derived from CMD, else .)",
        ),
        arg(
            "--remote",
            default=None,
            metavar="REMOTE",
            help="git-push: the remote's name or URL (default: from CMD, else git's default)",
        ),
        arg(
            "--commit",
            default=None,
            metavar="REV",
            help="git-push: what is pushed (default: SRC of CMD's refspec, else HEAD)",
        ),
        arg(
            "--ref",
            default=None,
            metavar="REF",
            help="git-push: the destination ref (default: DST of CMD's refspec); the four "
            "let the daemon probe the remote if the outcome is lost",
        ),
        command_after_dashes("that does the effect"),
    ]


@COMMANDS.command(
    "effect",
    "run",
    help="run CMD as one external effect of a run: claim (with the target's lease for "
    "shared kinds), heartbeat while it runs, commit on exit 0, fail otherwise",
    options=_effect_run_options,
    **RUNS_CMD,
)
def cmd_effect_run(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.exactly_once import effect_run

    return effect_run(args)


COMMANDS.group("lock", "run a command holding a lock")


@COMMANDS.command(
    "lock",
    "worktree",
    help="run CMD holding the lock of the git repository (shared by all its worktrees); "
    "released when CMD ends or towerctl dies: no lockfile to go stale",
    options=[
        arg(
            "--timeout",
            dest="wait_timeout",
            type=Seconds(zero=True),
            default=30.0,
            metavar="S",
            help="seconds to wait for the lock (default: 30); then exit 121",
        ),
        REPO,
        arg(
            "--lease-ttl",
            type=int,
            default=LOCK_TTL_MS,
            metavar="MS",
            help=f"the lock's TTL, renewed every third of it (default: {LOCK_TTL_MS})",
        ),
        command_after_dashes("to run under the lock"),
    ],
    **RUNS_CMD,
)
def cmd_lock_worktree(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.locks import lock_worktree

    return lock_worktree(args)


COMMANDS.group("effects", "the effects ledger")


def probe_column(effect: dict[str, Any]) -> str:
    """What an effect's probe says: its last verdict, whether one can run, or that a
    person must decide."""
    probe = effect.get("probe")
    unsettled = effect.get("status") in ("in_flight", "uncertain")
    if not effect.get("git"):
        if effect.get("action_kind") == "git-push":
            return "not probeable: a person decides" if unsettled else "-"
        return "a person decides" if effect.get("status") == "uncertain" else "-"
    if probe is None:
        return "probeable" if unsettled else "-"
    text = f"{probe['verdict']} ({probe['attempts']}x)"
    return text + (", retried" if probe.get("next_at") and unsettled else "")


def render_effects(result: dict[str, Any]) -> str:
    rows = [
        {**effect, "updated_at": effect.get("completed_at") or effect.get("heartbeat_at"),
         "probe_shown": probe_column(effect)}
        for effect in result["effects"]
    ]  # fmt: skip
    return table(
        rows,
        [
            ("effect_key", "EFFECT_KEY"),
            ("action_kind", "KIND"),
            ("target_ref", "TARGET"),
            ("status", "STATUS"),
            ("attempt_id", "ATTEMPT"),
            ("updated_at", "UPDATED"),
            ("probe_shown", "PROBE"),
        ],
    )


@COMMANDS.command(
    "effects",
    "list",
    help="a run's effects, in claim order",
    render=render_effects,
    options=[arg("run_id", nargs="?", default=None, metavar="RUN_ID", help="(required)")],
)
def cmd_effects_list(client: Client, args: argparse.Namespace) -> Any:
    if args.run_id is None:
        # Optional in the parser only so that every command parses with no arguments.
        raise UsageError("effects list: give the RUN_ID whose effects to list")
    return client.effect_list(args.run_id)


@COMMANDS.command(
    "effects",
    "resolve",
    help="settle an uncertain effect after checking the outside world by hand",
    options=[
        arg("effect_key", nargs="?", default=None, metavar="KEY", help="(required) eff_..."),
        arg(
            "--outcome",
            default=None,
            choices=fields.EFFECT_OUTCOMES,
            help="(required) committed: it happened (give --receipt); aborted: it did not, "
            "a new attempt runs it afresh",
        ),
        arg("--receipt", default=None, metavar="JSON"),
    ],
)
def cmd_effects_resolve(client: Client, args: argparse.Namespace) -> Any:
    if args.effect_key is None or args.outcome is None:
        raise UsageError(
            "effects resolve: give the effect KEY and --outcome committed (it happened) "
            "or --outcome aborted (it did not)"
        )
    return client.effect_resolve(args.effect_key, args.outcome, json_arg(args.receipt, "--receipt"))


def _seen(outcome: dict[str, Any]) -> str:
    evidence = outcome.get("evidence")
    if not isinstance(evidence, dict):
        return "-"
    return str(evidence.get("seen") or evidence.get("error") or evidence.get("exit_status", "-"))


def render_settled(result: dict[str, Any]) -> str:
    rows = [
        {**outcome,
         "what": outcome.get("effect_key") or f"{outcome.get('operation')} {outcome.get('key')}",
         "seen": _seen(outcome)}
        for outcome in result["outcomes"]
    ]  # fmt: skip
    if not rows:
        return "nothing unsettled to probe"
    return table(
        rows,
        [("what", "EFFECT / KEY"), ("verdict", "VERDICT"), ("status", "NOW"), ("seen", "EVIDENCE")],
    )


@COMMANDS.command(
    "effects",
    "settle",
    help="run the evidence probes now: of these effects, or (none given) of every unsettled "
    "effect and every outcome_unknown key that has a probe; each verdict is recorded in the "
    "ledger and the operator log (waits up to --timeout, default 300 s, for the probes)",
    render=render_settled,
    options=[
        arg("effect_keys", nargs="*", default=[], metavar="KEY", help="eff_... (optional)"),
        arg("--run-id", default=None, metavar="RUN_ID", help="the unsettled effects of this run"),
    ],
)
def cmd_effects_settle(client: Client, args: argparse.Namespace) -> Any:
    if args.effect_keys and args.run_id:
        raise UsageError("effects settle: give effect KEYs or --run-id, not both")
    if args.timeout is None:
        client.timeout = SETTLE_TIMEOUT  # probes ask remotes: give them their own timeout
    return client.effect_settle(*args.effect_keys, run_id=args.run_id)


def render_leases(result: dict[str, Any]) -> str:
    return table(
        result["leases"],
        [
            ("resource", "RESOURCE"),
            ("fencing_token", "TOKEN"),
            ("holder", "HOLDER"),
            ("session_id", "SESSION"),
            ("acquired_at", "ACQUIRED"),
            ("expires_at", "EXPIRES"),
        ],
    )


@COMMANDS.command("leases", help="live leases", render=render_leases)
def cmd_leases(client: Client, _args: argparse.Namespace) -> Any:
    return client.lease_list()
