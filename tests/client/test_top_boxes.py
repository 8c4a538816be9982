"""`towerctl top` on a shared store: the fleet grouped by box, then by repository."""

from __future__ import annotations

from towerd.client.top_view import fleet_groups


def row(session_id: str, cwd: str, daemon_id: str) -> dict[str, object]:
    return {"session_id": session_id, "cwd": cwd, "daemon_id": daemon_id, "parent": None}


def test_rows_of_several_boxes_are_grouped_by_box_then_repository() -> None:
    snapshot = {"fleet": {"sessions": [
        row("s1", "/src/app", "bbbbbbbb-2"), row("s2", "/src/app", "aaaaaaaa-1"),
        row("s3", "/src/lib", "aaaaaaaa-1"),
    ], "activity": []}}  # fmt: skip
    groups = [(place, [m[1]["session_id"] for m in members])
              for place, members in fleet_groups(snapshot)]  # fmt: skip
    assert groups == [
        ("box aaaaaaaa /src/app", ["s2"]),
        ("box aaaaaaaa /src/lib", ["s3"]),
        ("box bbbbbbbb /src/app", ["s1"]),
    ]


def test_one_box_is_grouped_by_repository_alone() -> None:
    snapshot = {"fleet": {"sessions": [row("s1", "/src/app", "a"), row("s2", "/src/lib", "a")],
                          "activity": []}}  # fmt: skip
    assert [place for place, _ in fleet_groups(snapshot)] == ["/src/app", "/src/lib"]


def test_a_presence_in_the_future_is_shown_as_such() -> None:
    """`towerctl boxes`: a presence ahead of this box's clock (written while the server's
    clock was set ahead) read "0s ago", as if the box had just been seen."""
    from towerd.client.cli.ops import age

    assert age(1_000_000, 1_003_500) == "3s ago"
    assert age(1_262_000, 1_000_000) == "in 262s"
    assert age(0, 1_000_000) == "-"
