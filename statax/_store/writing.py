"""Writes in the background, in order, with the bytes in flight bounded.

A step hands a batch's job to `Writer.submit` and returns. A job has two stages: `start()`
begins its writes (it waits for the batch's device arrays, hands them to the store, and returns
without waiting for the disk) and returns `finish(commit)`, which waits for them and, where
`commit` is true, commits. One
thread starts the jobs in the order they came, another finishes them in that order, so the
disk works on several batches at once while the device runs the next step, and a batch is
committed only after every batch before it. `submit` waits while the bytes of the jobs not yet
finished would pass the limit. A job that fails stops the ones after it (no batch is committed
past a lost one; the jobs before it still commit), and its error is raised at every `submit`
and `flush` after it.
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
        self._started: queue.Queue = queue.Queue()
        self._finishing: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._failed_at: int | None = None  # the number of the first job that failed
        self._submitted = 0
        self._threads = [
            threading.Thread(target=self._start, name="statax-store-start", daemon=True),
            threading.Thread(target=self._finish, name="statax-store-finish", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def in_flight(self) -> int:
        """The bytes of the jobs submitted and not yet finished."""
        return self._in_flight

    def submit(self, nbytes: int, start: Callable[[], Callable[[], None]]) -> None:
        """Run `start()`, then what it returns, after the jobs before it; wait first while
        `nbytes` more would pass the limit (a job larger than the limit runs alone)."""
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
            number, self._submitted = self._submitted, self._submitted + 1
        self._started.put((number, nbytes, start))

    def flush(self) -> None:
        """Wait for every job submitted; raise the error of one that failed."""
        self._started.join()
        self._finishing.join()
        with self._cv:
            self._raise()

    def close(self) -> None:
        self._started.put(None)
        for thread in self._threads:
            thread.join()

    def _raise(self) -> None:
        if self._error is not None:  # for good: no job after a failed one runs
            raise self._error

    def _fail(self, number: int, error: BaseException) -> None:
        with self._cv:
            if self._failed_at is None or number < self._failed_at:
                self._error, self._failed_at = error, number

    def _done(self, nbytes: int) -> None:
        with self._cv:
            self._in_flight -= nbytes
            self._cv.notify_all()

    def _start(self) -> None:
        while (item := self._started.get()) is not None:
            number, nbytes, start = item
            finish = None
            if self._error is None:
                try:
                    finish = start()
                except BaseException as error:  # kept for the caller's thread
                    self._fail(number, error)
            self._finishing.put((number, nbytes, finish))
            self._started.task_done()
        self._finishing.put(None)
        self._started.task_done()

    def _finish(self) -> None:
        while (item := self._finishing.get()) is not None:
            number, nbytes, finish = item
            try:
                if finish is not None:  # after a failed job, its writes end uncommitted
                    failed = self._failed_at is not None and self._failed_at <= number
                    try:
                        finish(not failed)
                    except BaseException:
                        if not failed:
                            raise
            except BaseException as error:
                self._fail(number, error)
            finally:
                self._done(nbytes)
                self._finishing.task_done()
        self._finishing.task_done()
