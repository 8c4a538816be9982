"""The ids the store mints: version 4 UUIDs as text, as ``str(uuid.uuid4())``."""

from __future__ import annotations

import os
import uuid

import pytest

from towerd.daemon.store.ids import random_uuid

pytestmark = pytest.mark.no_backend_param


def test_random_uuid_is_a_version_4_uuid_in_its_canonical_text() -> None:
    minted = [random_uuid() for _ in range(2000)]
    assert len(set(minted)) == len(minted)
    for text in minted:
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
        assert str(parsed) == text  # lower-case hex, dashes at 8-4-4-4-12


def test_a_forked_child_does_not_mint_its_parents_next_id() -> None:
    """Random bytes are read for many ids at once: a child forked after the parent read
    them must read its own, or both would mint the same ids."""
    random_uuid()  # the parent now holds unused random bytes
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.write(writer, random_uuid().encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    with os.fdopen(reader) as pipe:
        childs = pipe.read()
    assert childs and childs != random_uuid()
