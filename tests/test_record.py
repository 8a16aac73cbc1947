"""`stx.record` and `stx.open_store`: what the store holds, read back, against what `pull`
returns for each batch (gathered); sharded over 8 devices and written by 2 processes; killed
mid-write and resumed; and every bad input."""

import functools
import inspect
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statax as stx
from statax._store.writing import Writer
from tests.store import worker

WORKER = os.path.join(os.path.dirname(__file__), "store", "worker.py")
RECORD = stx.record


@pytest.fixture(autouse=True, params=[True, False], ids=["output", "no-output"])
def output(request, monkeypatch):
    """Every test that records in this process runs both ways: each call returning the
    function's output, and without it (`output=False`: the step computes only the captures),
    the store the same. (A test that records in other processes runs once.)"""
    if not request.param and "stx.record(" not in inspect.getsource(request.function):
        pytest.skip("records in other processes only: run once")
    monkeypatch.setattr(stx, "record", functools.partial(RECORD, output=request.param))
    return request.param


def model(x, w):
    h = stx.save_inter(jnp.tanh(x @ w), name="h")
    with stx.scope("block"):
        stx.save_inter(h * 2.0, name="out")
    return jnp.sum(h, axis=-1)


W = jnp.linspace(-1, 1, 12).reshape(3, 4)


def batch(i, n=5):
    return jnp.asarray(np.random.default_rng(i).normal(size=(n, 3)), jnp.float32)


def pulled(fn, batches, **kwargs):
    """What `pull` returns for each batch, concatenated along the examples (the oracle)."""
    results = [flatten(stx.pull(fn, **kwargs)(*args)[1]) for args in batches]
    return {k: np.concatenate([r[k] for r in results]) for k in results[0]}


def assert_store_equals(store, expected):
    assert sorted(store) == sorted(expected)
    for key, value in expected.items():
        assert store[key].shape == value.shape, key
        np.testing.assert_allclose(store[key][:], value, rtol=1e-6, atol=1e-6, err_msg=key)


# ---- what the store holds ---------------------------------------------------------------------


@pytest.mark.parametrize("max_in_flight", [1 << 30, 1], ids=["default", "one_batch_at_a_time"])
def test_the_store_holds_what_pull_returns_and_fn_s_output_comes_back(tmp_path, max_in_flight):
    batches = [(batch(i), W) for i in range(3)]
    recording = stx.record(
        model, to=tmp_path / "acts.zarr", max_in_flight=max_in_flight, progress=False, output=True
    )
    with recording as recorder:
        outs = [recorder(*args) for args in batches]
    for out, args in zip(outs, batches):
        np.testing.assert_allclose(out, model(*args), rtol=1e-6)
    store = stx.open_store(tmp_path / "acts.zarr")
    assert_store_equals(store, pulled(model, batches))
    assert (store.batches_committed, store.rows) == (3, 15)
    assert isinstance(store["h_0"], stx.StoredArray) and store["h_0"].dtype == np.float32
    np.testing.assert_allclose(store["h_0"][2:4, 1], pulled(model, batches)["h_0"][2:4, 1])


def deep(x, ws):
    """Layers of tanh(x @ w), each output marked `"block"`, then a sum."""
    for w in ws:
        x = stx.save_inter(jnp.tanh(x @ w), name="block")
    return jnp.sum(x, axis=-1)


def test_without_the_output_the_step_runs_only_to_the_last_block_recorded(tmp_path):
    """`output=False`: the compiled step holds the blocks up to the one recorded and no more
    (its HLO's matrix products, counted), and the store holds what it holds with the output."""
    ws = jnp.stack([jnp.eye(3) * (0.5 + i / 10) for i in range(6)])
    batches = [(batch(i), ws) for i in range(2)]

    def dots(recorder) -> int:
        return len(re.findall(r"\bdot\(", recorder.lower(*batches[0]).compile().as_text()))

    for keys, blocks in (("block_1", 2), ("block_4", 5), (["block_0", "block_2"], 3)):
        stopping = stx.record(deep, to=tmp_path / f"{keys}.zarr", keys=keys, output=False)
        whole = stx.record(deep, to=tmp_path / f"{keys}-whole.zarr", keys=keys, output=True)
        assert dots(stopping) == blocks and dots(whole) == 6
        with stopping, whole:
            for args in batches:
                assert stopping(*args) is None
                np.testing.assert_allclose(whole(*args), deep(*args), rtol=1e-6)
        a, b = (
            stx.open_store(tmp_path / f"{keys}.zarr"),
            stx.open_store(tmp_path / f"{keys}-whole.zarr"),
        )
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key][:], b[key][:])


