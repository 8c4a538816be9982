"""The method table: every params/result Struct round
trips; validation is exact and path-bearing."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from towerd.protocol import methods as m
from towerd.protocol.envelope import (
    decode_request,
    decode_response,
    encode_request,
    encode_result,
)
from towerd.protocol.framing import FrameDecoder

SAMPLE_UUID = "0f0e0d0c-0b0a-4009-8807-060504030201"
ANY_VALUE = {"nested": [1, "two", None, True, 2.5, {"k": b"\x00\x01"}]}


# Fields a Struct refuses to have set together: the sample leaves these at their default.
EXCLUSIVE: dict[type, dict[str, Any]] = {
    m.DispatchRecentParams: {"worker_id": None},
    m.EffectClaimParams: {"git": None},  # git-push only: the sample's kind is another
}


def build(info: mi.Type, salt: int = 0) -> Any:
    """A valid value of a msgspec type, preferring
    non-null branches so every field is exercised."""
    if isinstance(info, mi.Metadata):
        return build(info.type, salt)
    if isinstance(info, mi.StructType):
        values = {f.name: build(f.type, salt + i) for i, f in enumerate(info.fields)}
        values.update(EXCLUSIVE.get(info.cls, {}))
        return info.cls(**values)
    if isinstance(info, mi.UnionType):
        non_null = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return build(non_null[0], salt) if non_null else None
    if isinstance(info, mi.StrType):
        if info.pattern is not None:
            samples = {
                m.UUID_PATTERN: SAMPLE_UUID,
                "^eff_[0-9a-f]{16}$": "eff_0123456789abcdef",
                "^/": f"/s{salt}",  # an absolute path
                "^[^/]+$": f"s{salt}",  # a dispatch unit type
                m.GIT_OBJECT_PATTERN: f"{salt:040x}",
                m.GIT_REF_PATTERN: f"refs/heads/s{salt}",
            }
            assert info.pattern in samples, info.pattern
            return samples[info.pattern]
        text = f"/s{salt}"  # a leading slash also makes it a valid absolute path
        if info.max_length is not None:
            text = text[: info.max_length]
        return text.ljust(info.min_length or 0, "x")
    if isinstance(info, mi.IntType):
        low = info.ge if info.ge is not None else 0
        value = max(low, 7 + salt)
        return min(value, info.le) if info.le is not None else value
    if isinstance(info, mi.BoolType):
        return True
    if isinstance(info, mi.LiteralType):
        return info.values[-1]
    if isinstance(info, mi.ListType):
        return [build(info.item_type, salt), build(info.item_type, salt + 1)]
    if isinstance(info, mi.DictType):
        return {"k": build(info.value_type, salt)}
    if isinstance(info, mi.AnyType):
        return ANY_VALUE
    if isinstance(info, mi.NoneType):
        return None
    raise AssertionError(f"no sample for {info!r}")


def sample(cls: type) -> Any:
    return build(mi.type_info(cls))


METHOD_TYPES = [
    pytest.param(name, role, getattr(spec, role), id=f"{name}:{role}")
    for name, spec in m.METHODS.items()
    for role in ("params", "result")
]


@pytest.mark.parametrize(("method", "role", "cls"), METHOD_TYPES)
def test_every_message_type_round_trips(method: str, role: str, cls: type) -> None:
    """For every method's params and result: a full
    valid instance encodes and decodes back equal."""
    value = sample(cls)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=cls)
    assert decoded == value
    # The sample sets every field away from its default, so nothing round trips by
    # omission.
    for field in msgspec.structs.fields(cls):
        if field.default is not msgspec.NODEFAULT and field.name not in EXCLUSIVE.get(cls, {}):
            assert getattr(decoded, field.name) != field.default, field.name


@pytest.mark.parametrize("method", sorted(m.METHODS))
def test_every_method_round_trips_through_the_envelope(method: str) -> None:
    """Params go out in a request frame and come back
    through params_decoder; results likewise."""
    spec = m.METHODS[method]
    params = sample(spec.params)
    wire_params = msgspec.to_builtins(params, builtin_types=(bytes,))
    [frame] = FrameDecoder().feed(encode_request(77, method, wire_params))
    request = decode_request(frame)
    assert (request.id, request.method) == (77, method)
    assert m.params_decoder(method).decode(request.params) == params

    result = sample(spec.result)
    [frame] = FrameDecoder().feed(encode_result(77, result))
    request_id, raw_result, error = decode_response(frame)
    assert (request_id, error) == (77, None)
    assert msgspec.convert(raw_result, spec.result) == result


def test_method_table_is_closed_and_consistent() -> None:
    """Every entry names Struct types; writes are
    flagged for exactly the mutating methods."""
    for name, spec in m.METHODS.items():
        assert issubclass(spec.params, msgspec.Struct), name
        assert issubclass(spec.result, msgspec.Struct), name
    writers = {name for name, spec in m.METHODS.items() if spec.writes}
    assert writers == {
        "session.register",
        "session.update",
        "session.remove",
        "fleet.write",
        "fleet.import_legacy",
        "fleet.adopt",
        "idem.claim",
        "idem.complete",
        "idem.release",
        "idem.mark_unknown",
        "idem.resolve",
        "idem.reopen",
        "hook.event",
        "path.claim",
        "path.release",
        "lease.acquire",
        "lease.renew",
        "lease.release",
        "effect.claim",
        "effect.heartbeat",
        "effect.commit",
        "effect.abort",
        "effect.fail",
        "effect.resolve",
        "effect.settle",
        "worker.register",
        "worker.heartbeat",
        "worker.stopping",
        "dispatch.claim",
        "dispatch.start",
        "dispatch.complete",
        "dispatch.fail",
        "dispatch.stuck",
        "dispatch.pause",
        "dispatch.cancel",
        "kv.set",
        "kv.delete",
        "event.record",
        "session.message",
        "message.ack",
    }


def decode_params(method: str, value: dict[str, Any]) -> Any:
    return m.params_decoder(method).decode(msgspec.msgpack.encode(value))


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("idem.claim", {"operation": "op", "key": 5}, "$.key"),
        (
            "idem.claim",
            {"operation": "op", "key": "k", "holder_pid": 0},
            "$.holder_pid",
        ),
        ("fleet.list", {"limit": "ten"}, "$.limit"),
        ("fleet.list", {"limit": 5001}, "$.limit"),
        ("fleet.get", {"session_id": "NOT-A-UUID"}, "$.session_id"),
        ("fleet.get", {"session_id": SAMPLE_UUID, "daemon_id": ""}, "$.daemon_id"),
        ("fleet.list", {"daemon_id": "d" * 65}, "$.daemon_id"),
        ("session.activity", {"daemon_id": 7}, "$.daemon_id"),
        ("fleet.restore_plan", {"daemon_id": ""}, "$.daemon_id"),
        (
            "fleet.write",
            {"sessions": [{"session_id": SAMPLE_UUID, "cwd": 1, "agent": "a"}]},
            "$.sessions[0].cwd",
        ),
        (
            "idem.resolve",
            {"operation": "op", "key": "k", "outcome": "maybe"},
            "$.outcome",
        ),
    ],
)
def test_validation_messages_carry_the_msgspec_path(method: str, params: dict, path: str) -> None:
    """A bad field is refused with ValidationError whose message ends "at `<path>`"."""
    with pytest.raises(msgspec.ValidationError) as caught:
        decode_params(method, params)
    assert f"at `{path}`" in str(caught.value)


def test_missing_required_field_names_it() -> None:
    """A missing required field is named in the error."""
    with pytest.raises(msgspec.ValidationError, match="missing required field `key`"):
        decode_params("idem.get", {"operation": "op"})


@pytest.mark.parametrize("method", ["idem.claim", "idem.complete", "idem.get", "idem.resolve"])
@pytest.mark.parametrize(
    "key",
    ["k", "x" * 255, "clé 🔑 with spaces", "a-b_c.d:e/f"],
)
def test_idempotency_keys_of_1_to_255_printable_characters_are_accepted(
    method: str, key: str
) -> None:
    """Keys of 1..255 printable characters (any script) are valid."""
    params = {"operation": "op", "key": key, "outcome": "abandoned"}
    assert decode_params(method, params).key == key


@pytest.mark.parametrize("method", ["idem.claim", "idem.complete", "idem.get", "idem.resolve"])
@pytest.mark.parametrize("key", ["", "x" * 256, "line\nbreak", "tab\there", "nul\x00", "bell\x07"])
def test_invalid_idempotency_keys_are_refused(method: str, key: str) -> None:
    """Empty, over-long, or non-printable keys raise
    ValidationError (never reach the store)."""
    with pytest.raises(msgspec.ValidationError):
        decode_params(method, {"operation": "op", "key": key, "outcome": "abandoned"})


@pytest.mark.parametrize("operation", ["", "o" * 129, "op\r"])
def test_invalid_operations_are_refused(operation: str) -> None:
    """Operations are 1..128 printable characters."""
    with pytest.raises(msgspec.ValidationError):
        decode_params("idem.claim", {"operation": operation, "key": "k"})


@pytest.mark.parametrize("key", ["", "k" * 256, "new\nline"])
def test_register_idempotency_key_is_validated_the_same_way(key: str) -> None:
    """session.register's idempotency_key obeys the same 1..255 printable rule."""
    with pytest.raises(msgspec.ValidationError):
        decode_params("session.register", {"cwd": "/w", "agent": "a", "idempotency_key": key})
    ok = decode_params(
        "session.register", {"cwd": "/w", "agent": "a", "idempotency_key": "k" * 255}
    )
    assert ok.idempotency_key == "k" * 255


