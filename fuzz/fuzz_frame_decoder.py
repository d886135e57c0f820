#!/usr/bin/env python3
"""Fuzz target: the peer frame decoder and the local API reader must never crash.

Why: both decoders face bytes from outside (peers over TCP, any local process that can
open the socket). The contract is that *any* input either decodes or raises the
documented typed error, never anything else, and never hangs:

- peer wire (`convergenced.core.wire`): ``FrameDecoder`` + ``decode_message`` raise only
  ``RemoteProtocolError`` with one of the reasons of PROTOCOL.md section 16;
- local API (`convergenced.core.local_api_codec`): ``FrameReader`` + ``parse_request`` raise only
  ``ApiError`` of kind ``bad_request``.

Beyond "no crash", every message that decodes must survive a round trip
(``encode_message`` then decode gives an equal message, and each record's canonical
body and fingerprint can be computed), and every error must be reportable (its reply or
BYE can be encoded). A violation is a finding.

One input is one byte string: the first byte selects the target and how to feed it,
the rest is the payload::

    bit 0      target: 0 peer wire, 1 local API
    bit 1      fix the length field (header length / u32 prefix) to match the payload,
               so mutations reach the body decoders instead of stalling on the length
    bits 2-7   chunk size: 0 feeds everything at once, n feeds n bytes at a time

Engines:

- ``atheris`` (coverage-guided libFuzzer, if installed): ``--engine atheris``;
- ``random``: a mutation loop seeded from the golden vectors (byte flips, interesting
  bytes, truncations, insertions, splices, repeated chunks, and structure-aware edits
  of the msgpack body), no dependency beyond the project.

Run ``python fuzz/fuzz_frame_decoder.py --help``; see fuzz/README.md. Not part of
``make test`` (tests/test_security.py runs a short smoke pass over the seeds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import msgpack

from convergenced.core import local_api_codec as codec
from convergenced.core import wire
from convergenced.core.errors import RemoteProtocolError
from convergenced.core.messages import Bye, Message, MessageType, Tick, Tock

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "proto" / "vectors"
DEFAULT_WORK_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "convergenced-fuzz"
MAX_INPUT = 1 << 16
SLOW_INPUT_S = 2.0
"""An input that takes longer than this is reported as a (possible) hang."""
HANG_S = 10
"""Hard limit per input in the random engine (SIGALRM)."""

WIRE_REASONS = frozenset(
    {
        "bad_magic",
        "unsupported_version",
        "unknown_type",
        "bad_flags",
        "frame_too_large",
        "malformed_body",
        "invalid_field",
        "limit_exceeded",
    }
)
"""The codec's reasons (PROTOCOL.md section 16; the link-level ones cannot come from it)."""
API_REASONS = frozenset(
    {"bad_request", "unknown_op", "bad_spec", "frame_too_large", "undecodable", "too_many_objects"}
)
"""Reasons of parse errors of the local API (LOCAL_API.md)."""

WIRE_LIMITS = wire.WireLimits()
API_MAX_FRAME = 1 << 20
API_BUDGET = codec.DecodeBudget.for_requests(4096)
"""The decode budget of a daemon with the default limits.max_members."""


class Finding(AssertionError):
    """A contract violation found by the harness (not a typed decoder error)."""


@dataclass
class Outcomes:
    """What the inputs did, for the run report."""

    by_label: Counter[str] = field(default_factory=Counter)
    longest_error: int = 0

    def note(self, label: str, message: str = "") -> None:
        self.by_label[label] += 1
        self.longest_error = max(self.longest_error, len(message))


OUTCOMES = Outcomes()


# -- the target -------------------------------------------------------------------


def _chunks(data: bytes, size: int) -> Iterator[bytes]:
    if size <= 0:
        yield data
        return
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _fix_length(payload: bytes, api_target: bool) -> bytes:
    if api_target:
        if len(payload) < 4:
            return payload
        return codec.LENGTH.pack(len(payload) - 4) + payload[4:]
    if len(payload) < wire.HEADER_SIZE:
        return payload
    n = len(payload) - wire.HEADER_SIZE
    return payload[:8] + n.to_bytes(4, "big") + payload[12:]


