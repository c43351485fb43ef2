"""loops/tensorboard_events.py, TensorBoard's event file written without tensorboardX: the
CRC-32C against its check value and tensorboardX's own, the TFRecord framing against
tensorboardX's RecordWriter byte for byte, and the events read back with TensorBoard's Event
proto (tensorboardX's copy, a test dependency only)."""
import math
import struct

import numpy as np
import pytest
from tensorboardX.crc32c import crc32c as tbx_crc32c
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import RecordWriter

from jaxrl_agent.loops import tensorboard_events as te


def _records(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        (crc_n,) = struct.unpack("<I", data[i + 8:i + 12])
        payload = data[i + 12:i + 12 + n]
        (crc_p,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
        assert crc_n == te.masked_crc32c(data[i:i + 8]) and crc_p == te.masked_crc32c(payload)
        out.append(payload)
        i += 16 + n
    assert i == len(data)
    return out


def test_crc32c_is_castagnoli():
    assert te.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert te.crc32c(b"") == 0
    rng = np.random.default_rng(0)
    for n in (1, 7, 64, 1000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert te.crc32c(data) == tbx_crc32c(data)


def test_framing_is_tensorboardx_record_writer_byte_for_byte(tmp_path):
    payloads = [b"", b"x", bytes(range(256)) * 3]
    ref = RecordWriter(str(tmp_path / "ref"))
    for p in payloads:
        ref.write(p)
    ref.close()
    assert b"".join(te.record(p) for p in payloads) == (tmp_path / "ref").read_bytes()


def test_scalars_read_back_as_tensorboard_events(tmp_path):
    with te.EventWriter(str(tmp_path / "tb")) as w:
        w.add_scalars(3, {"reward": 0.5, "eval/pass1": 0.25, "ünïcode/tag": -1.5})
        w.add_scalars(2**40, {"big": 1e30})
        w.add_scalars(-1, {"neg": float("nan"), "inf": float("inf")})
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = [Event.FromString(r) for r in _records(path.read_bytes())]
    assert events[0].file_version == "brain.Event:2"
    got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert got[:4] == [(3, "reward", 0.5), (3, "eval/pass1", 0.25), (3, "ünïcode/tag", -1.5),
                       (2**40, "big", np.float32(1e30))]
    assert got[4][:2] == (-1, "neg") and math.isnan(got[4][2]) and got[5] == (-1, "inf", math.inf)
    assert all(abs(e.wall_time - events[0].wall_time) < 60 for e in events)


def test_each_call_is_on_disk_before_close(tmp_path):
    """A killed run keeps every scalar it logged (as metrics.jsonl keeps every line)."""
    w = te.EventWriter(str(tmp_path))
    w.add_scalars(1, {"a": 1.0})
    (path,) = tmp_path.glob("events.out.tfevents.*")
    assert len(_records(path.read_bytes())) == 2
    w.close()
    w.close()  # closing twice is harmless
    with pytest.raises(ValueError, match="closed"):
        w.add_scalars(2, {"a": 2.0})


def test_two_writers_in_one_directory_keep_apart_files(tmp_path):
    a, b = te.EventWriter(str(tmp_path)), te.EventWriter(str(tmp_path))
    a.add_scalars(1, {"a": 1.0})
    b.add_scalars(1, {"b": 2.0})
    a.close()
    b.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
