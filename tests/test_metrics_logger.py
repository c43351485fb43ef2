"""loops/metrics.MetricsLogger: every `log` call is one JSON line and the numeric entries are
TensorBoard scalars (read back from the event file with TensorBoard's Event proto); a writer
that cannot open fails the first log after its JSON line is written."""
import json
import struct
from pathlib import Path

import pytest
from tensorboardX.proto.event_pb2 import Event

from jaxrl_agent.loops import metrics as M


def _scalars(tb_dir: Path) -> list[tuple[int, str, float]]:
    out = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 16 + n
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return out


def test_log_writes_json_lines_and_tensorboard_scalars(tmp_path):
    log = M.MetricsLogger(str(tmp_path))
    log.log(1, {"reward": 0.5, "eval": {"pass1": 0.25}, "note": "x"})
    log.log(2, {"reward": 0.75, "flag": True})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[0]["eval/pass1"] == 0.25 and lines[0]["note"] == "x"
    assert sorted(_scalars(tmp_path / "tb")) == [(1, "eval/pass1", 0.25), (1, "reward", 0.5), (2, "reward", 0.75)]


def test_a_tensorboard_that_cannot_open_fails_the_first_log(tmp_path, monkeypatch):
    def broken(logdir):
        raise RuntimeError(f"no writer for {logdir}")

    monkeypatch.setattr(M, "_open_writer", broken)
    log = M.MetricsLogger(str(tmp_path))
    with pytest.raises(RuntimeError, match="no writer"):
        log.log(1, {"reward": 0.5})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # the JSON line was written first


def test_without_tensorboard_no_event_file(tmp_path):
    with M.MetricsLogger(str(tmp_path), tensorboard=False) as log:
        log.log(0, {"a": 1})
    assert not (tmp_path / "tb").exists()


def test_a_disabled_logger_writes_nothing(tmp_path):
    log = M.MetricsLogger(str(tmp_path / "off"), enabled=False)
    assert log.log(0, {"a": {"b": 1}}) == {"a/b": 1}
    log.close()
    assert not (tmp_path / "off").exists()