def check_wire(payload: bytes, chunk: int) -> None:
    """Feed ``payload`` to a FrameDecoder and decode every frame; enforce the contract."""
    decoder = wire.FrameDecoder(WIRE_LIMITS)
    try:
        for piece in _chunks(payload, chunk):
            decoder.feed(piece)
            while (frame := decoder.next_frame()) is not None:
                kind, body = frame
                message = wire.decode_message(kind, body, WIRE_LIMITS)
                _round_trip(kind, message)
                OUTCOMES.note(f"wire ok {kind.name}")
    except RemoteProtocolError as exc:
        if exc.reason not in WIRE_REASONS:
            raise Finding(f"wire: unexpected reason {exc.reason!r}: {exc}") from exc
        # The daemon answers with a BYE naming the reason: that must always encode.
        wire.encode_message(Bye(reason=exc.reason))
        OUTCOMES.note(f"wire rejected {exc.reason}", str(exc))
        return
    if decoder.buffered > WIRE_LIMITS.max_frame_bytes + wire.HEADER_SIZE:
        raise Finding(f"wire: {decoder.buffered} bytes buffered above the frame limit")
    OUTCOMES.note("wire incomplete" if decoder.buffered else "wire consumed")


def _round_trip(kind: MessageType, message: Message) -> None:
    if isinstance(message, Tick | Tock):
        for record in message.records:
            record.body_bytes()
            if len(record.fingerprint) != 16:
                raise Finding("record fingerprint is not 16 bytes")
    frame = wire.encode_message(message)
    again = wire.FrameDecoder(WIRE_LIMITS)
    again.feed(frame)
    got = again.next_frame()
    if got is None or got[0] is not kind:
        raise Finding(f"wire: re-encoded {kind.name} does not frame back")
    back = wire.decode_message(got[0], got[1], WIRE_LIMITS)
    if back != message:
        raise Finding(f"wire: {kind.name} changes in a round trip: {message!r} -> {back!r}")


def check_api(payload: bytes, chunk: int) -> None:
    """Feed ``payload`` to the local API reader and parse every request."""
    reader = codec.FrameReader(API_MAX_FRAME, budget=API_BUDGET)  # as the daemon reads
    try:
        for piece in _chunks(payload, chunk):
            for obj in reader.feed(piece):
                try:
                    request = codec.parse_request(obj)
                except codec.ApiError as exc:
                    _check_api_error(exc)
                    continue
                OUTCOMES.note(f"api ok {request.op}")
    except codec.ApiError as exc:
        _check_api_error(exc)
        return
    OUTCOMES.note("api incomplete" if reader.buffered else "api consumed")


def _check_api_error(exc: codec.ApiError) -> None:
    if exc.kind is not codec.ErrorKind.BAD_REQUEST or exc.reason not in API_REASONS:
        raise Finding(f"api: unexpected error kind/reason {exc.kind}/{exc.reason}: {exc}") from exc
    codec.encode_frame(codec.error(exc.request_id, exc))  # the reply must always encode
    OUTCOMES.note(f"api rejected {exc.reason}", str(exc))


def one_input(data: bytes) -> None:
    """The fuzz entry point: decode the selector byte, run the chosen target.

    Raises:
        Finding: or any other exception: a bug (the decoders' typed errors are caught).
    """
    if not data:
        return
    selector, payload = data[0], data[1:]
    api_target = bool(selector & 1)
    if selector & 2:
        payload = _fix_length(payload, api_target)
    chunk = selector >> 2
    if api_target:
        check_api(payload, chunk)
    else:
        check_wire(payload, chunk)


def make_input(payload: bytes, *, api_target: bool, fix: bool = False, chunk: int = 0) -> bytes:
    """Build an input from its parts (the inverse of `one_input`'s selector)."""
    return bytes([(chunk & 0x3F) << 2 | fix << 1 | api_target]) + payload


# -- seeds ------------------------------------------------------------------------


def _api_seed_requests() -> list[dict[str, Any]]:
    spec = {
        "name": "llama-70b",
        "members": {"node-a": [0, 1], "node-b": [2, 3]},
        "policy": {"mode": "all", "domains": ["nvme"]},
        "retention": 2,
    }
    return [
        codec.request(1, "status"),
        codec.request(2, "streams"),
        codec.request(3, "declare", spec=spec),
        codec.request(
            4, "commit", stream="llama-70b", rank=0, domain="nvme", epoch=42, digest="ab", size=9
        ),
        codec.request(5, "retract", stream="llama-70b", rank=1, domain="nvme", epoch=41),
        codec.request(6, "retire", stream="llama-70b", rank=1, domain="s3", epoch=3),
        codec.request(7, "state", stream="llama-70b"),
        codec.request(8, "wait", stream="llama-70b", epoch=42, timeout=1.5),
        codec.request(9, "restore_point", stream="llama-70b", generation=2, timeout=0),
        codec.request(10, "watch", stream="llama-70b"),
        codec.request(11, "cancel", target=10),
    ]


