"""`python -m kiln.runtime.distributed.worker_main`: a worker rank that rank 0 starts on this machine. Its stdin
is the step channel (`channel.PipeReceiver`): the first message is `worker.worker_process_main`'s arguments
(`step_codec.encode_start`), then one per step."""

import sys

from kiln.runtime.distributed.channel import PipeReceiver
from kiln.runtime.distributed.step_codec import decode_start
from kiln.runtime.distributed.worker import worker_process_main

if __name__ == "__main__":
    steps = PipeReceiver(sys.stdin.buffer)
    worker_process_main(*decode_start(steps.receive()), steps=steps)
