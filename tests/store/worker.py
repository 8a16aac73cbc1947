"""Runs `stx.record` in a process of its own, for tests/test_record.py: with 8 CPU devices on a
2-D mesh, as one of several processes under `jax.distributed`, killed mid-write, or with a
limit on file sizes (a full disk). The tests import `model`, `batch` and `WEIGHTS` from here
to compare the store with.

    python tests/store/worker.py MODE STORE BATCHES [PROCESS PROCESSES PORT]
"""

import os
import sys

import numpy as np

EXAMPLES, FEATURES, HIDDEN = 16, 6, 8
WEIGHTS = np.linspace(-1, 1, FEATURES * HIDDEN, dtype=np.float32).reshape(FEATURES, HIDDEN)


def model(x, w):
    import jax.numpy as jnp

    import statax as stx

    h = stx.save_inter(jnp.tanh(x @ w), name="h")
    stx.save_inter({"sq": h**2, "neg": -x}, name="tree")
    return jnp.sum(h, axis=1)


def batch(i: int) -> np.ndarray:
    """The i-th batch, the same in every process: what the tests compare the store against."""
    return np.random.default_rng(i).normal(size=(EXAMPLES, FEATURES)).astype(np.float32)


def main(mode: str, store: str, batches: int, *distributed: str) -> None:
    devices = 4 if distributed else 8
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    if distributed:
        process, processes, port = map(int, distributed)
        jax.distributed.initialize(f"localhost:{port}", processes, process)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import statax as stx

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows, cols = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P(None, "model"))
    put = lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i])  # noqa: E731
    w = put(WEIGHTS, cols)
    # Killed: "kill-1", a commit per batch; "kill-2", per two batches.
    chunk_batches = int(mode[5:]) if mode.startswith("kill") else None
    recorder = stx.record(model, to=store, progress=False, chunk_batches=chunk_batches)
    if mode.startswith("kill"):  # SIGKILL once batch 3's arrays are written, before its commit
        from statax._store import layout

        commit = layout.write_commit

        def write_commit(path, process, committed, rows):
            if committed == 4:
                os.kill(os.getpid(), 9)
            commit(path, process, committed, rows)

        layout.write_commit = write_commit
    start = recorder.batches
    try:
        for i in range(start, start + batches):
            recorder(put(batch(i), rows), w)
            if mode == "disk" and i == start + 1:  # after two batches, the disk is full
                recorder.flush()
                import resource
                import signal

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
        recorder.close()
    except stx.StoreError as error:
        print("STORE-ERROR", error, flush=True)
        sys.exit(3)
    if mode == "sharded":
        text = recorder.lower(put(batch(0), rows), w).compile().as_text()
        print("ALL-GATHER" if "all-gather" in text else "NO-ALL-GATHER")
    print("DONE", recorder.batches, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
