"""Read the history rows of an offline wandb run (``run-*.wandb``) without a server.

The file is a ``:W&B`` header followed by LevelDB-style log records (32 KiB blocks, 7-byte record headers) that carry
protobuf ``Record`` messages. Tests and reports use this to check what a run sent to wandb.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a wandb run file (missing :W&B header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        else:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0


def history_rows(run_file: str | Path) -> list[dict]:
    """Each ``run.log`` call as a dict of key -> value (keys like ``reward/mean``, plus ``_step``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def find_run_file(directory: str | Path) -> Path:
    files = sorted(Path(directory).glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline wandb run under {directory}/wandb")
    return files[-1]
