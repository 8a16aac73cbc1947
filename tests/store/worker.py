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
    if mode.startswith("die:"):  # killed by process 0 at a step of making or appending
        chunk_batches = 1
        if jax.process_index() == 0:
            die_at(mode[4:], store)
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


def die_at(step: str, store: str) -> None:
    """SIGKILL this process at `step` (`"<what>:<when>"`) of making the store or appending a
    batch: what is `begin` (the store's making begun), `arrays` (its arrays), `metadata` (its
    `zarr.json`) or `commit` (the first commit record this run writes); when is `before`,
    `during` (a half-written file left, as tensorstore's temporary `<name>.__lock`) or
    `after`."""
    from statax._store import layout

    what, when = step.split(":")
    name = {"begin": "begin", "arrays": "new_array", "metadata": "finish", "commit": "write_commit"}
    original = getattr(layout, name[what])
    half = {"metadata": "zarr.json.__lock", "commit": "_statax/commit.0.__lock"}

    made = []  # (arrays: "during" is after the first of the model's three, "after" the last)

    def dying(*args, **kwargs):
        if what == "arrays":
            made.append(1)
            if when == "before" and len(made) == 1:
                os.kill(os.getpid(), 9)
            out = original(*args, **kwargs)
            if len(made) == (1 if when == "during" else 3) and when != "before":
                os.kill(os.getpid(), 9)
            return out
        if when == "before" or when == "during":
            if when == "during":  # a file being written when the process died
                with open(os.path.join(store, half[what]), "wb") as f:
                    f.write(b'{"zarr_format": 3, "node_ty')
            os.kill(os.getpid(), 9)
        out = original(*args, **kwargs)
        if when == "after":
            os.kill(os.getpid(), 9)
        return out

    setattr(layout, name[what], dying)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
