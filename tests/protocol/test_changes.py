"""The change notes `watch` pushes are Structs (protocol/changes.py), and docs/protocol.md
§16 lists each with its topic, tag and fields: the two must agree."""

from __future__ import annotations

from pathlib import Path

import msgspec

from towerd.protocol import changes
from towerd.protocol.methods import IdemRecord

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def documented_notes() -> dict[str, tuple[str, str, list[str]]]:
    """Note name -> (topic, op, fields) from the §16 "Change notes" table."""
    text = DOCS.read_text()
    table = text[text.index("**Change notes.**") :].split("\n\n")[1]
    notes = {}
    for line in table.splitlines()[2:]:
        name, topic, op, fields = (cell.strip().strip("`") for cell in line.strip("|").split("|"))
        names = [field.strip().strip("`") for field in fields.split(",") if field.strip()]
        notes[name] = (topic, op, names)
    return notes


def test_the_docs_list_every_note_struct_with_its_topic_tag_and_fields():
    documented = documented_notes()
    structs = {
        cls.__name__: (topic, cls)
        for topic, classes in changes.NOTES_BY_TOPIC.items()
        for cls in classes
        if cls.__module__ == changes.__name__ or cls.__name__ == "TrailEvent"
    }
    assert documented.keys() == structs.keys()
    for name, (topic, cls) in structs.items():
        doc_topic, doc_op, doc_fields = documented[name]
        assert doc_topic == topic, name
        tag = cls.__struct_config__.tag
        assert doc_op == (tag or ""), name
        assert doc_fields == list(cls.__struct_fields__), name


def test_idem_notes_of_every_kind_decode_as_their_union():
    """A consumer decodes a note by its tag, whatever it is."""
    record = IdemRecord("op", "k", "completed", "ref", None, 1, 2, None)
    for note in (
        changes.idem_changed("p", record),
        changes.IdemChanged("p", "op", "k", None),
        changes.IdemExpired(3),
    ):
        wire = msgspec.msgpack.encode(note)
        assert msgspec.msgpack.decode(wire, type=changes.IdemChange) == note
