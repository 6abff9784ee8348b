"""How rank 0's plain-data step reaches the ranks it started on this machine: length-prefixed pickles on each
worker's stdin pipe. A pipe write returns at once and a blocked reader wakes in microseconds, where a gloo
broadcast of the same few hundred bytes costs rank 0 about a millisecond per step (measured on the CPU), on
the critical path of every step. Ranks started by a launcher (other machines) get the step over gloo
(`RankGroups.send_step`)."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import BinaryIO

_LENGTH = struct.Struct("<Q")


class PipeSender:
    """Rank 0's end: one writable pipe per worker (the worker's stdin)."""

    def __init__(self, pipes: Sequence[BinaryIO]) -> None:
        self.pipes = list(pipes)

    def send(self, message: object) -> None:
        """Raises BrokenPipeError (an OSError) when a worker has gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
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

    def receive(self) -> object:
        """The next message; ConnectionError when rank 0 has closed the pipe (or died)."""
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        return pickle.loads(self._read(length))

    def _read(self, size: int) -> bytes:
        data = self.stream.read(size)
        if data is None or len(data) != size:
            raise ConnectionError("rank 0 closed the step pipe")
        return data
