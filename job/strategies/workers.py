"""Persistent worker threads: `balanced` runs each extra card's forward in its own long-lived thread.

DataParallel starts fresh threads every step; cuDNN's autotune cache is per thread, so it would re-tune
every step. A thread that lives as long as the job tunes once.
"""

from __future__ import annotations

import queue
import threading


class Worker:
    """A persistent thread that runs the callables submitted to it, one at a time, in order."""

    def __init__(self, name: str):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                done.put((True, fn()))
            except BaseException as e:  # re-raised in the caller's thread by result()
                done.put((False, e))

    def submit(self, fn) -> queue.Queue:
        """Queue `fn`; pass the returned handle to `result` to wait for its value."""
        done: queue.Queue = queue.Queue(maxsize=1)
        self.jobs.put((fn, done))
        return done

    def stop(self):
        self.jobs.put(None)
        self.thread.join(timeout=10)


def result(done: queue.Queue):
    """The value of a submitted callable, or its exception raised here."""
    ok, value = done.get()
    if not ok:
        raise value
    return value
