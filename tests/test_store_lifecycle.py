"""A store's life, killed at each step (issue 47): `stx.record` SIGKILLed before, during and
after each step of making a store (begun, its arrays, its metadata) and of appending a batch
(its commit record), with one process and with two under `jax.distributed`. Afterwards the
store either opens with every batch it committed, or `stx.open_store` says what to do; and
recording again to it resumes, after what was committed, to the store an unbroken run makes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import statax as stx
from statax._store import layout

from .test_record import WORKER, assert_store_equals, model, run_worker, worker_truth

# (step, batches committed when the run dies: a store not yet made is `None`)
MAKING = [
    ("begin:before", None),
    ("begin:after", None),
    ("arrays:before", None),
    ("arrays:during", None),
    ("arrays:after", None),
    ("metadata:before", None),
    ("metadata:during", None),
    ("metadata:after", 0),
    ("commit:before", 0),
    ("commit:during", 0),
    ("commit:after", 1),
]
APPENDING = [("commit:before", 2), ("commit:during", 2), ("commit:after", 3)]
IN_THE_README_COMMAND = {("making", "metadata:during"), ("appending", "commit:before")}


def cases(processes: int):
    out = []
    for phase, steps in (("making", MAKING), ("appending", APPENDING)):
        for step, committed in steps:
            quick = processes == 1 and (phase, step) in IN_THE_README_COMMAND
            marks = () if quick else (pytest.mark.exhaustive,)
            out.append(pytest.param(phase, step, committed, id=f"{phase}-{step}", marks=marks))
    return out


def run_processes(mode: str, store, batches: int, processes: int, died: bool):
    """Run the worker in `processes` processes; with `died`, process 0 kills itself and the
    others (waiting for it at a barrier, or for a coordinator that is gone) are stopped."""
    if processes == 1:
        result = run_worker(mode, store, batches, check=not died)
        if died:
            assert result.returncode == -9, result.stdout + result.stderr
        return
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, mode, str(store), str(batches), str(p), "2", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(processes)
    ]
    if died:
        code = procs[0].wait(timeout=300)
        time.sleep(0.5)
        for p in procs[1:]:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]  # (and their pipes closed)
        assert code == -9, outputs[0]
        return
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * processes, outputs


def check_killed(store, committed: int | None, lagging: bool) -> int:
    """The store opens with its `committed` batches (one fewer where another process may not
    have committed its part of the last yet: `lagging`), or says what to do. How many batches
    it holds."""
    if committed is None:
        with pytest.raises(stx.StoreError, match=r"stx\.record\(fn, to=path\) makes"):
            stx.open_store(store)
        return 0
    opened = stx.open_store(store)
    assert opened.batches_committed in ((committed - 1, committed) if lagging else (committed,))
    committed = opened.batches_committed
    if committed:
        assert_store_equals(opened, worker_truth(committed))
    else:
        assert all(opened[k].shape[0] == 0 for k in opened)
    return committed


def lifecycle(tmp_path, phase: str, step: str, committed, processes: int) -> None:
    store = tmp_path / "s"
    if phase == "appending":  # a store with two batches committed, appended to
        run_processes("sharded" if processes == 1 else "distributed", store, 2, processes, False)
    run_processes(f"die:{step}", store, 3, processes, died=True)
    lagging = processes > 1 and step == "commit:after"
    resumed = check_killed(store, committed, lagging)
    run_processes("sharded" if processes == 1 else "distributed", store, 2, processes, False)
    assert_store_equals(stx.open_store(store), worker_truth(resumed + 2))


@pytest.mark.parametrize("phase, step, committed", cases(1))
def test_one_process_killed_at_each_step(tmp_path, phase, step, committed):
    lifecycle(tmp_path, phase, step, committed, 1)


@pytest.mark.parametrize("phase, step, committed", cases(2))
def test_two_processes_killed_at_each_step(tmp_path, phase, step, committed):
    lifecycle(tmp_path, phase, step, committed, 2)


def test_a_store_half_made_is_no_store_to_open_but_one_to_record_to(tmp_path):
    """What another process sees while process 0 makes the store (or after a killed making):
    `open_store` says what to do; `record` makes it again (the race of two processes that made
    `stx.record`'s second process fail, and its first wait at the barrier)."""
    path = str(tmp_path / "s")
    layout.begin(path, {"format": layout.FORMAT})
    layout.new_array(path, "stale_0", (2,), "float32", (4, 2))
    with pytest.raises(layout.HalfMade, match="cut short"):
        stx.open_store(path)
    x = np.ones((5, 3), np.float32)
    with stx.record(model, to=path, progress=False) as recorder:  # made again, from the start
        recorder(x, np.ones((3, 4), np.float32))
    store = stx.open_store(path)
    assert sorted(store) == ["block/out_0", "h_0"] and store.batches_committed == 1
    assert not os.path.exists(os.path.join(path, "stale_0"))
    assert not os.path.exists(os.path.join(path, "_statax", "making.json"))
