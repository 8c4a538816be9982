"""relink(): the three rules of the docstring (and
of the seed's buildFleetWithoutReplacedRows)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from towerd.daemon.store.relink import relink


def assert_one_level_forest(order: Sequence[str], result: Mapping[str, str | None]) -> None:
    assert list(result) == list(order)
    for session_id, parent in result.items():
        if parent is not None:
            assert parent != session_id
            assert parent in result, f"{session_id} -> {parent}, a row that is not kept"
            assert result[parent] is None, f"{session_id} -> {parent}, which is not top-level"


# --- rule 1: links to dropped rows and rows not held
# -----------------------------------


def test_plain_links_to_top_level_rows_are_kept() -> None:
    """Nothing to fix: a valid one-level hierarchy comes back unchanged."""
    order = ["a", "b", "c", "d"]
    links = {"a": None, "b": "a", "c": "a", "d": None}
    assert relink(order, links) == links


def test_link_to_dropped_row_follows_to_its_survivor() -> None:
    """b -> old, and old was replaced by new: b now points at new."""
    order = ["new", "b"]
    links = {"old": None, "new": None, "b": "old"}
    assert relink(order, links, {"old": "new"}) == {"new": None, "b": "new"}


def test_row_that_replaced_its_own_parent_follows_that_parents_link() -> None:
    """child replaced its parent p (same agent session); it takes p's link g."""
    order = ["g", "child"]
    links = {"g": None, "p": "g", "child": "p"}
    assert relink(order, links, {"p": "child"}) == {"g": None, "child": "g"}


def test_replaced_own_parent_chain_is_followed_through_several_drops() -> None:
    """child replaced p1 and p2 (a chain of its own
    earlier rows): it takes the link beyond."""
    order = ["root", "child"]
    links = {"root": None, "p2": "root", "p1": "p2", "child": "p1"}
    replaced = {"p1": "child", "p2": "child"}
    assert relink(order, links, replaced) == {"root": None, "child": "root"}


def test_replaced_own_parent_whose_link_loops_back_becomes_top_level() -> None:
    """child replaced p, and p linked to child:
    the walk is bounded and child is top-level."""
    order = ["child"]
    links = {"p": "child", "child": "p"}
    assert relink(order, links, {"p": "child"}) == {"child": None}


def test_link_to_row_not_held_makes_the_row_top_level() -> None:
    """A link to an unknown row, or to a row dropped without a survivor, is cleared."""
    order = ["a", "b"]
    links = {"a": "nowhere", "b": "gone", "gone": None}
    assert relink(order, links) == {"a": None, "b": None}


def test_link_following_a_replacement_to_a_row_not_kept_is_cleared() -> None:
    """A replacement that points outside the kept rows leaves the row top-level."""
    assert relink(["a"], {"a": "old", "old": None}, {"old": "also-gone"}) == {"a": None}


# --- rule 2: cycles
# ---------------------------------------------------------------------


def test_self_link_becomes_top_level() -> None:
    """A row that names itself as parent is top-level."""
    assert relink(["a", "b"], {"a": "a", "b": "a"}) == {"a": None, "b": "a"}


def test_two_cycle_is_broken_at_the_first_written_row() -> None:
    """a <-> b: a was written first, so a becomes top-level and b stays under it."""
    assert relink(["a", "b"], {"a": "b", "b": "a"}) == {"a": None, "b": "a"}
    assert relink(["b", "a"], {"a": "b", "b": "a"}) == {"b": None, "a": "b"}


def test_three_cycle_is_broken_at_the_first_written_row_then_flattened() -> None:
    """x -> y -> z -> x with y first: y is
    top-level, z and x end up directly under y."""
    order = ["q", "y", "z", "x"]
    links = {"q": None, "x": "y", "y": "z", "z": "x"}
    assert relink(order, links) == {"q": None, "y": None, "z": "y", "x": "y"}


def test_several_disjoint_cycles_are_each_broken_at_their_first_row() -> None:
    """Two independent cycles and a tail hanging
    off one: each breaks at its own first row."""
    order = ["c1", "d1", "c2", "d2", "c3", "tail"]
    links = {
        "c1": "c2",
        "c2": "c3",
        "c3": "c1",  # cycle 1, first written c1
        "d1": "d2",
        "d2": "d1",  # cycle 2, first written d1
        "tail": "c3",
    }
    assert relink(order, links) == {
        "c1": None,
        "d1": None,
        "c2": "c1",
        "d2": "d1",
        "c3": "c1",
        "tail": "c1",
    }