def seeds() -> list[bytes]:
    """Inputs built from the golden vectors and one request per local API operation."""
    out: list[bytes] = []
    for name in ("messages.json", "malformed.json"):
        doc = json.loads((VECTORS / name).read_text(encoding="utf-8"))
        for vector in doc["vectors"]:
            frame = bytes.fromhex(vector["hex"])
            out.append(make_input(frame, api_target=False))
            out.append(make_input(frame, api_target=False, chunk=1))
    requests = _api_seed_requests()
    for req in requests:
        out.append(make_input(codec.encode_frame(req), api_target=True))
    out.append(
        make_input(b"".join(codec.encode_frame(r) for r in requests), api_target=True, chunk=7)
    )
    return out


# -- mutations ----------------------------------------------------------------------

INTERESTING_BYTES = bytes.fromhex(
    "00017f80ffc0c1c2c3c4c5c6cacbcccdcecfd0d3d4d8d9dadbdcdddedf909f8fa0bfe0"
)
"""msgpack type bytes and boundary values."""

INTERESTING_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**7, 2**8, 2**16, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
    2**64 - 1, -(2**63), 1.5, math.nan, math.inf, -0.0, "", "x", "node-a", "a" * 129,
    "bad name", "node\n", "\u00e9", "\u202e", b"", b"\x00" * 16,
    b"\xff" * 32, b"\x00" * 64, [], {}, [[]], {"": None}, list(range(20)), [0, 5, 3, 9],
    [5, 1], [0, 0, 1, 1], [[1, 2]], ["z", "a"],
]  # fmt: skip
"""Values the structure-aware mutator plants in decoded bodies."""


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.6 or depth > 3:
        return rng.choice(INTERESTING_VALUES)
    if roll < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if roll < 0.85:
        return {rng.choice(["seq", "digest", "match", "records", "x", "id", "op", "args"]): 0}
    if roll < 0.95:
        nested: Any = 0
        for _ in range(rng.randrange(1, 200)):
            nested = [nested]
        return nested
    return rng.getrandbits(rng.choice([8, 32, 64]))


def _mutate_tree(rng: random.Random, obj: Any) -> Any:
    """Replace, delete or duplicate one node of a decoded msgpack tree."""
    if isinstance(obj, list) and obj and rng.random() < 0.7:
        i = rng.randrange(len(obj))
        roll = rng.random()
        out = list(obj)
        if roll < 0.5:
            out[i] = _mutate_tree(rng, obj[i])
        elif roll < 0.65:
            del out[i]
        elif roll < 0.8:
            out.insert(i, obj[i])
        elif roll < 0.9:
            out[i:i] = [obj[i]] * rng.randrange(2, 300)
        else:
            rng.shuffle(out)
        return out
    if isinstance(obj, dict) and obj and rng.random() < 0.7:
        key = rng.choice(list(obj))
        out_map = dict(obj)
        roll = rng.random()
        if roll < 0.6:
            out_map[key] = _mutate_tree(rng, obj[key])
        elif roll < 0.75:
            del out_map[key]
        elif roll < 0.9:
            out_map[rng.choice(["extra", 1, b"bin", "seq", "args"])] = _random_value(rng)
        else:
            out_map[key] = _random_value(rng)
        return out_map
    return _random_value(rng)


