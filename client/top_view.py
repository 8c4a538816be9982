"""How ``towerctl top`` draws a frame: pure functions from the dashboard's state to rich
renderables. No I/O and no clock (the time is passed in), so the same state always
draws the same screen; :mod:`towerd.client.top` owns the connections and the terminal.

The state is the ``watch`` snapshot's shape, topic by topic (daemon/store/snapshot.py):
``fleet`` {sessions, activity}, ``idem`` {keys, counts}, ``leases`` {leases},
``effects`` {effects}, ``dispatch`` {dispatches, workers}.

Whatever the daemon stores was written by someone else (a session named ``[/]``, a cwd
holding escape sequences), so two things hold for every frame: :func:`frame` first
passes the whole view through :func:`towerd.client.cli.printable` (no control character
reaches the terminal; each is shown as ``\\x1b``, ``\\n``...), and table cells are
``Text``, never parsed as rich markup (``[link=...]`` stays text). Markup appears only
in the fixed panel titles.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.layout import Layout
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from towerd.client.cli.output import printable

ATTENTION_STYLE = {"needs_you": "bold red", "running": "green", "done": "blue", "exited": "dim"}
ATTENTION_RANK = {"needs_you": 0, "running": 1, "done": 2, "exited": 3}
UNKNOWN = "outcome_unknown"
UNCERTAIN = "uncertain"
MARK = "\u203a"  # the selected row's marker (the row is also shown reversed)
FOOTER_LINES = 2
PANEL_CHROME = 3  # a panel's two border lines and its table's header line
WIDE, NARROW = 110, 90  # terminal widths below which the fleet drops MODEL and ID, LAST EVENT


@dataclass
class View:
    """Everything one frame shows."""

    snapshot: dict[str, Any]
    now_ms: int
    clock: str  # the local time, e.g. "14:02:11"
    daemon: dict[str, Any] = field(default_factory=dict)  # hello: daemon_id, owner_epoch
    stuck: list[dict[str, Any]] = field(default_factory=list)  # stuck reports with a verdict
    selected: tuple[str, ...] | None = None
    problem: str | None = None  # set while the daemon is unreachable
    updated: str | None = None  # when the shown state was read (local time)
    prompt: str | None = None
    message: tuple[str, str] | None = None  # (style, text): the outcome of the last action


@dataclass(frozen=True)
class Item:
    """A row the operator can select and resolve: an unknown key or an uncertain effect."""

    kind: str  # "key" or "effect"
    identity: tuple[str, ...]
    record: dict[str, Any]


# --- what the state holds ----------------------------------------------------------------------


def unknown_keys(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    keys = snapshot.get("idem", {}).get("keys", [])
    return [k for k in keys if k.get("state") == UNKNOWN]


def uncertain_effects(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    found = snapshot.get("effects", {}).get("effects", [])
    return [e for e in found if e and e.get("status") == UNCERTAIN]


PERSON = "a person decides"


def probe_verdict(effect: dict[str, Any]) -> str:
    """The PROBE cell of an uncertain effect: the evidence probe's last verdict, or that
    nothing can probe it and a person decides."""
    if not effect.get("git"):
        return PERSON
    probe = effect.get("probe")
    if probe is None:
        return "probe due"
    return f"{probe['verdict']}, {plural(probe['attempts'], 'try', 'tries')}"


def key_probe_verdict(key: dict[str, Any]) -> str:
    """The PROBE cell of an outcome_unknown key: its probe command's last verdict
    (``towerctl run --probe``), or that a person decides."""
    if not key.get("probe"):
        return PERSON
    if not key.get("probe_verdict"):
        return "probe due"
    return f"{key['probe_verdict']}, {plural(key.get('probe_attempts') or 0, 'try', 'tries')}"


def live_leases(snapshot: dict[str, Any], now_ms: int) -> list[dict[str, Any]]:
    """Leases lapse by the clock, without a change to push: drop the ones past due."""
    return [le for le in snapshot.get("leases", {}).get("leases", []) if le["expires_at"] > now_ms]


def selectable(snapshot: dict[str, Any]) -> list[Item]:
    """The unknown keys, then the uncertain effects: what Tab cycles through."""
    items = [
        Item("key", ("key", k["principal"], k["operation"], k["key"]), k)
        for k in unknown_keys(snapshot)
    ]
    items += [Item("effect", ("effect", e["effect_key"]), e) for e in uncertain_effects(snapshot)]
    return items


def _agent_gone(session: dict[str, Any]) -> bool:
    """Its agent process died without the session ending (what a restore brings back)."""
    return session.get("live") is False and not session.get("exited")


def attention_of(session: dict[str, Any], activity: dict[str, Any] | None) -> str:
    if activity is not None:
        return str(activity["attention"])
    return "exited" if session.get("exited") else "running"


def fleet_groups(
    snapshot: dict[str, Any],
) -> list[tuple[str, list[tuple[int, dict[str, Any], dict[str, Any] | None]]]]:
    """The fleet by repository (cwd, sorted): in each, top-level sessions by attention
    (needs you first) then newest activity, each followed by its sub-sessions. With
    rows of several boxes (a shared store), grouped by box first: ``box <id> <cwd>``."""
    fleet = snapshot.get("fleet", {})
    sessions = fleet.get("sessions", [])
    several_boxes = len({s.get("daemon_id") for s in sessions}) > 1

    def place(session: dict[str, Any]) -> str:
        if several_boxes:
            return f"box {short_id(session.get('daemon_id'))} {session['cwd']}"
        return str(session["cwd"])

    activity = {a["session_id"]: a for a in fleet.get("activity", [])}
    ids = {s["session_id"] for s in sessions}
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    tops = []
    for session in sessions:
        parent = session.get("parent")
        if parent in ids and parent != session["session_id"]:
            children[parent].append(session)
        else:
            tops.append(session)

    def order(session: dict[str, Any]) -> tuple[int, int, str]:
        act = activity.get(session["session_id"])
        rank = ATTENTION_RANK.get(attention_of(session, act), 1)
        last = (act or {}).get("last_activity_at") or 0
        return rank, -last, session.get("name") or session["session_id"]

    groups: dict[str, list[tuple[int, dict[str, Any], dict[str, Any] | None]]] = defaultdict(list)
    seen: set[str] = set()

    def add(cwd: str, session: dict[str, Any], depth: int) -> None:
        if session["session_id"] in seen:
            return
        seen.add(session["session_id"])
        groups[cwd].append((depth, session, activity.get(session["session_id"])))
        for child in sorted(children[session["session_id"]], key=order):
            add(cwd, child, depth + 1)

    for top in sorted(tops, key=order):
        add(place(top), top, 0)
    for session in sessions:  # a cycle of parents: still shown, at the top level
        add(place(session), session, 0)
    return sorted(groups.items())


# --- formatting --------------------------------------------------------------------------------


def ago(millis: int | None, now_ms: int) -> str:
    if not millis:
        return "never"
    return f"{span(max(0, now_ms - millis))} ago"


def until(millis: int, now_ms: int) -> str:
    return f"in {span(max(0, millis - now_ms))}"


def span(ms: int) -> str:
    seconds = ms // 1000
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def short_path(path: str, limit: int = 40) -> str:
    home = os.path.expanduser("~")
    if home not in ("", "/") and (path == home or path.startswith(home + "/")):
        path = "~" + path[len(home) :]
    return path if len(path) <= limit else "\u2026" + path[-(limit - 1) :]


def short_id(text: str | None, length: int = 8) -> str:
    return (text or "-")[:length]


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


# --- the frame ---------------------------------------------------------------------------------


def shown(value: Any) -> Any:
    """``value`` with every string in it (dict keys included) made :func:`printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {shown(key): shown(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(shown(item) for item in value)
    return value


def printable_view(view: View) -> View:
    """The view as a terminal may show it: the one place data is made safe to draw."""
    return dataclasses.replace(
        view, **{f.name: shown(getattr(view, f.name)) for f in dataclasses.fields(view)}
    )


def frame(view: View, width: int = 160, height: int | None = None) -> RenderableType:
    """The whole screen. With ``height`` (a live terminal) the footer is pinned to the
    bottom and the fleet is cut to fit; without, the frame is printed once, in full.
    A narrow ``width`` drops the fleet's least useful columns rather than squeeze all."""
    view = printable_view(view)
    header = _header(view)
    panels = _panels(view)
    if height is None:
        fleet = _fleet_panel(view, width, None)
        return Group(header, *_ordered(panels, fleet))
    header_lines = len(header.plain.split("\n"))
    used = header_lines + FOOTER_LINES + sum(lines for _, lines in panels.values())
    fleet = _fleet_panel(view, width, max(1, height - used - PANEL_CHROME))
    layout = Layout()
    layout.split_column(
        Layout(header, size=header_lines),
        Layout(Group(*_ordered(panels, fleet))),
        Layout(_footer(view), size=FOOTER_LINES),
    )
    return layout


def _ordered(panels: dict[str, tuple[RenderableType, int]], fleet: RenderableType) -> list[Any]:
    """What needs a decision first, then the fleet, then what is in motion."""
    order = [panels.get("keys"), panels.get("effects"), (fleet, 0)]
    order += [panels.get("leases"), panels.get("dispatch")]
    return [entry[0] for entry in order if entry is not None]


def _header(view: View) -> Text:
    snap, now = view.snapshot, view.now_ms
    daemon = view.daemon
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("towerd top", style="bold")
    text.append(f"  daemon {daemon.get('daemon_id', '?')}  epoch {daemon.get('owner_epoch', '?')}")
    text.append(f"  {view.clock}", style="bold")
    text.append("\n")
    groups = fleet_groups(snap)
    attention: dict[str, int] = defaultdict(int)
    sessions = 0
    for _cwd, rows in groups:
        for _depth, session, act in rows:
            sessions += 1
            attention[attention_of(session, act)] += 1
    text.append(
        f"{plural(sessions, 'session')} in {plural(len(groups), 'repository', 'repositories')}"
    )
    parts = [(attention[a], a.replace("_", " "), ATTENTION_STYLE[a]) for a in ATTENTION_RANK]
    text.append(": ")
    for i, (count, label, style) in enumerate(parts):
        text.append(f"{count} {label}", style=style if count else "dim")
        text.append(", " if i < len(parts) - 1 else "")
    counts = snap.get("idem", {}).get("counts", {})
    effects = snap.get("effects", {}).get("effects", [])
    in_flight = sum(1 for e in effects if e and e.get("status") == "in_flight")
    dispatches = len(snap.get("dispatch", {}).get("dispatches", []))
    text.append("\n")
    text.append(
        f"keys: {counts.get(UNKNOWN, 0)} unknown, {counts.get('in_progress', 0)} in progress"
        f" \u00b7 effects: {len(uncertain_effects(snap))} uncertain, {in_flight} in flight"
        f" \u00b7 {plural(len(live_leases(snap, now)), 'lease')}"
        f" \u00b7 {plural(dispatches, 'dispatch', 'dispatches')}"
    )
    if view.problem is not None:
        text.append("\n")
        text.append(
            f" daemon unreachable, retrying (showing the state read {view.updated or 'earlier'}):"
            f" {view.problem} ",
            style="bold white on red",
        )
    return text


class _TextTable(Table):
    """A table whose string cells are text as it is: never parsed as rich markup."""

    def add_row(self, *cells: RenderableType | None, **options: Any) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **options)


def _table(*columns: tuple[str, dict[str, Any]]) -> Table:
    table = _TextTable(
        box=None, header_style="bold", pad_edge=False, expand=True, padding=(0, 2, 0, 0)
    )
    for name, options in columns:
        table.add_column(name, no_wrap=True, overflow="ellipsis", **options)
    return table


def _panel(body: RenderableType, title: str, style: str) -> Panel:
    return Panel(body, title=title, title_align="left", border_style=style, padding=(0, 1))


def _marker(view: View, identity: tuple[str, ...]) -> tuple[str, str | None]:
    selected = view.selected == identity
    return (MARK if selected else " "), ("reverse" if selected else None)


def _panels(view: View) -> dict[str, tuple[RenderableType, int]]:
    """The panels shown only when they have rows, with their heights in lines."""
    snap, now = view.snapshot, view.now_ms
    panels: dict[str, tuple[RenderableType, int]] = {}

    keys = unknown_keys(snap)
    if keys:
        table = _table(
            ("", {"width": 1}),
            ("PRINCIPAL", {"max_width": 24}),
            ("OPERATION", {}),
            ("KEY", {}),
            ("EFFECT REF", {"ratio": 1}),  # the one flexible column takes the spare width
            ("PROBE", {}),
            ("AGE", {"justify": "right"}),
        )
        waiting = 0
        for key in keys:
            mark, style = _marker(view, ("key", key["principal"], key["operation"], key["key"]))
            verdict = key_probe_verdict(key)
            waiting += verdict == PERSON
            table.add_row(
                mark,
                key["principal"],
                key["operation"],
                key["key"],
                key.get("effect_ref") or "-",
                verdict,
                ago(key.get("updated_at"), now),
                style=style,
            )
        title = (
            f"[bold red]outcome unknown: {plural(len(keys), 'key')}[/] "
            f"({waiting} waiting for a person: did it run? check, then r; the rest are probed)"
        )
        panels["keys"] = (_panel(table, title, "red"), PANEL_CHROME + len(keys))

    effects = uncertain_effects(snap)
    if effects:
        table = _table(("", {"width": 1}), ("EFFECT", {}), ("KIND", {}), ("TARGET", {}),
                       ("RUN / STEP", {"ratio": 1}), ("PROBE", {}),
                       ("SINCE", {"justify": "right"}))  # fmt: skip
        waiting = 0
        for eff in effects:
            mark, style = _marker(view, ("effect", eff["effect_key"]))
            verdict = probe_verdict(eff)
            waiting += verdict == PERSON
            table.add_row(mark, eff["effect_key"], eff["action_kind"], eff["target_ref"],
                          f"{eff['run_id']} / {eff['step_id']}", verdict,
                          ago(eff.get("heartbeat_at"), now), style=style)  # fmt: skip
        title = (
            f"[bold magenta]uncertain effects: {len(effects)}[/] "
            f"({waiting} waiting for a person: check the target, then r; the rest are probed)"
        )
        panels["effects"] = (_panel(table, title, "magenta"), PANEL_CHROME + len(effects))

    leases = live_leases(snap, now)
    if leases:
        table = _table(("RESOURCE", {}), ("TOKEN", {"justify": "right"}), ("HOLDER", {"ratio": 1}),
                       ("EXPIRES", {"justify": "right"}))  # fmt: skip
        for lease in leases:
            table.add_row(lease["resource"], str(lease["fencing_token"]), lease["holder"],
                          until(lease["expires_at"], now))  # fmt: skip
        title = f"leases: {len(leases)} held"
        panels["leases"] = (_panel(table, title, "cyan"), PANEL_CHROME + len(leases))

    dispatch = snap.get("dispatch", {})
    active = dispatch.get("dispatches", [])
    if active or view.stuck:
        open_workers = {w["worker_id"] for w in dispatch.get("workers", [])}
        parts: list[RenderableType] = []
        lines = 2
        if active:
            table = _table(("UNIT", {}), ("STATUS", {}), ("WORKER", {}),
                           ("ATTEMPT", {"justify": "right"}), ("SINCE", {"justify": "right"}),
                           ("TRACE", {"ratio": 1}))  # fmt: skip
            for d in active:
                worker = Text(short_id(d["worker_id"], 12))
                if d["worker_id"] not in open_workers:
                    worker = Text(f"{short_id(d['worker_id'], 12)} (gone)", style="bold red")
                since = d.get("started_at") or d.get("claimed_at")
                table.add_row(d["unit_key"], d["status"], worker,
                              f"{d['attempt_n']}/{d['max_attempts']}", ago(since, now),
                              d.get("trace_id") or "-")  # fmt: skip
            parts.append(table)
            lines += 1 + len(active)
        for report in view.stuck:
            verdict = report["verdict"]
            parts.append(
                Text(
                    f"\u26a0 stuck loop in {short_path(report['project_root'], 60)}: "
                    f"{verdict['reason']} ({verdict['rule']})",
                    style="bold yellow",
                    no_wrap=True,
                    overflow="ellipsis",
                )
            )
            lines += 1
        title = f"dispatch: {len(active)} active" + (", stuck" if view.stuck else "")
        panels["dispatch"] = (
            _panel(Group(*parts), title, "yellow" if view.stuck else "blue"),
            lines,
        )
    return panels


def _fleet_panel(view: View, width: int, max_rows: int | None) -> Panel:
    now = view.now_ms
    groups = fleet_groups(view.snapshot)
    if not groups:
        return _panel(Text("no sessions registered", style="dim"), "fleet", "green")
    rows = [
        (cwd, depth, session, act) for cwd, members in groups for depth, session, act in members
    ]
    hidden = 0
    if max_rows is not None and len(rows) > max_rows:
        # Cut exited sessions first, then from the end: keep what is live on screen.
        exited = [attention_of(r[2], r[3]) == "exited" for r in rows]
        order = [i for i in range(len(rows)) if not exited[i]] + [
            i for i in range(len(rows)) if exited[i]
        ]
        chosen = set(order[: max(0, max_rows - 1)])
        hidden = len(rows) - len(chosen)
        rows = [row for i, row in enumerate(rows) if i in chosen]
    columns: list[tuple[str, dict[str, Any]]] = [
               ("REPOSITORY", {"max_width": 42, "style": "bold cyan"}),
               ("SESSION", {"max_width": 32}), ("AGENT", {}), ("STATE", {}),
               ("ACTIVITY", {"justify": "right"}), ("LAST EVENT", {}), ("MODEL", {}),
               ("ID", {})]  # fmt: skip
    shown = len(columns) if width >= WIDE else 6 if width >= NARROW else 5
    table = _table(*columns[:shown])
    last = None
    for cwd, depth, session, act in rows:
        label, last = (short_path(cwd) if cwd != last else ""), cwd
        state = attention_of(session, act)
        style = ATTENTION_STYLE.get(state, "")
        name = session.get("name") or short_id(session["session_id"])
        name = ("  " * (depth - 1) + "\u2514 " + name) if depth else name
        row_style = "dim" if state == "exited" else None
        cells = [
            label,
            name,
            session.get("agent") or "-",
            Text(
                state.replace("_", " ") + (", agent gone" if _agent_gone(session) else ""),
                style=style,
            ),
            ago((act or {}).get("last_activity_at"), now),
            (act or {}).get("last_kind") or "-",
            session.get("model") or "-",
            short_id(session["session_id"]),
        ][:shown]
        table.add_row(*cells, style=row_style)
    sessions = sum(len(m) for _, m in groups)
    title = f"fleet: {plural(sessions, 'session')} by repository"
    if view.snapshot.get("fleet", {}).get("truncated"):
        title += " (the daemon sent the first 500)"
    if not hidden:
        return _panel(table, title, "green")
    more = Text(f"\u2026 {hidden} more, exited first (a taller terminal shows them)", style="dim")
    return _panel(Group(table, more), title, "green")


def _footer(view: View) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    if view.prompt is not None:
        text.append(view.prompt, style="bold yellow")
    elif view.message is not None:
        style, message = view.message
        text.append(message, style=style)
    text.append("\n")
    text.append("q", style="bold")
    text.append(" quit   ")
    if selectable(view.snapshot):
        for key, what in (("Tab/n", "next"), ("\u2191\u2193/j k", "move"), ("r", "resolve"),
                          ("Esc", "clear")):  # fmt: skip
            text.append(key, style="bold")
            text.append(f" {what}   ")
    text.append("live over watch", style="dim")
    return text
