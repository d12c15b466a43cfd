"""Read what a W&B offline run stored: the records of its `run-*.wandb` transaction log.

The file is a LevelDB-style log (W&B's 7-byte header, then 32 KiB blocks of chunks with a 7-byte
header: crc32, length, type full/first/middle/last) of `wandb_internal_pb2.Record` protobufs. The
wandb version installed here ships no Python reader (its core is in Go), so the tests read it here.
"""

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(run_dir: Path, wait_s: float = 30.0) -> list:
    """Every record of the (single) offline W&B run under run_dir/wandb, in order.

    W&B's core process writes the log after `finish()` returns, so this waits (up to wait_s) for the
    run's `exit` record.
    """
    deadline = time.monotonic() + wait_s
    out = _read(Path(run_dir))
    while not any(r.WhichOneof("record_type") == "exit" for r in out) and time.monotonic() < deadline:
        time.sleep(0.1)
        out = _read(Path(run_dir))
    return out


def _read(run_dir: Path) -> list:
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending, chunks = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - _HEADER
            continue
        chunk, pos = data[pos : pos + length], pos + length
        if kind == _FULL:
            chunks.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            chunks.append(pending + chunk)
    out = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        out.append(record)
    return out


def of_type(run_dir: Path, record_type: str) -> list:
    """The payloads of one record type (`run`, `alert`, `history`, ...); a run's tag or config update
    is a further `run` record."""
    return [getattr(r, record_type) for r in records(run_dir) if r.WhichOneof("record_type") == record_type]


def run_config(run_dir: Path) -> dict:
    """The config the run was started with (its `run` record), as nested dicts."""
    run = of_type(run_dir, "run")[0]
    return {item.key: json.loads(item.value_json) for item in run.config.update}