def test_hello_principal_must_be_printable() -> None:
    """The hello principal is validated by the same printable rule."""
    with pytest.raises(msgspec.ValidationError):
        decode_params("hello", {"protocol": 1, "client": "t", "principal": "a\nb"})
    assert (
        decode_params("hello", {"protocol": 1, "client": "t", "principal": "ci"}).principal == "ci"
    )


def test_update_given_fields_distinguishes_absent_from_null() -> None:
    """Absent fields are not given; an explicit null is given as None (it clears)."""
    params = decode_params(
        "session.update",
        {"session_id": SAMPLE_UUID, "name": None, "pinned": True, "parent": None},
    )
    assert params.given_fields() == {"name": None, "pinned": True, "parent": None}
    assert decode_params("session.update", {"session_id": SAMPLE_UUID}).given_fields() == {}


def test_update_refuses_null_for_non_nullable_fields() -> None:
    """cwd and agent cannot be cleared: null for
    them is a validation error at their path."""
    for name in ("cwd", "agent", "pinned", "exited"):
        with pytest.raises(msgspec.ValidationError, match=rf"at `\$\.{name}`"):
            decode_params("session.update", {"session_id": SAMPLE_UUID, name: None})


def test_unknown_params_fields_are_ignored() -> None:
    """Newer clients' extra params fields do not break older daemons."""
    params = decode_params("fleet.get", {"session_id": SAMPLE_UUID, "future_flag": True})
    assert params == m.FleetGetParams(session_id=SAMPLE_UUID)


