"""Writes in the background, in order, with the bytes in flight bounded.

A step hands a batch's job to `Writer.submit` and returns; one thread runs the jobs in the
order they came (each job waits for its device arrays, starts its writes and waits for them,
then commits), so the disk works while the device runs the next step. `submit` waits while
the bytes of the jobs not yet done would pass the limit. A job that fails stops the ones after
it (a later batch is never committed past a lost one) and its error is raised at every
`submit` and `flush` after it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

__all__ = ["Writer"]


class Writer:
    def __init__(self, limit: int):
        self.limit = int(limit)
        self._in_flight = 0
        self._cv = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="statax-store-writer", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """The bytes of the jobs submitted and not yet done."""
        return self._in_flight

    def submit(self, nbytes: int, job: Callable[[], None]) -> None:
        """Run `job` after the jobs before it; wait first while `nbytes` more would pass the
        limit (a job larger than the limit runs alone)."""
        with self._cv:
            self._cv.wait_for(
                lambda: (
                    self._error is not None
                    or self._in_flight == 0
                    or self._in_flight + nbytes <= self.limit
                )
            )
            self._raise()
            self._in_flight += nbytes
        self._jobs.put((nbytes, job))

    def flush(self) -> None:
        """Wait for every job submitted; raise the error of one that failed."""
        self._jobs.join()
        with self._cv:
            self._raise()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:  # for good: no job after a failed one runs
            raise self._error

    def _work(self) -> None:
        failed = False
        while (item := self._jobs.get()) is not None:
            nbytes, job = item
            try:
                if not failed:
                    job()
            except BaseException as error:  # kept for the caller's thread
                failed = True
                with self._cv:
                    self._error = error
            finally:
                with self._cv:
                    self._in_flight -= nbytes
                    self._cv.notify_all()
                self._jobs.task_done()
        self._jobs.task_done()
