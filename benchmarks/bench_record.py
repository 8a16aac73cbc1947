"""What `stx.record` costs: a GPT-2-shaped model's every block recorded over N batches.

1. Recording every block's output (the residual stream) over N batches, against the forward
   pass alone (goal <= 1.15 when the disk keeps up), and against the loop written by hand:
   `pull`, `np.asarray` and `np.save` per value per batch (goal: record >= 2x faster). The
   recorder records the function the forward pass jits, `jax.jit`ted as there (its trace kept,
   as `jax.jit` keeps it); the same function unjitted, traced again at each batch so that what
   it reads from outside its arguments is read as it is then, is the next line.
2. The store's write bandwidth against the disk's own sequential write speed, measured here in
   the same run, both made durable (fsync) as tensorstore's writes are (goal >= 70 %).
3. Recording one block's output, the function's output not asked for (`output=False`):
   the compiled step stops after that block, against the forward pass alone (goal: block k
   of L costs at most (k + 1) / L + 0.1 of it).
4. Device memory of the compiled step as the number of blocks captured grows, with and without
   `offload=True` (`compiled.memory_analysis()`; goal: flat with offload). On the CPU backend
   host memory is the device's: its analysis counts host outputs as device outputs, so the
   figure is the same both ways there; a GPU shows the difference.

Interleaved runs, medians of REPEATS. Run: `python benchmarks/bench_record.py` (the sizes are
for CPU; pass `--gpu` for GPT-2 small's width).
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

import _models
import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved_medians

import statax as stx

GPU = "--gpu" in sys.argv
LAYERS, WIDTH, HEADS = 12, (768 if GPU else 128), (12 if GPU else 4)
BATCH, SEQ, BATCHES, REPEATS = (16 if GPU else 8), (256 if GPU else 64), 16, 9
BLOCKS = (2, 5)  # recorded alone, stopping early


def init(key, layers=LAYERS):
    return _models.init_blocks(key, layers, WIDTH)


def model(params, x):
    return jnp.mean(_models.blocks(params, x, HEADS))


def batches():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=(BATCH, SEQ, WIDTH)), jnp.float32) for _ in range(BATCHES)]


def main():
    params, xs = init(jax.random.PRNGKey(0)), batches()
    root = tempfile.mkdtemp(prefix="bench_record_")
    nbytes = LAYERS * BATCH * SEQ * WIDTH * 4 * BATCHES

    # Each run is what a user pays for a recording, compilation included: a new function each.
    def run_forward():
        forward = jax.jit(lambda params, x: model(params, x))
        for x in xs:
            out = forward(params, x)
        out.block_until_ready()

    def run_record():  # the function the forward pass jits, jitted: jax.jit's trace is kept
        path = os.path.join(root, "store")
        shutil.rmtree(path, ignore_errors=True)
        jitted = jax.jit(lambda p, x: model(p, x))
        with stx.record(jitted, to=path, progress=False) as recorder:
            for x in xs:
                recorder(params, x)

    def run_record_block(k):  # one block, without the output: the step stops after it
        path = os.path.join(root, f"store_block_{k}")
        shutil.rmtree(path, ignore_errors=True)
        jitted = jax.jit(lambda p, x: model(p, x))
        recording = stx.record(jitted, to=path, keys=f"resid_{k}", output=False, progress=False)
        with recording as recorder:
            for x in xs:
                recorder(params, x)

    def run_record_plain():  # a plain function: traced at each batch (what it reads, now)
        path = os.path.join(root, "store_plain")
        shutil.rmtree(path, ignore_errors=True)
        with stx.record(lambda p, x: model(p, x), to=path, progress=False) as recorder:
            for x in xs:
                recorder(params, x)

    def run_by_hand():
        path = os.path.join(root, "by_hand")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        pulled = stx.pull(jax.jit(lambda params, x: model(params, x)))
        for i, x in enumerate(xs):
            out, inters = pulled(params, x)
            for key, value in inters.items():
                np.save(os.path.join(path, f"{key}.{i}.npy"), np.asarray(value))

    def identity(v):  # recording with no model to wait for: the store's own speed
        return stx.save_inter(v, name="v")

    layers_batch = [jnp.stack([x] * LAYERS).reshape(-1, SEQ, WIDTH) for x in xs]

    def store_seconds():
        """The store's steady state: after a first batch (compilation, the arrays made), the
        other batches written and committed."""
        path = os.path.join(root, "bandwidth")
        shutil.rmtree(path, ignore_errors=True)
        with stx.record(identity, to=path, progress=False) as recorder:
            recorder(layers_batch[0])
            recorder.flush()
            start = time.perf_counter()
            for v in layers_batch[1:]:
                recorder(v)
            recorder.flush()
            return time.perf_counter() - start

    def disk_seconds():  # the disk's own sequential write of as many bytes, durable
        start = time.perf_counter()
        with open(os.path.join(root, "sequential.bin"), "wb") as f:
            for v in layers_batch[1:]:
                f.write(np.asarray(v).tobytes())
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - start

    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {LAYERS} blocks of width "
        f"{WIDTH}, {BATCHES} batches of {BATCH}x{SEQ} tokens: {nbytes / 1e6:.0f} MB recorded"
    )
    t = interleaved_medians(
        {
            "forward": run_forward,
            "record": run_record,
            "record, plain function": run_record_plain,
            "by hand": run_by_hand,
            **{f"block {k}": (lambda k=k: run_record_block(k)) for k in BLOCKS},
        },
        REPEATS,
    )
    print(
        f"{'record / forward alone':<44} {t['record'] / t['forward']:6.3f}  (goal <= 1.15)"
        f"   {t['record'] * 1e3:8.1f} ms vs {t['forward'] * 1e3:8.1f} ms"
    )
    print(
        f"{'record(f), f not jitted / forward alone':<44} "
        f"{t['record, plain function'] / t['forward']:6.3f}  (info: f traced at each batch)"
        f"   {t['record, plain function'] * 1e3:8.1f} ms vs {t['forward'] * 1e3:8.1f} ms"
    )
    print(
        f"{'by hand / record (how much faster)':<44} {t['by hand'] / t['record']:6.3f}  (goal >= 2)"
        f"   {t['by hand'] * 1e3:8.1f} ms vs {t['record'] * 1e3:8.1f} ms"
    )
    for k in BLOCKS:
        goal = (k + 1) / LAYERS + 0.1
        print(
            f"{f'record block {k} of {LAYERS}, output=False / forward':<44} "
            f"{t[f'block {k}'] / t['forward']:6.3f}  (goal <= {goal:.2f})"
            f"   {t[f'block {k}'] * 1e3:8.1f} ms vs {t['forward'] * 1e3:8.1f} ms"
        )
    # The same in steady state: the step compiled and the store open, the other batches
    # recorded (and written) against the forward pass of the same batches.
    steady_forward = jax.jit(lambda params, x: model(params, x))

    def forward_steady(xs):
        steady_forward(params, xs[0]).block_until_ready()
        start = time.perf_counter()
        for x in xs[1:]:
            out = steady_forward(params, x)
        out.block_until_ready()
        return time.perf_counter() - start

    def block_steady(k, xs):
        path = os.path.join(root, f"steady_block_{k}")
        shutil.rmtree(path, ignore_errors=True)
        recording = stx.record(
            steady_forward, to=path, keys=f"resid_{k}", output=False, progress=False
        )
        with recording as recorder:
            recorder(params, xs[0])
            recorder.flush()
            start = time.perf_counter()
            for x in xs[1:]:
                recorder(params, x)
            recorder.flush()
            return time.perf_counter() - start

    # (and with four times the examples a batch: the per-call cost, a trace and the write's
    # submission, against more computation)
    bigger = [jnp.concatenate([x] * 4) for x in xs]
    for label, inputs in (("steady state", xs), ("steady, 4x the batch", bigger)):
        runs = {"forward": [], **{k: [] for k in BLOCKS}}
        for _ in range(REPEATS):
            runs["forward"].append(forward_steady(inputs))
            for k in BLOCKS:
                runs[k].append(block_steady(k, inputs))
        for k in BLOCKS:
            f, b = statistics.median(runs["forward"]), statistics.median(runs[k])
            print(
                f"{f'  block {k}, {label}':<44} {b / f:6.3f}  (goal <= "
                f"{(k + 1) / LAYERS + 0.1:.2f})   {b * 1e3:8.1f} ms vs {f * 1e3:8.1f} ms"
            )
    written = sum(v.nbytes for v in layers_batch[1:])
    store, disk = [], []
    for _ in range(REPEATS + 1):  # interleaved, the first of each a warm-up
        store.append(store_seconds())
        disk.append(disk_seconds())
    store_bw = written / statistics.median(store[1:]) / 1e6
    disk_bw = written / statistics.median(disk[1:]) / 1e6
    print(
        f"{'store bandwidth / disk sequential write':<44} {store_bw / disk_bw:6.3f}  (goal >= 0.70)"
        f"   {store_bw:8.0f} MB/s vs {disk_bw:8.0f} MB/s"
    )

    print("device memory of the compiled step (MB) as the blocks captured grow:")
    x = xs[0]
    for layers in (1, 2, 4, 8, LAYERS):
        ps = params[:layers]
        row = []
        for offload in (False, True):
            try:
                recorder = stx.record(
                    model, to=os.path.join(root, "m"), offload=offload, progress=False
                )
            except ValueError as error:
                row.append(f"offload: {str(error)[:60]}...")
                continue
            stats = recorder.lower(ps, x).compile().memory_analysis()
            device = stats.temp_size_in_bytes + stats.output_size_in_bytes
            host = getattr(stats, "host_output_size_in_bytes", 0)
            label = "offload" if offload else "plain"
            row.append(f"{label:>7}: device {device / 1e6:7.1f} host {host / 1e6:7.1f}")
            recorder.close()
        print(f"  {layers:3d} blocks   " + "   ".join(row))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