def test_session_id_must_be_a_lowercase_uuid() -> None:
    """Session ids are lowercase hyphenated UUIDs; uppercase is refused."""
    upper = str(uuid.uuid4()).upper()
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.session_id`"):
        decode_params("fleet.get", {"session_id": upper})
    lower = upper.lower()
    assert decode_params("fleet.get", {"session_id": lower}).session_id == lower


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("worker.register", {"project_root": "/a\0b"}),
        ("worker.register", {"project_root": "relative"}),
        ("worker.list", {"project_root": "/a\0b"}),  # found by the fuzzer: was internal
        ("worker.list", {"project_root": "relative"}),
        ("dispatch.recent", {"project_root": "/a\0b"}),
        ("dispatch.stuck_report", {"project_root": "x/y"}),
    ],
)
def test_project_roots_must_be_absolute_paths_without_nul(method: str, params: dict) -> None:
    """A path the daemon would resolve (realpath) is refused at the boundary: a NUL byte
    made os.path.realpath raise inside the handler, answered ``internal``."""
    with pytest.raises(msgspec.ValidationError, match="absolute path"):
        decode_params(method, params)


def test_a_dispatch_unit_type_has_no_slash() -> None:
    """The unit key is ``unit_type/unit_id``: ("x/y", "z") and ("x", "y/z") were two
    units to the unique index and the retry count, one to the stuck rules, so one unit
    could have two active dispatches (a tester's reproducer)."""
    claim = {"worker_id": "w", "lease_resource": "worker-lease:r", "fencing_token": 1,
             "unit_id": "y/z", "milestone_id": "m", "trace_id": "t"}  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="unit_type"):
        decode_params("dispatch.claim", {**claim, "unit_type": "x/y"})
    assert decode_params("dispatch.claim", {**claim, "unit_type": "x"}).unit_id == "y/z"


@pytest.mark.parametrize("method", ["path.claim", "path.release", "hook.event"])
@pytest.mark.parametrize(
    "path", ["/w/src/", "/w/src/../src", "/w//src", "/w/./src", "/w/src/.", "/w/a\0b"]
)
def test_a_leased_path_must_be_a_real_path(method: str, path: str) -> None:
    """A path lease is matched by name: a trailing slash or a ``..`` once made a granted
    lease that covered nothing (another agent's edit below it was allowed)."""
    params: dict[str, Any] = {"paths": [path]}
    if method == "hook.event":
        params |= {"kind": "PreToolUse", "agent": "claude"}
    with pytest.raises(msgspec.ValidationError, match="not a real path"):
        decode_params(method, params)


@pytest.mark.parametrize("path", ["/", "/w", "/w/src/a.py", "/w/.hidden", "/w/..x", "/w/a b"])
def test_real_paths_are_accepted_for_a_lease(path: str) -> None:
    assert decode_params("path.claim", {"paths": [path]}).paths == [path]


def test_protocol_md_method_table_lists_every_method_with_its_writes_flag() -> None:
    """docs/protocol.md section 6's table is derived by hand from ``METHODS``: each
    method once, no other, and its "Writes" column as the spec says (``idem.reopen``
    was once missing from it)."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    table = text.split("| Method | Writes | Summary |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    listed = {cells[1].strip().strip("`"): cells[2].strip() for cells in rows}
    assert len(listed) == len(rows), "a method is listed twice"
    assert set(listed) == set(m.METHODS)
    for name, spec in m.METHODS.items():
        assert listed[name] == ("yes" if spec.writes else "no"), name
