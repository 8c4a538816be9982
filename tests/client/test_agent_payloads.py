"""What towerctl hook reads of an agent: its edit tools' target paths and its process
(client/agents.py), on real payload shapes and real process trees."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from towerd.client.agents import agent_process, edit_targets, resolve

PATCH = """*** Begin Patch
*** Add File: new.py
+x = 1
*** Update File: src/old.py
*** Move to: src/renamed.py
@@
-a
+b
*** Delete File: gone.py
*** End Patch
"""


@pytest.mark.parametrize(
    ("agent", "hook", "expected"),
    [
        ("claude", {"tool_name": "Edit", "tool_input": {"file_path": "/w/a.py"}}, ["/w/a.py"]),
        ("claude", {"tool_name": "MultiEdit", "tool_input": {"file_path": "a.py"}}, ["a.py"]),
        ("claude", {"tool_name": "Write", "tool_input": {"file_path": "b.py"}}, ["b.py"]),
        ("claude", {"tool_name": "NotebookEdit", "tool_input": {"notebook_path": "n.ipynb"}},
         ["n.ipynb"]),
        ("codex", {"tool_name": "apply_patch", "tool_input": {"command": PATCH}},
         ["new.py", "src/old.py", "src/renamed.py", "gone.py"]),
        # Codex names apply_patch Edit/Write as matcher aliases: the patch decides.
        ("codex", {"tool_name": "Edit", "tool_input": {"command": PATCH}},
         ["new.py", "src/old.py", "src/renamed.py", "gone.py"]),
        ("claude", {"tool_name": "Bash", "tool_input": {"command": "rm -rf build"}}, None),
        ("claude", {"tool_name": "Read", "tool_input": {"file_path": "a.py"}}, None),
        ("claude", {"tool_name": "Edit", "tool_input": {"file_path": ""}}, None),
        ("claude", {"tool_name": "Edit", "tool_input": {"file_path": "a\0b"}}, None),
        ("claude", {"tool_name": "Edit", "tool_input": "not a dict"}, None),
        ("claude", {"tool_name": 7, "tool_input": {}}, None),
        ("codex", {"tool_name": "apply_patch", "tool_input": {"command": 42}}, None),
        ("codex", {"tool_name": "apply_patch", "tool_input": {"command": "no headers"}}, None),
    ],
)  # fmt: skip
def test_edit_targets(agent, hook, expected):
    assert edit_targets(agent, hook) == expected


# Read as Codex's parser (codex-rs apply-patch parser.rs) reads them: the path guarded is
# the file Codex writes.
CODEX_READS = [
    # A name's leading spaces are the name's: " spaced.py" is another file than
    # "spaced.py" (the old reader stripped them, guarding the wrong file).
    ("*** Begin Patch\n*** Update File:  spaced.py\n@@\n-a\n+b\n*** End Patch",
     [" spaced.py"]),
    ("*** Begin Patch\n*** Update File: a.py\n*** Move to:  b.py\n@@\n-a\n+b\n*** End Patch",
     ["a.py", " b.py"]),
    # A hunk's content is never a header, even when it reads like one.
    ("*** Begin Patch\n*** Update File: a.py\n@@\n *** Update File: other.py\n-x\n+y\n"
     "*** End Patch", ["a.py"]),
    ("*** Begin Patch\n*** Add File: notes.md\n+*** Delete File: keep.py\n*** End Patch",
     ["notes.md"]),
    # Whitespace around a header line is trimmed, as Codex does; a Move line is taken as
    # written, on the line right after its Update header only.
    ("*** Begin Patch\n   *** Update File: a.py   \n@@\n-a\n+b\n*** End Patch", ["a.py"]),
    ("*** Begin Patch\n*** Update File: a.py\n@@\n-a\n+b\n*** Move to: c.py\n*** End Patch",
     ["a.py"]),
    # Lines split and trimmed as Rust's str::lines and str::trim do, not as Python's
    # splitlines and strip: a header line ending in a form feed, a stray \r or U+2028 is
    # still followed by its Move line (the first reader lost it: an unguarded move), and
    # a name keeps \x1f (not Rust whitespace) and an inner form feed.
    ("*** Begin Patch\n*** Update File: a.py\x0c\n*** Move to: b.py\n@@\n-x\n+y\n*** End Patch",
     ["a.py", "b.py"]),
    ("*** Begin Patch\r\n*** Update File: a.py\r\r\n*** Move to: b.py\r\n@@\r\n-x\r\n+y\r\n"
     "*** End Patch\r\n", ["a.py", "b.py"]),
    ("*** Begin Patch\n*** Update File: a.py\u2028\n*** Move to: b.py\n@@\n-x\n+y\n*** End Patch",
     ["a.py", "b.py"]),
    ("*** Begin Patch\n*** Add File: a.py\x1f\n+x\n*** Delete File: a\x0cb.py\n*** End Patch",
     ["a.py\x1f", "a\x0cb.py"]),
    # "*** End of File" ends a chunk, not the hunk: what follows is still its content.
    ("*** Begin Patch\n*** Update File: a.py\n@@\n-x\n*** End of File\n@@\n *** Add File: v.py\n"
     "+y\n*** Delete File: c.py\n*** End Patch", ["a.py", "c.py"]),
    # The heredoc wrapper Codex's lenient mode accepts.
    ("<<'EOF'\n*** Begin Patch\n*** Delete File: gone.py\n*** End Patch\nEOF", ["gone.py"]),
]  # fmt: skip


@pytest.mark.parametrize(("patch", "expected"), CODEX_READS)
def test_a_patch_is_read_as_codex_reads_it(patch, expected):
    hook = {"tool_name": "apply_patch", "tool_input": {"command": patch}}
    assert edit_targets("codex", hook) == expected


def test_resolve_takes_relative_paths_from_the_agents_cwd_and_follows_links(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert resolve("link/a.py", str(tmp_path)) == os.path.realpath(tmp_path / "real" / "a.py")
    assert resolve("/etc/../etc/hosts", "/nowhere") == os.path.realpath("/etc/hosts")


WHO = "from towerd.client.agents import agent_process; print(agent_process())"


def test_the_agent_is_the_nearest_ancestor_that_is_not_a_shell():
    """This test process runs sh -c 'env bash -c "python ..."': the python's nearest
    non-shell ancestor is this process (sh, env and bash are skipped)."""
    inner = f"{sys.executable} -c '{WHO}'; true"  # '; true' keeps each shell from exec'ing
    done = subprocess.run(
        ["sh", "-c", f'env bash -c "{inner}"; true'], capture_output=True, text=True, check=True
    )
    assert int(done.stdout) == os.getpid()
    assert agent_process(os.getpid()) == os.getpid()  # a start that is no shell is the agent
    assert agent_process(1) is None


def test_the_hooks_path_limits_are_the_daemons():
    """The hook keeps its own copies (it does not import the schema, for start-up time);
    a path it drops as too long must be one the daemon would refuse, and no shorter."""
    from towerd.client import agent_hook
    from towerd.protocol.schema import agents as schema

    assert agent_hook.MAX_PATH == schema.MAX_PATH_CHARS == 4095
    assert agent_hook.MAX_PATHS == schema.MAX_PATHS


@pytest.mark.parametrize(
    ("path", "wire"),
    [
        ("/w/a.py", "/w/a.py"),
        ("/w/caf\u00e9", "/w/caf\u00e9"),  # UTF-8: as it is
        (os.fsdecode(b"/w/caf\xe9"), "/w/caf\\xe9"),  # Latin-1 bytes: escaped per byte
        (os.fsdecode(b"/w/\xc3\xa9\xff"), "/w/\u00e9\\xff"),  # only the bytes that are not
        ("/w/\ud800.py", "/w/\ufffd.py"),  # a lone surrogate no name holds
    ],
)
def test_a_path_is_sent_as_utf8_text(path, wire):
    from towerd.client.agents import wire_path

    assert wire_path(path) == wire
    wire.encode("utf-8")


def test_half_a_utf16_pair_in_a_hooks_json_becomes_a_replacement_character():
    from towerd.client.agents import as_node_writes
    from towerd.client.hook_report import parse_json

    parsed = parse_json(b'["a\\ud800b", "\\udcff", "a\\uD83D\\uDE00b", "caf\\u00e9"]')
    assert [as_node_writes(text) for text in parsed] == [
        "a\ufffdb",
        "\ufffd",
        "a\U0001f600b",
        "caf\u00e9",
    ]
