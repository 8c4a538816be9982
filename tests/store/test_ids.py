"""The ids the store mints: version 4 UUIDs as text, as ``str(uuid.uuid4())``."""

from __future__ import annotations

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