def _structured(rng: random.Random, payload: bytes, api_target: bool) -> bytes | None:
    """Decode the first frame's body, mutate the tree, re-encode with a correct length."""
    head = 4 if api_target else wire.HEADER_SIZE
    if len(payload) <= head:
        return None
    try:
        obj = msgpack.unpackb(payload[head:], raw=False, strict_map_key=False)
        body = bytes(msgpack.packb(_mutate_tree(rng, obj), use_bin_type=True))
    except Exception:  # not decodable (a malformed seed) or not re-packable: skip
        return None
    if api_target:
        return codec.LENGTH.pack(len(body)) + body
    return payload[:8] + len(body).to_bytes(4, "big") + body


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """One to four random edits of an input (selector byte included)."""
    if not data:
        return rng.choice(pool)
    selector, payload = data[0], bytearray(data[1:])
    api_target = bool(selector & 1)
    head = 4 if api_target else wire.HEADER_SIZE
    if rng.random() < 0.3:
        # Structure-aware only: well-formed msgpack with wrong types, values, keys, so
        # the field validators (not just the unpacker) see most of these inputs.
        edited: bytes | None = bytes(payload)
        for _ in range(rng.randrange(1, 4)):
            edited = _structured(rng, edited, api_target) if edited is not None else None
        if edited is not None:
            return bytes([selector & ~2]) + edited
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(12)
        n = len(payload)
        # Point edits mostly land in the body: a broken header ends decoding at once.
        lo = head if n > head and rng.random() < 0.8 else 0
        if op == 0 and n:
            payload[rng.randrange(lo, n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            payload[rng.randrange(lo, n)] = rng.choice(INTERESTING_BYTES)
        elif op == 2 and n:
            payload[rng.randrange(lo, n)] = rng.randrange(256)
        elif op == 3 and n:
            del payload[rng.randrange(n) :]
        elif op == 4:
            at = rng.randrange(n + 1)
            payload[at:at] = rng.randbytes(rng.randrange(1, 9))
        elif op == 5 and n:
            a = rng.randrange(n)
            del payload[a : a + rng.randrange(1, 17)]
        elif op == 6 and n:
            a = rng.randrange(n)
            piece = payload[a : a + rng.randrange(1, 33)]
            payload[a:a] = piece * rng.randrange(1, 64)
        elif op == 7:
            other = rng.choice(pool)[1:]
            cut = rng.randrange(len(payload) + 1)
            payload = payload[:cut] + other[rng.randrange(len(other) + 1) :]
        elif op == 8:
            payload += rng.choice(pool)[1:]
        elif op == 9:
            edited = _structured(rng, bytes(payload), api_target)
            if edited is not None:
                payload = bytearray(edited)
        elif op == 10 and n >= 4:
            at = rng.randrange(n - 3)
            value = rng.choice([0, 1, 0x7F, 0x80, 0xFFFF, 0x10000, 0x7FFFFFFF, 0xFFFFFFFF])
            payload[at : at + 4] = value.to_bytes(4, "big")
        elif op == 11:
            selector = rng.randrange(256) & ~1 | api_target
    if len(payload) > MAX_INPUT:
        del payload[MAX_INPUT:]
    return bytes([selector]) + bytes(payload)


# -- engines --------------------------------------------------------------------------


@dataclass
class Report:
    """The random engine's result."""

    iterations: int = 0
    seconds: float = 0.0
    crashes: dict[str, Path] = field(default_factory=dict)
    slow: list[tuple[float, Path]] = field(default_factory=list)


def _save(directory: Path, prefix: str, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{prefix}-{hashlib.sha1(data).hexdigest()}.bin"
    path.write_bytes(data)
    return path


class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _Hang(f"input ran longer than {HANG_S} s")


def run_random(
    *,
    seconds: float | None = None,
    iterations: int | None = None,
    seed: int = 0,
    crash_dir: Path | None = None,
    hang_alarm: bool = False,
    log: Callable[[str], None] | None = None,
) -> Report:
    """The dependency-free engine: mutate seeds (and inputs derived from them) until
    the time or iteration budget is spent. Crashes are saved to ``crash_dir`` and
    deduplicated by exception type and innermost source line. ``hang_alarm`` arms
    SIGALRM (main thread only) to turn an input running past HANG_S into a crash."""
    rng = random.Random(seed)
    pool = seeds()
    corpus = list(pool)
    report = Report()
    start = time.monotonic()
    next_log = start + 30
    use_alarm = hang_alarm and hasattr(signal, "SIGALRM")
    old = signal.signal(signal.SIGALRM, _on_alarm) if use_alarm else None
    try:
        for data in _inputs(rng, pool, corpus):
            now = time.monotonic()
            if seconds is not None and now - start >= seconds:
                break
            if iterations is not None and report.iterations >= iterations:
                break
            if use_alarm:
                signal.alarm(HANG_S)
            t0 = time.perf_counter()
            try:
                one_input(data)
            except Exception as exc:
                key = _crash_key(exc)
                if key not in report.crashes:
                    where = _save(crash_dir, "crash", data) if crash_dir else Path("-")
                    report.crashes[key] = where
                    if log:
                        log(f"CRASH {key}\n  input saved to {where}\n{traceback.format_exc()}")
            finally:
                if use_alarm:
                    signal.alarm(0)
            took = time.perf_counter() - t0
            if took > SLOW_INPUT_S and len(report.slow) < 20:
                where = _save(crash_dir, "slow", data) if crash_dir else Path("-")
                report.slow.append((took, where))
                if log:
                    log(f"SLOW {took:.2f} s, input saved to {where}")
            elif rng.random() < 0.01 and len(corpus) < 5000:
                corpus.append(data)  # keep some mutants to mutate further
            report.iterations += 1
            if log and now >= next_log:
                next_log = now + 30
                rate = report.iterations / (now - start)
                log(f"{report.iterations} inputs, {rate:.0f}/s, {len(report.crashes)} crashes")
    finally:
        if use_alarm:
            signal.signal(signal.SIGALRM, old)
    report.seconds = time.monotonic() - start
    return report


def _inputs(rng: random.Random, pool: list[bytes], corpus: list[bytes]) -> Iterator[bytes]:
    yield from pool
    while True:
        # Half the inputs for each target: the wire has far more seeds than the API.
        want_api = rng.random() < 0.5
        for _ in range(8):
            base = rng.choice(corpus)
            if bool(base[0] & 1) == want_api:
                break
        yield mutate(rng, base, pool)


def _crash_key(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    last = tb[-1] if tb else None
    where = f"{Path(last.filename).name}:{last.lineno}" if last else "?"
    return f"{type(exc).__name__} at {where}"


def run_atheris(seconds: int, work_dir: Path, extra: list[str]) -> int:
    """Coverage-guided fuzzing with atheris/libFuzzer; returns libFuzzer's exit status."""
    import atheris  # type: ignore[import-untyped,import-not-found,unused-ignore]

    corpus = work_dir / "corpus"
    crashes = work_dir / "crashes"
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    for data in seeds():
        (corpus / f"seed-{hashlib.sha1(data).hexdigest()}").write_bytes(data)
    pool = seeds()

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            out = bytes(atheris.Mutate(data, max_size))
        else:
            out = mutate(rng, data, pool)
        return out[:max_size]

    atheris.instrument_all()
    argv = [
        sys.argv[0],
        str(corpus),
        f"-max_total_time={seconds}",
        f"-artifact_prefix={crashes}/",
        f"-timeout={HANG_S}",
        f"-max_len={MAX_INPUT}",
        "-rss_limit_mb=4096",
        "-print_final_stats=1",
        *extra,
    ]
    atheris.Setup(argv, one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()
    return 0  # not reached: libFuzzer exits the process


def main(argv: list[str] | None = None) -> int:
    """Command line; see ``--help``."""
    parser = argparse.ArgumentParser(
        description="Fuzz the peer frame decoder and the local API reader. Exit 0 when "
        "nothing broke the contract, 1 when something did (inputs saved under WORK_DIR).",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    parser.add_argument("--iterations", type=int, default=None, help="stop after N inputs")
    parser.add_argument(
        "--engine",
        choices=("auto", "atheris", "random"),
        default="auto",
        help="auto: atheris when installed, else random",
    )
    parser.add_argument("--seed", type=int, default=None, help="random engine seed")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help=f"corpus and crash inputs (default {DEFAULT_WORK_DIR})",
    )
    parser.add_argument(
        "--replay", type=Path, nargs="+", metavar="FILE", help="run saved inputs and stop"
    )
    parser.add_argument(
        "libfuzzer_args",
        nargs="*",
        help="after --: extra libFuzzer flags for the atheris engine (e.g. -jobs=4)",
    )
    args = parser.parse_args(argv)

    if args.replay:
        failed = 0
        for path in args.replay:
            try:
                one_input(path.read_bytes())
                print(f"{path}: ok")
            except Exception:
                failed += 1
                print(f"{path}: FAILED\n{traceback.format_exc()}")
        return 1 if failed else 0

    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401
        except ImportError:
            engine = "random"
        else:
            engine = "atheris"
    if engine == "atheris":
        return run_atheris(max(1, int(args.seconds)), args.work_dir, args.libfuzzer_args)

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    print(f"random engine, seed {seed}, {args.seconds:.0f} s", flush=True)
    report = run_random(
        seconds=args.seconds,
        iterations=args.iterations,
        seed=seed,
        crash_dir=args.work_dir / "crashes",
        hang_alarm=True,
        log=lambda line: print(line, flush=True),
    )
    rate = report.iterations / report.seconds if report.seconds else 0.0
    print(
        f"done: {report.iterations} inputs in {report.seconds:.0f} s ({rate:.0f}/s), "
        f"{len(report.crashes)} distinct crashes, {len(report.slow)} slow inputs; "
        f"longest error message {OUTCOMES.longest_error} chars"
    )
    for label, count in sorted(OUTCOMES.by_label.items()):
        print(f"  {count:>10}  {label}")
    for key, path in report.crashes.items():
        print(f"CRASH {key}: {path}")
    return 1 if report.crashes or report.slow else 0


if __name__ == "__main__":
    sys.exit(main())