def test_the_metadata_says_what_each_key_is_and_where_it_was_saved(tmp_path):
    with stx.record(model, to=tmp_path / "s", progress=False) as recorder:
        recorder(batch(0), W)
    meta = stx.open_store(tmp_path / "s").metadata
    line = model.__code__.co_firstlineno
    assert meta["keys"] == {
        "h_0": {
            "path": "h_0",
            "row_shape": [4],
            "dtype": "float32",
            "rows": "examples",
            "location": f"{__file__}:{line + 1}",
            "reduce": None,
        },
        "block/out_0": {
            "path": "block%2Fout_0",
            "row_shape": [4],
            "dtype": "float32",
            "rows": "examples",
            "location": f"{__file__}:{line + 3}",
            "reduce": None,
        },
    }
    assert meta["versions"]["jax"] == jax.__version__
    assert meta["versions"]["statax"] == stx.__version__
    assert meta["processes"] == 1 and meta["subsample"] is None
    assert (tmp_path / "s" / "block%2Fout_0" / "zarr.json").exists()  # a zarr v3 array per key


def test_pytree_values_dtypes_and_an_examples_axis_given_per_key(tmp_path):
    def fn(x):
        stx.save_inter({"a": x, "b": (x > 0, x.astype(jnp.bfloat16))}, name="tree")
        stx.save_inter(jnp.swapaxes(jnp.stack([x, 2 * x]), 0, 1).T, name="t")  # (3, 2, n)
        return x

    batches = [(batch(i),) for i in range(2)]
    with stx.record(fn, to=tmp_path / "s", axis={"t_0": 2}, progress=False) as recorder:
        for args in batches:
            recorder(*args)
    store = stx.open_store(tmp_path / "s")
    expected = pulled(fn, batches)
    tree = [
        (jax.tree_util.keystr(p), v)
        for p, v in jax.tree_util.tree_leaves_with_path(
            [stx.pull(fn)(*a)[1]["tree_0"] for a in batches]
        )
    ]
    assert sorted(store) == ["t_0", "tree_0['a']", "tree_0['b'][0]", "tree_0['b'][1]"]
    assert store["tree_0['b'][0]"].dtype == np.bool_
    assert store["tree_0['b'][1]"].dtype == jnp.bfloat16
    t = [np.moveaxis(stx.pull(fn)(*args)[1]["t_0"], 2, 0) for args in batches]
    np.testing.assert_array_equal(store["t_0"][:], np.concatenate(t))
    np.testing.assert_array_equal(store["tree_0['a']"][:], expected["tree_0['a']"])
    np.testing.assert_array_equal(
        store["tree_0['b'][0]"][:], np.concatenate([v for p, v in tree if p.endswith("[0]")])
    )


def test_only_at_and_summarize_as_in_pull(tmp_path):
    import equinox as eqx

    mlp = eqx.nn.MLP(3, 2, width_size=4, depth=2, key=jax.random.PRNGKey(0))
    batches = [(batch(i),) for i in range(2)]
    at = stx.modules("layers[*]", of=mlp)
    with stx.record(lambda x: jax.vmap(mlp)(x), to=tmp_path / "at", at=at, progress=False) as r:
        for args in batches:
            r(*args)
    store = stx.open_store(tmp_path / "at")
    assert_store_equals(store, pulled(lambda x: jax.vmap(mlp)(x), batches, at=at))
    hand = [np.asarray(jax.vmap(mlp.layers[0])(x)) for (x,) in batches]
    np.testing.assert_allclose(store["layers[0]_0"][:], np.concatenate(hand), rtol=1e-6)
    assert store.metadata["selection"] == {
        "only": None,
        "at": ["stx.modules('layers[*]')"],
        "summarize": None,
        "keys": None,
        "steps": None,
        "ran": False,
    }

    with stx.record(model, to=tmp_path / "only", only="h", progress=False) as r:
        r(batch(0), W)
    assert list(stx.open_store(tmp_path / "only")) == ["h_0"]

    with stx.record(model, to=tmp_path / "sum", summarize=stx.stats, progress=False) as r:
        for i in range(3):
            r(batch(i), W)
    store = stx.open_store(tmp_path / "sum")
    assert store.metadata["rows"] == "batches" and store.rows == 0
    summarize = store.metadata["selection"]["summarize"]  # (with a digest of its code)
    assert re.fullmatch(r"statax\._monitor\.stats\.stats \(code [0-9a-f]{12}\)", summarize)
    assert store["h_0['mean']"].shape == (3,)  # a row per batch
    means = [float(jnp.mean(stx.pull(model)(batch(i), W)[1]["h_0"])) for i in range(3)]
    np.testing.assert_allclose(store["h_0['mean']"][:], means, rtol=1e-5)