def test_cycle_through_a_dropped_row_is_broken() -> None:
    """a -> old (replaced by b) and b -> a: the cycle a <-> b breaks at a."""
    order = ["a", "b"]
    links = {"a": "old", "old": None, "b": "a"}
    assert relink(order, links, {"old": "b"}) == {"a": None, "b": "a"}


# --- rule 3: flattening ---------------------------------------------------------------


def test_grandchildren_move_up_to_the_top_level_row() -> None:
    """A chain root <- a <- b <- c flattens to root with three direct children."""
    order = ["c", "b", "a", "root"]
    links = {"root": None, "a": "root", "b": "a", "c": "b"}
    assert relink(order, links) == {"root": None, "a": "root", "b": "root", "c": "root"}


def test_empty_fleet() -> None:
    """No rows, nothing to do."""
    assert relink([], {}) == {}


# --- termination and shape on adversarial input
# -------------------------------------------


def reference(
    order: Sequence[str], links: Mapping[str, str | None], replaced: Mapping[str, str]
) -> dict[str, str | None]:
    """A line-by-line port of the seed's
    buildFleetWithoutReplacedRows relinking steps."""
    position = {sid: i for i, sid in enumerate(order)}
    bound = len(links) + len(order)

    def surviving(sid: str) -> str | None:
        link = links.get(sid)
        step = 0
        while step < bound and link is not None:
            target = replaced.get(link, link)
            if target != sid:
                return target if target in position else None
            link = links.get(link)
            step += 1
        return None

    linked = {sid: surviving(sid) for sid in order}

    def cycle_start(sid: str) -> str | None:
        seen: list[str] = []
        current: str | None = sid
        step = 0
        while step <= bound and current is not None:
            if current in seen:
                return min(seen[seen.index(current) :], key=position.__getitem__)
            seen.append(current)
            current = linked[current]
            step += 1
        return None

    for sid in order:
        start = cycle_start(sid)
        if start is not None:
            linked[start] = None

    def top(sid: str) -> str:
        current = sid
        for _ in range(bound):
            parent = linked[current]
            if parent is None:
                return current
            current = parent
        return current

    return {sid: (None if top(sid) == sid else top(sid)) for sid in order}


@st.composite
def link_maps(
    draw: st.DrawFn,
) -> tuple[list[str], dict[str, str | None], dict[str, str]]:
    kept = [f"k{i}" for i in range(draw(st.integers(0, 12)))]
    dropped = [f"d{i}" for i in range(draw(st.integers(0, 6)))]
    kept = draw(st.permutations(kept))
    anything = (
        st.sampled_from([*kept, *dropped, "unknown1", "unknown2"])
        if kept or dropped
        else st.just("unknown1")
    )
    targets = st.one_of(st.none(), anything)
    links = {sid: draw(targets) for sid in [*kept, *dropped]}
    replaced: dict[str, str] = {}
    for sid in dropped:
        if kept and draw(st.booleans()):
            replaced[sid] = draw(st.sampled_from(kept))
    return kept, links, replaced


@settings(max_examples=400, deadline=None)
@given(link_maps())
def test_random_link_maps_give_a_one_level_forest_of_kept_rows(
    case: tuple[list[str], dict[str, str | None], dict[str, str]],
) -> None:
    """Property: on any input relink terminates with a one-level forest whose parents
    are kept top-level rows, and it agrees with the seed's reference algorithm."""
    order, links, replaced = case
    result = relink(order, links, replaced)
    assert_one_level_forest(order, result)
    assert result == reference(order, links, replaced)


@settings(max_examples=200, deadline=None)
@given(link_maps())
def test_valid_hierarchies_are_left_alone(
    case: tuple[list[str], dict[str, str | None], dict[str, str]],
) -> None:
    """Property: relinking an already relinked fleet changes nothing (idempotence)."""
    order, links, replaced = case
    once = relink(order, links, replaced)
    assert relink(order, once) == once


def test_long_chain_terminates_quickly() -> None:
    """A 20 000-row chain (and a cycle over all
    of it) is relinked in linear-ish time."""
    n = 20_000
    order = [f"r{i}" for i in range(n)]
    chain = {f"r{i}": (f"r{i - 1}" if i else None) for i in range(n)}
    result = relink(order, chain)
    assert result["r0"] is None
    assert all(result[f"r{i}"] == "r0" for i in range(1, n))
    loop = {**chain, "r0": f"r{n - 1}"}
    assert relink(order, loop) == result
