"""Optional coverage-guided, in-process fuzzing of towerd's protocol with atheris.

atheris (libFuzzer for Python) is not a project dependency; install it by hand::

    .venv/bin/pip install atheris
    .venv/bin/python bench/fuzz_atheris.py -runs=500000 -max_len=4096 /tmp/towerd-corpus

Each input is one frame payload (the bytes after the length prefix). The targets are
the pure-Python pieces the daemon runs on every byte a peer sends:

* ``framing``: ``FrameDecoder.feed`` on the input framed and split into chunks the
  input chooses, then on the input as a raw stream; frames must come out whole and in
  order, and the buffer must stay bounded;
* ``envelope``: ``envelope.decode_request`` may only return a ``Request`` (id in
  1..2**63-1, method a str) or raise ``MalformedRequest``;
* ``params``: every method's params decoder (as built from ``protocol.methods``) may
  only return the params struct or raise msgspec's ``ValidationError``/``DecodeError``;
* ``store``: what the store then does with accepted params, without SQLite:
  ``pack_canonical`` of an idem.claim payload or an idem.complete result must not
  raise, and every int in an int field of a store method's params must fit a SQLite
  INTEGER.

Anything else is a crash (atheris stops and saves the input). Known daemon bugs (see
``fuzz_inputs.KNOWN_BUGS``) stop it at once; ``--known-ok`` counts them instead, so
the run can look for new ones. ``--make-corpus DIR`` seeds DIR from the generator.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports(include=["towerd"]):
    import msgspec
    from msgspec import inspect as mi

    from towerd.daemon.store.tx import pack_canonical
    from towerd.protocol import FrameDecoder
    from towerd.protocol import methods as m
    from towerd.protocol.envelope import MAX_REQUEST_ID, MalformedRequest, decode_request

import fuzz_inputs as fi  # noqa: E402

MAX_FRAME = 4096  # small, so the fuzzer reaches the limit
DECODERS = {name: msgspec.msgpack.Decoder(spec.params) for name, spec in m.METHODS.items()}
SQLITE_MAX = 2**63 - 1
# the values the store hashes or compares in canonical form (daemon/store/idempotency.py)
CANONICAL = {m.IdemClaimParams: "payload", m.IdemCompleteParams: "result"}
NOT_STORED = {"hello", "ping", "status", "shutdown"}  # params that never reach the store
KNOWN: dict[str, int] = {}
OPTIONS = argparse.Namespace(known_ok=False, target="all")


class KnownBug(Exception):
    pass


def known(name: str) -> None:
    if not OPTIONS.known_ok:
        return
    count = KNOWN[name] = KNOWN.get(name, 0) + 1
    if count in (1, 10, 100, 1000, 10_000, 100_000):  # libFuzzer exits without atexit
        print(f"fuzz_atheris: known bug {name} hit {count} times", file=sys.stderr, flush=True)
    raise KnownBug(name)


# --- targets ----------------------------------------------------------------------------


def _reference_frames(stream: bytes, limit: int) -> tuple[list[bytes], bool]:
    frames = []
    offset = 0
    while len(stream) - offset >= 4:
        n = int.from_bytes(stream[offset : offset + 4], "big")
        if n > limit:
            return frames, True
        if len(stream) - offset - 4 < n:
            break
        frames.append(stream[offset + 4 : offset + 4 + n])
        offset += 4 + n
    return frames, False


def target_framing(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    cuts = fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 8), 0, 64)
    payload = fdp.ConsumeBytes(atheris.ALL_REMAINING)
    for stream in (fi.frame(payload) + fi.frame(payload[::-1]), payload):
        decoder = FrameDecoder(MAX_FRAME)
        got: list[bytes] = []
        offset = 0
        for cut in [*cuts, len(stream)]:
            chunk = stream[offset : offset + cut] if cut else stream[offset:]
            offset += len(chunk)
            got += decoder.feed(chunk)
            assert decoder.buffered <= MAX_FRAME + 4 or decoder.error is not None
            if offset >= len(stream):
                break
        got += decoder.feed(stream[offset:])
        expected, too_large = _reference_frames(stream, MAX_FRAME)
        assert got == expected, (got, expected)
        assert (decoder.error is not None) == too_large, (decoder.error, too_large)
        if decoder.error is not None:
            assert decoder.feed(b"\x00\x00\x00\x00") == []


def target_envelope(data: bytes) -> Any:
    try:
        request = decode_request(data)
    except MalformedRequest as exc:
        assert exc.code == "bad_frame" and 0 <= exc.request_id <= MAX_REQUEST_ID
        return None
    except RecursionError:
        known("deep-nesting-crash")  # the daemon dies on this (test_fuzz.py)
        raise
    assert 1 <= request.id <= MAX_REQUEST_ID and isinstance(request.method, str)
    return request


def target_params(data: bytes) -> list[Any]:
    """Every method's decoder on the params; returns those accepted by store methods."""
    request = target_envelope(data)
    if request is None:
        return []
    accepted = []
    for name, decoder in DECODERS.items():
        try:
            params = decoder.decode(request.params)
            if name not in NOT_STORED:
                accepted.append(params)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        except RecursionError:
            known("deep-nesting-crash")
            raise
    return accepted


