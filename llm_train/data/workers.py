"""Data-loader worker processes that never outlive the training process they feed."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(worker_id: int) -> None:
    """DataLoader worker_init_fn: end this worker when its training process is gone.

    train.py ends with os._exit (no DataLoader shutdown). A worker whose queue pipe is full
    then never exits (it joins its queue's feeder thread, blocked on a pipe nobody reads),
    and an orphan holding the launcher's stdout keeps `accelerate launch` from returning.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