def test_a_flax_nnx_model_and_its_submodules(tmp_path):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    net = Net(nnx.Rngs(0))
    recording = stx.record(net, to=tmp_path / "s", at=stx.modules("a", "b"), output=True)
    with recording as r:
        outs = [r(batch(i)) for i in range(2)]
    store = stx.open_store(tmp_path / "s")
    xs = np.concatenate([batch(i) for i in range(2)])
    np.testing.assert_allclose(store["a_0"][:], net.a(xs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(store["b_0"][:], np.concatenate(outs), rtol=1e-5, atol=1e-6)


# ---- less before it leaves: a subsample of positions ------------------------------------------


def sequences(x, w):
    h = stx.save_inter(jnp.tanh(x @ w), name="h")  # (examples, positions, 4)
    stx.save_inter(jnp.sum(h, axis=(1, 2)), name="total")  # (examples,): no positions
    return h


def test_positions_keeps_k_seeded_positions_per_example(tmp_path):
    xs = [
        jnp.asarray(np.random.default_rng(i).normal(size=(6, 10, 3)), jnp.float32) for i in range(3)
    ]

    def record(path, batches, **kwargs):
        with stx.record(sequences, to=path, positions=4, seed=7, progress=False, **kwargs) as r:
            for x in batches:
                r(x, W)
        return stx.open_store(path)

    store = record(tmp_path / "a", xs)
    kept = store["_positions"][:]
    assert kept.shape == (18, 4) and kept.dtype == np.int32
    assert all(len(set(row)) == 4 and list(row) == sorted(row) for row in kept)
    assert kept.min() >= 0 and kept.max() < 10
    full = pulled(sequences, [(x, W) for x in xs])
    np.testing.assert_allclose(
        store["h_0"][:], np.take_along_axis(full["h_0"], kept[:, :, None], axis=1), rtol=1e-6
    )
    np.testing.assert_allclose(store["total_0"][:], full["total_0"], rtol=1e-6)  # whole
    assert store.metadata["subsample"] == {
        "positions": 4,
        "axis": 1,
        "seed": 7,
        "key": "_positions",
    }
    # Seeded: the same positions again; other batches, other positions; resumed, the same.
    np.testing.assert_array_equal(record(tmp_path / "b", xs)["_positions"][:], kept)
    assert not np.array_equal(kept[:6], kept[6:12])
    record(tmp_path / "c", xs[:1])
    np.testing.assert_array_equal(record(tmp_path / "c", xs[1:])["_positions"][:], kept)


# ---- sharded, and several processes -------------------------------------------------------------


def run_worker(mode, store, batches, *extra, check=True):
    result = subprocess.run(
        [sys.executable, WORKER, mode, str(store), str(batches), *map(str, extra)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def worker_truth(batches):
    return pulled(worker.model, [(worker.batch(i), worker.WEIGHTS) for i in range(batches)])


def test_sharded_over_a_2d_mesh_of_8_devices_each_shard_is_written_and_nothing_gathered(tmp_path):
    result = run_worker("sharded", tmp_path / "s", 3)
    assert "NO-ALL-GATHER" in result.stdout
    store = stx.open_store(tmp_path / "s")
    assert_store_equals(store, worker_truth(3))
    # One process holds every row: a chunk is many batches' rows (64 here) of one column shard.
    assert store["h_0"]._array.chunk_layout.write_chunk.shape == (16 * 64, 4)


def flatten(inters):
    """`pull`'s dict with a pytree value's leaves by key, as the store keys them."""
    out = {}
    for key, value in inters.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            out[key + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def test_two_processes_under_jax_distributed_write_one_store(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "distributed",
                str(tmp_path / "s"),
                "3",
                str(p),
                "2",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    store = stx.open_store(tmp_path / "s")
    assert store.metadata["processes"] == 2
    assert sorted(os.listdir(tmp_path / "s" / "_statax")) == ["commit.0", "commit.1"]
    # A chunk per shard (16 examples over 4 devices, 8 features over 2): each process its own.
    assert store["h_0"]._array.chunk_layout.write_chunk.shape == (4, 4)
    assert_store_equals(store, (worker_truth(3)))


# ---- safe and resumable -------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_batches", [1, 2])
def test_killed_mid_write_the_store_opens_with_its_committed_batches_and_resumes(
    tmp_path, chunk_batches
):
    # SIGKILL once batch 3 is written, before its commit (two batches a chunk: 2's and 3's)
    killed = run_worker(f"kill-{chunk_batches}", tmp_path / "s", 6, check=False)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    store = stx.open_store(tmp_path / "s")
    committed = 3 if chunk_batches == 1 else 2
    assert store.batches_committed == committed and store["h_0"].shape == (16 * committed, 8)
    assert_store_equals(store, worker_truth(committed))
    run_worker("sharded", tmp_path / "s", 3)  # appends 3 batches after the last committed
    assert_store_equals(stx.open_store(tmp_path / "s"), worker_truth(committed + 3))


def test_killed_at_any_moment_what_is_committed_is_intact(tmp_path):
    """SIGKILL from outside, at a moment of the writes' own choosing."""
    proc = subprocess.Popen(
        [sys.executable, WORKER, "sharded", str(tmp_path / "s"), "100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    commits = tmp_path / "s" / "_statax" / "commit.0"
    deadline = time.monotonic() + 120
    while not commits.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    store = stx.open_store(tmp_path / "s")
    assert store.batches_committed >= 1
    assert_store_equals(store, (worker_truth(store.batches_committed)))


def test_lock_files_a_killed_writer_left_do_not_corrupt_the_next_run(tmp_path):
    """tensorstore reuses a stale `<file>.__lock` without truncating it: a run that appends
    removes them first."""
    path = tmp_path / "s"
    with stx.record(model, to=path, progress=False) as r:
        r(batch(0), W)
    for stale in (path / "h_0" / "zarr.json.__lock", path / "_statax" / "commit.0.__lock"):
        stale.write_text("x" * 5000)
    with stx.record(model, to=path, progress=False) as r:
        r(batch(1), W)
    store = stx.open_store(path)
    assert store.batches_committed == 2
    assert_store_equals(store, pulled(model, [(batch(0), W), (batch(1), W)]))


def test_a_full_disk_is_an_error_and_loses_nothing_committed(tmp_path):
    result = run_worker("disk", tmp_path / "s", 6, check=False)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "writing batch 2 failed" in result.stdout and "File too large" in result.stdout
    assert "keeps the 2 batches committed" in result.stdout
    store = stx.open_store(tmp_path / "s")
    assert_store_equals(store, (worker_truth(2)))


def test_appending_with_other_keys_shapes_or_dtypes_is_an_error_that_keeps_the_store(tmp_path):
    path = tmp_path / "s"
    with stx.record(model, to=path, progress=False) as r:
        r(batch(0), W)
    before = pulled(model, [(batch(0), W)])

    def other(x, w):
        stx.save_inter(jnp.tanh(x @ w), name="h")
        return x

    cases = [
        (other, (batch(1), W), r"keys \['block/out_0'\] are missing"),
        (
            model,
            (batch(1), jnp.ones((3, 5))),
            r"'h_0' is float32\(5,\) per row, where the store holds float32\(4,\)",
        ),
        (model, (batch(1).astype(jnp.float16), W.astype(jnp.float16)), r"float16\(4,\) per row"),
    ]
    for fn, args, message in cases:
        recorder = stx.record(fn, to=path, progress=False)
        with pytest.raises(stx.StoreError, match=message) as info:
            recorder(*args)
        assert "keeps its 1 committed batches" in str(info.value)
        recorder.close()
        assert_store_equals(stx.open_store(path), before)


def _files(path) -> dict:
    """Every file under `path`, with its bytes."""
    out = {}
    for folder, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), path)] = f.read()
    return out


@pytest.mark.parametrize(
    "first, then, message",
    [
        ({}, {"summarize": lambda v: v[0]}, "rows are batches, where the store's are examples"),
        ({"summarize": lambda v: v[0]}, {}, "rows are examples, where the store's are batches"),
        ({"summarize": lambda v: v[0]}, {"summarize": lambda v: v[-1]}, "its summarize= is"),
        ({"positions": 2, "seed": 1}, {"positions": 2, "seed": 2}, "its subsample is"),
        ({"positions": 2}, {"positions": 3}, "_positions"),
    ],
    ids=["summaries-onto-examples", "examples-onto-summaries", "another-summarize", "seed", "k"],
)
def test_rows_made_another_way_are_refused_and_the_store_is_untouched(
    tmp_path, first, then, message
):
    """Summary rows on example rows (and the reverse), another `summarize=` of the same
    shapes, another subsample: a `StoreError`, and not a byte of the store changed."""

    def f(x):
        stx.save_inter(x[:, None, :] * jnp.ones((1, 3, 1)), name="h")
        return x

    x = jnp.arange(20.0).reshape(5, 4)
    path = tmp_path / "s"
    with stx.record(f, to=path, progress=False, **first) as r:
        r(x)
    files = _files(path)
    recorder = stx.record(f, to=path, progress=False, **then)
    with pytest.raises(stx.StoreError, match=message) as info:
        recorder(x)
    assert "keeps its 1 committed batches" in str(info.value)
    recorder.close()
    assert _files(path) == files
    store = stx.open_store(path)
    assert store.batches_committed == 1 and store["h_0"][:].shape[0] == (
        1 if "summarize" in first else 5
    )


def test_the_same_recording_again_appends(tmp_path):
    """The same settings (a function's digest, not its name or line) append."""

    def f(x):
        stx.save_inter(x * 1.0, name="h")
        return x

    def record(**kwargs):
        with stx.record(f, to=tmp_path / "s", progress=False, **kwargs) as r:
            r(jnp.ones((5, 4)))

    record(summarize=jnp.mean)
    record(summarize=jnp.mean)
    assert stx.open_store(tmp_path / "s").batches_committed == 2


def test_a_path_that_is_not_a_store(tmp_path):
    (tmp_path / "file").write_text("hello")
    with pytest.raises(stx.StoreError, match="is a file, not a store"):
        stx.record(model, to=tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("mine")
    with pytest.raises(stx.StoreError, match=r"not a store of captures.*notes.txt"):
        stx.record(model, to=tmp_path / "dir")
    with pytest.raises(stx.StoreError, match="does not exist"):
        stx.open_store(tmp_path / "nothing")
    assert (tmp_path / "dir" / "notes.txt").read_text() == "mine"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="summarize= leaves only summaries"):
        stx.record(model, to=tmp_path / "a", positions=2, summarize=stx.stats)
    with pytest.raises(ValueError, match="on an axis after the examples"):
        stx.record(model, to=tmp_path / "a", positions=2, position_axis=0)
    with pytest.raises(TypeError, match="needs a callable"):
        stx.record(3, to=tmp_path / "a")
    with stx.record(sequences, to=tmp_path / "b", positions=20, progress=False) as r:
        with pytest.raises(stx.StoreError, match="have 10 positions along axis 1; keep at most 10"):
            r(jnp.ones((2, 10, 3)), W)
    with stx.record(model, to=tmp_path / "c", axis=1, progress=False) as r:
        with pytest.raises(
            stx.StoreError, match=r"'h_0' \(saved at .*test_record.py:\d+\) has shape"
        ):
            r(jnp.ones(3), W)

    def ragged(x):
        stx.save_inter(x, name="a")
        stx.save_inter(x[:2], name="b")
        return x

    with stx.record(ragged, to=tmp_path / "d", progress=False) as r:
        with pytest.raises(
            stx.StoreError, match=r"different numbers of examples .*'a_0': 5, 'b_0': 2"
        ):
            r(batch(0))
    recorder = stx.record(model, to=tmp_path / "e", progress=False)
    recorder.close()
    with pytest.raises(stx.StoreError, match="the recorder is closed"):
        recorder(batch(0), W)


# ---- asynchronous, with bounded memory ---------------------------------------------------------


def job(done, tag, wait=None, fail=None):
    """A writer's job: its start records `("start", tag)`, its finish `("finish", tag)`."""

    def start():
        done.append(("start", tag))
        if fail == "start":
            raise OSError(f"disk full at {tag}")

        def finish(commit):
            if wait is not None:
                wait.wait()
            if fail == "finish":
                raise OSError(f"disk full at {tag}")
            done.append(("finish" if commit else "abandoned", tag))

        return finish

    return start


def test_the_writer_runs_in_order_in_the_background_and_bounds_the_bytes_in_flight():
    release, done = threading.Event(), []
    writer = Writer(limit=100)
    writer.submit(60, job(done, 1, wait=release))
    writer.submit(40, job(done, 2))  # fits: 100 in flight, returns at once
    time.sleep(0.2)
    assert writer.in_flight == 100
    assert done == [("start", 1), ("start", 2)]  # both writing; 2 finishes after 1
    third = threading.Thread(target=writer.submit, args=(10, job(done, 3)))
    third.start()
    time.sleep(0.2)
    assert third.is_alive()  # at the limit, the next submit waits
    release.set()
    third.join(5)
    writer.flush()
    assert [d for d in done if d[0] == "finish"] == [("finish", 1), ("finish", 2), ("finish", 3)]
    assert writer.in_flight == 0
    writer.submit(10**6, job(done, 4))  # larger than the limit: runs alone
    writer.flush()
    assert done[-1] == ("finish", 4)
    writer.close()


def test_a_job_before_a_failed_one_still_commits():
    release, done = threading.Event(), []
    writer = Writer(limit=100)
    writer.submit(1, job(done, 1, wait=release))  # finishing, slowly
    writer.submit(1, job(done, 2, fail="start"))  # fails while 1 finishes
    time.sleep(0.2)
    release.set()
    with pytest.raises(OSError, match="disk full at 2"):
        writer.flush()
    assert ("finish", 1) in done  # committed: it came before the failure
    writer.close()


@pytest.mark.parametrize("stage", ["start", "finish"])
def test_after_a_failed_job_no_job_finishes_and_every_call_raises(stage):
    done = []
    writer = Writer(limit=100)
    writer.submit(1, job(done, 1, fail=stage))
    writer.submit(1, job(done, 2))
    with pytest.raises(OSError, match="disk full at 1"):
        writer.flush()
    with pytest.raises(OSError, match="disk full at 1"):
        writer.submit(1, job(done, 3))
    assert ("finish", 2) not in done and ("start", 3) not in done
    if stage == "finish":  # 2 had started: its writes end, uncommitted
        assert ("abandoned", 2) in done
    writer.close()


def test_a_call_returns_before_its_batch_is_written(tmp_path, monkeypatch):
    from statax._store import layout

    release = threading.Event()
    commit = layout.write_commit
    monkeypatch.setattr(layout, "write_commit", lambda *a: (release.wait(), commit(*a)))
    recorder = stx.record(model, to=tmp_path / "s", progress=False)
    recorder(batch(0), W)
    recorder(batch(1), W)  # returns while batch 0 waits for its commit
    assert recorder.batches == 2 and stx.open_store(tmp_path / "s").batches_committed == 0
    release.set()
    recorder.close()
    assert stx.open_store(tmp_path / "s").batches_committed == 2


def test_progress_shows_the_batches_written(tmp_path, capsys):
    with stx.record(model, to=tmp_path / "s", progress=True) as r:
        for i in range(3):
            r(batch(i), W)
    shown = capsys.readouterr().err
    assert f"recording to {tmp_path / 's'}" in shown and "3batch" in shown.replace(" ", "")
    with stx.record(model, to=tmp_path / "s", progress=False) as r:
        r(batch(3), W)
    assert capsys.readouterr().err == ""


# ---- off the device early -----------------------------------------------------------------------


def test_offload_moves_the_captures_to_host_memory_inside_the_program(tmp_path, output):
    x = batch(0)
    try:
        recorder = stx.record(model, to=tmp_path / "s", offload=True, progress=False)
    except ValueError as error:  # the floor JAX's CPU backend has no host placement
        assert "cannot place values in host memory" in str(error)
        assert jax.__version_info__ < (0, 9)
        return
    compiled = recorder.lower(x, W).compile()
    captured = list(compiled.output_shardings)  # (flat: fn's one output first, if asked)
    if output:
        assert captured.pop(0).memory_kind == "device"  # fn's output stays where it was
    assert len(captured) == 2 and {s.memory_kind for s in captured} == {"pinned_host"}
    with recorder:
        recorder(x, W)
    assert_store_equals(stx.open_store(tmp_path / "s"), pulled(model, [(x, W)]))


# ---- read back ---------------------------------------------------------------------------------


def test_batches_shuffle_across_recorded_batches_and_give_each_row_once(tmp_path):
    def ident(x):
        stx.save_inter(x, name="x")
        stx.save_inter(x[:, 0] * 2, name="twice")
        return x

    rows = np.arange(200, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    with stx.record(ident, to=tmp_path / "s", progress=False) as r:
        for i in range(10):
            r(jnp.asarray(rows[20 * i : 20 * i + 20]))
    store = stx.open_store(tmp_path / "s")
    got = list(store.batches(16, buffer_rows=64, seed=1))
    assert len(got) == 12 and all(len(b["x_0"]) == 16 for b in got)  # 200 // 16, the rest dropped
    seen = np.concatenate([b["x_0"][:, 0] for b in got])
    assert len(set(seen)) == 192 and set(seen) <= set(range(200))
    for b in got:  # the same rows of each key
        np.testing.assert_array_equal(b["twice_0"], 2 * b["x_0"][:, 0])
    assert any(len({int(v) // 20 for v in b["x_0"][:, 0]}) > 2 for b in got)  # mixed batches
    assert not np.array_equal(seen, np.sort(seen))
    again = np.concatenate([b["x_0"][:, 0] for b in store.batches(16, buffer_rows=64, seed=1)])
    np.testing.assert_array_equal(again, seen)
    every = np.concatenate([b["x_0"][:, 0] for b in store.batches(16, drop_last=False)])
    assert sorted(every) == list(range(200))
    plain = np.concatenate([b["x_0"][:, 0] for b in store.batches(50, shuffle=False)])
    np.testing.assert_array_equal(plain, np.arange(200))


def test_a_stored_array_indexes_as_numpy_does(tmp_path):
    """Every index NumPy takes (negative, past the end, steps, integer and boolean arrays,
    `None`, `...`), and NumPy's IndexError for those it refuses, on the same array."""
    rows = np.arange(10 * 4 * 3, dtype=np.float32).reshape(10, 4, 3)

    def f(x):
        stx.save_inter(x, name="x")
        return x

    with stx.record(f, to=tmp_path / "s", progress=False) as r:
        r(jnp.asarray(rows[:6]))
        r(jnp.asarray(rows[6:]))
    stored = stx.open_store(tmp_path / "s")["x_0"]
    np.testing.assert_array_equal(np.asarray(stored), rows)
    for index in INDICES:
        np.testing.assert_array_equal(stored[index], rows[index], err_msg=repr(index))
    for index in (10, -11, np.s_[0, 0, 0, 0], np.s_[:, 4], np.s_[[0, 10]], np.s_[..., ...]):
        with pytest.raises(IndexError):
            rows[index]
        with pytest.raises(IndexError):
            stored[index]


INDICES = [
    -1,
    np.s_[-3:],
    np.s_[0, -1],
    np.s_[8:100],
    np.s_[:, 2:9],
    np.s_[::-1],
    np.s_[::-3],
    np.s_[5:1:-2],
    np.s_[-100:3],
    np.s_[1:1],
    np.s_[..., 1],
    np.s_[None, 2],
    np.s_[3, ..., None],
    np.s_[[1, -2, 3]],
    np.s_[[1, 2], [0, 3]],
    np.s_[:, [0, -1], 1:],
    np.s_[[0, 1], :, [2, 1]],
    np.s_[np.array([[1, 2], [3, 4]])],
    np.s_[np.arange(10) % 3 == 0],
    np.s_[:, np.array([True, False, True, True])],
    np.s_[[]],
    np.s_[np.int64(-2), 1::2],
    (),
]


@given(index=st.data())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_numpy_index_against_numpy(index):
    """`numpy_index` (what a stored array reads, then how it indexes it) against NumPy on random
    indices of random shapes."""
    from statax._store.reading import numpy_index

    draw = index.draw
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    array = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    number = st.integers(-7, 7)
    item = st.one_of(
        number,
        st.builds(
            slice,
            st.none() | number,
            st.none() | number,
            st.none() | st.sampled_from([-3, -1, 1, 2]),
        ),
        st.lists(number, max_size=3),
        st.lists(number, max_size=3).map(np.array),
        st.lists(st.booleans(), max_size=5).map(np.array),
        st.just(None),
        st.just(Ellipsis),
    )
    index = tuple(draw(st.lists(item, max_size=4)))
    try:
        want = array[index]
    except (IndexError, ValueError):
        with pytest.raises((IndexError, ValueError)):
            box, local = numpy_index(index, shape)
            array[box][local]
        return
    box, local = numpy_index(index, shape)
    assert all(s.step in (None, 1) and 0 <= s.start <= s.stop <= n for s, n in zip(box, shape))
    np.testing.assert_array_equal(array[box][local], want)


# ---- axis= by name, as only= names marks --------------------------------------------------------


def test_axis_names_a_mark_as_only_does_and_an_entry_naming_none_is_an_error(tmp_path):
    """`axis={"resid": 1}` gives every occurrence of `resid` (a scan over layers stores the
    layers along axis 0, the examples along 1); a key gives one; an entry naming no key fails."""

    def f(x):
        def layer(h, _):
            h = jnp.tanh(h)
            return h, stx.save_inter(h, name="resid")

        h, _ = jax.lax.scan(layer, x, None, length=3)  # resid_0: (layers, examples, features)
        stx.save_inter(h * 2, name="out")
        return h

    x = batch(0)
    inters = stx.pull(f)(x)[1]
    for entry in ("resid", "resid_0"):
        with stx.record(f, to=tmp_path / entry, axis={entry: 1}, progress=False) as r:
            r(x)
        store = stx.open_store(tmp_path / entry)
        np.testing.assert_allclose(store["resid_0"][:], np.moveaxis(inters["resid_0"], 1, 0))
        np.testing.assert_allclose(store["out_0"][:], inters["out_0"])
    recorder = stx.record(f, to=tmp_path / "bad", axis={"resdi": 1}, progress=False)
    with pytest.raises(stx.StoreError, match=r"'resdi' names no key.*resid_0"):
        recorder(x)
    recorder.close()


# ---- random programs against the hand-threaded reference ----------------------------------------

from tests import test_property as programs  # noqa: E402


def _check_program(node):
    """`vmap(program)`, recorded over three batches of two examples, against the reference of
    `tests/test_property.py` (values by hand, no `save_inter`), vmapped."""
    if not programs._valid(node):
        return
    xs = [programs.X[None] * (i + 1) - jnp.array([[0.0], [0.7]]) for i in range(3)]
    try:
        expected = [jax.vmap(programs.reference(node))(x)[1] for x in xs]
    except programs.Mismatch:
        return
    names = programs.slots(node)
    expected = [programs.named(names, values) for values in expected]
    with tempfile.TemporaryDirectory() as tmp:
        with stx.record(jax.vmap(programs.build(node)), to=tmp + "/s", progress=False) as rec:
            for x in xs:
                rec(x)
        store = stx.open_store(tmp + "/s")
        assert sorted(store) == sorted(expected[0])
        for key in expected[0]:
            np.testing.assert_allclose(
                store[key][:], np.concatenate([e[key] for e in expected]), rtol=1e-4, atol=1e-5
            )


test_random_programs_recorded, test_random_programs_recorded_at_size = programs.sized(
    _check_program, programs.programs, [programs.LEAF], quick=3, at_size=20
)
