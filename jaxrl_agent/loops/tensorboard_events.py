"""HOST: TensorBoard scalars written straight to an event file, without tensorboardX.

Why not tensorboardX: importing it imports torch wherever torch is installed (a researcher
coming from TRL has it), CPU time at start-up that competes with the first rollout on a small
machine (`python -X importtime -c "import tensorboardX"`); writing scalars needs none of it.
The format is small and fixed:

    event file  = records, each:  u64 length | u32 masked_crc32c(length bytes) | payload
                                  | u32 masked_crc32c(payload)          (TFRecord, little-endian)
    payload     = an `Event` protobuf: wall_time (1, double), step (2, int64),
                  file_version (3, string; the first record, "brain.Event:2"),
                  summary (5, `Summary`: repeated value (1, `Value`: tag (1, string),
                  simple_value (2, float)))
    masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xA282EAD8  (mod 2^32),  c = CRC-32C(x)

References: tensorflow/core/lib/io/record_writer.cc (framing), tensorflow/core/util/event.proto
and summary.proto (field numbers); tests/test_tensorboard_events.py checks the bytes against
tensorboardX's writer and reads them back with its Event proto.

    EventWriter(logdir).add_scalars(step, {tag: value})  -> one Event per call, flushed

Leaf module: no project imports.
"""
from __future__ import annotations

import itertools
import os
import socket
import struct
import time

FILE_VERSION = "brain.Event:2"
_CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, bit-reversed
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _CASTAGNOLI if _c & 1 else _c >> 1
    _TABLE.append(_c)
_SERIAL = itertools.count()  # writers of one process in one second get apart files


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`: table-driven, reflected, init and final xor 0xFFFFFFFF."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(payload: bytes) -> bytes:
    """One TFRecord: the payload framed by its length and both checksums."""
    length = struct.pack("<Q", len(payload))
    return (length + struct.pack("<I", masked_crc32c(length)) + payload
            + struct.pack("<I", masked_crc32c(payload)))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: a negative step is its two's complement, 10 bytes
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings and embedded messages."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)  # fields 1 (fixed64), 2 (varint)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, str(tag).encode()) + b"\x15" + struct.pack("<f", float(v)))
                          for tag, v in scalars.items())  # Value: tag (1), simple_value (2, fixed32)
        out += _field(5, values)
    return out


class EventWriter:
    """Appends scalars to a new event file in `logdir` (made if missing); each `add_scalars`
    call is one Event, written and flushed before it returns, so a killed run keeps it."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{next(_SERIAL)}"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "xb")
        self._write(_event(now, 0, file_version=FILE_VERSION))

    def add_scalars(self, step: int, scalars: dict) -> None:
        """`scalars`: tag -> number, all at `step` (stored as float32, as TensorBoard's scalars)."""
        if self._file is None:
            raise ValueError(f"EventWriter for {self.path} is closed")
        self._write(_event(time.time(), int(step), scalars=scalars))

    def _write(self, payload: bytes) -> None:
        self._file.write(record(payload))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
