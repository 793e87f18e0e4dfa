"""TensorBoard event files for scalar metrics, written without TensorFlow.

Neither tensorboard nor tensorflow is among our dependencies, and a scalar event file is small: TFRecord
framing (length, masked CRC-32C of the length, payload, masked CRC-32C of the payload) around hand-encoded
`Event` protobufs (tensorflow/core/util/event.proto) holding a `Summary` of `simple_value`s. CRC-32C comes
from google_crc32c, which google-cloud-aiplatform (a dependency) already installs through google-cloud-storage.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import google_crc32c

FILE_VERSION = b"brain.Event:2"


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C: rotate right by 15 bits and add a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: the payload framed by its length and checksums."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, file_version: bytes = b"", scalars: dict[str, float] | None = None) -> bytes:
    """An encoded Event: wall_time (1, double), step (2, int64), file_version (3) or summary (5)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version:
        out += _bytes_field(3, file_version)
    if scalars:
        # Summary.value (1) = Value{tag (1, string), simple_value (2, float)}
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        out += _bytes_field(5, values)
    return out


class EventWriter:
    """Appends scalar summaries to a new events.out.tfevents.* file in `directory`."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.file = open(self.path, "ab")
        self.file.write(record(event(time.time(), file_version=FILE_VERSION)))
        self.file.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write one step's scalars (each under its own tag) and flush."""
        self.file.write(record(event(time.time(), step, scalars={k: float(v) for k, v in values.items()})))
        self.file.flush()

    def close(self) -> None:
        self.file.close()