def _int_fields(cls: type) -> tuple[list[str], list[str]]:
    """A params struct's int-typed fields, and its fields holding lists of structs."""
    ints, nested = [], []
    for f in mi.type_info(cls).fields:
        types = f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)
        if any(isinstance(t, mi.IntType) for t in types):
            ints.append(f.name)
        elif isinstance(f.type, mi.ListType) and isinstance(f.type.item_type, mi.StructType):
            nested.append(f.name)
    return ints, nested


_INT_FIELDS: dict[type, tuple[list[str], list[str]]] = {}


def _ints(value: msgspec.Struct) -> Any:
    """Every int in an int-typed field (these go to SQLite as INTEGER)."""
    cls = type(value)
    if cls not in _INT_FIELDS:
        _INT_FIELDS[cls] = _int_fields(cls)
    ints, nested = _INT_FIELDS[cls]
    for name in ints:
        item = getattr(value, name)
        if type(item) is int:
            yield item
    for name in nested:
        for item in getattr(value, name):
            yield from _ints(item)


def target_store(data: bytes) -> None:
    for params in target_params(data):
        for value in _ints(params):
            if value > SQLITE_MAX:
                known("int64-overflow")
                raise AssertionError(f"{type(params).__name__} accepted {value} > 2**63-1")
        name = CANONICAL.get(type(params))
        if name is not None and (value := getattr(params, name)) is not None:
            try:
                pack_canonical(value)
            except TypeError as exc:
                if "unhashable" in str(exc):
                    known("unhashable-canonical-key")
                raise
            except RecursionError:
                known("recursion-internal")
                raise


TARGETS = {
    "framing": target_framing,
    "envelope": target_envelope,
    "params": target_params,
    "store": target_store,
}


def test_one_input(data: bytes) -> None:
    targets = TARGETS.values() if OPTIONS.target == "all" else [TARGETS[OPTIONS.target]]
    for target in targets:
        try:
            target(data)
        except KnownBug:
            pass


# --- main -------------------------------------------------------------------------------


def make_corpus(directory: Path, count: int, seed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    gen = fi.Generator(seed, max_depth=64, huge=False)
    written = 0
    while written < count:
        item = gen.request(2 + written)
        data = item.data[4:] if isinstance(item, fi.Request) else item.data
        if len(data) <= 8192:
            (directory / f"seed-{written:05d}").write_bytes(data)
            written += 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments go to libFuzzer (e.g. -runs=N -max_len=N CORPUS_DIR).",
    )
    parser.add_argument("--target", choices=["all", *TARGETS], default="all")
    parser.add_argument("--known-ok", action="store_true", help="count known bugs, go on")
    parser.add_argument("--make-corpus", type=Path, help="write seed inputs to this dir")
    parser.add_argument("--corpus-size", type=int, default=300)
    args, rest = parser.parse_known_args()
    OPTIONS.known_ok = args.known_ok
    OPTIONS.target = args.target
    if args.make_corpus is not None:
        make_corpus(args.make_corpus, args.corpus_size, 1)
        rest.append(str(args.make_corpus))
    if not any(arg.startswith("-artifact_prefix=") for arg in rest):
        out = Path(tempfile.mkdtemp(prefix="towerd-atheris-"))
        rest.insert(0, f"-artifact_prefix={out}/")
        print(f"fuzz_atheris: crashing inputs go to {out}/", file=sys.stderr)
    atheris.Setup([sys.argv[0], *rest], test_one_input)
    atheris.Fuzz()  # libFuzzer exits the process


if __name__ == "__main__":
    main()
