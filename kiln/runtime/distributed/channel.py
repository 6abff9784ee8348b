"""How rank 0's steps reach the ranks it started on this machine: length-prefixed frames of bytes (the
messages of `step_codec`, JSON, never pickles) on each worker's stdin pipe. A pipe write returns at once and a
blocked reader wakes in microseconds, where a gloo broadcast of the same few hundred bytes costs rank 0 about a
millisecond per step (measured on the CPU), on the critical path of every step. Ranks started by a launcher
(other machines) get the step over gloo (`RankGroups.send_step`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import BinaryIO

_LENGTH = struct.Struct("<Q")
# A frame longer than this is a broken or foreign writer, not a step (a step of 256 requests with 8,192-block
# tables sent whole is about 15 MB).
MAX_FRAME_BYTES = 1 << 30


class PipeSender:
    """Rank 0's end: one writable pipe per worker (the worker's stdin)."""

    def __init__(self, pipes: Sequence[BinaryIO]) -> None:
        self.pipes = list(pipes)

    def send(self, data: bytes) -> None:
        """Raises BrokenPipeError (an OSError) when a worker has gone."""
        frame = _LENGTH.pack(len(data)) + data
        for pipe in self.pipes:
            pipe.write(frame)
            pipe.flush()

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.close()
            except OSError:  # the worker is gone: nothing left to close cleanly
                pass


class PipeReceiver:
    """A worker's end: its stdin."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def receive(self) -> bytes:
        """The next message's bytes; ConnectionError when rank 0 has closed the pipe (or died), or when a
        frame's length is beyond MAX_FRAME_BYTES."""
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if length > MAX_FRAME_BYTES:
            raise ConnectionError(f"step pipe: a frame of {length} bytes (more than {MAX_FRAME_BYTES}): "
                                  f"not a message from rank 0")
        return self._read(length)

    def _read(self, size: int) -> bytes:
        data = self.stream.read(size)
        if data is None or len(data) != size:
            raise ConnectionError("rank 0 closed the step pipe")
        return data
