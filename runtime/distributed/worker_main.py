"""`python -m kiln.runtime.distributed.worker_main`: a worker rank that rank 0 starts on this machine; its
arguments (`worker.worker_process_main`'s) arrive pickled on stdin."""

import pickle
import sys

from kiln.runtime.distributed.worker import worker_process_main

if __name__ == "__main__":
    worker_process_main(*pickle.load(sys.stdin.buffer))
