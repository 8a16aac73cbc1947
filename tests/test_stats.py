"""`stats` and `tree_stats` against numpy, and summaries inside the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx

VALUES = np.array([0.0, 1.0, -3.0, 1000.0, np.nan, 1e-5, -np.inf, 0.3], np.float32)


def test_stats_against_numpy():
    s = jax.jit(stx.stats)(jnp.asarray(VALUES))
    finite = VALUES[np.isfinite(VALUES)]
    np.testing.assert_allclose(s["mean"], finite.mean(), rtol=1e-6)
    np.testing.assert_allclose(s["std"], finite.std(), rtol=1e-5)
    np.testing.assert_allclose(s["rms"], np.sqrt((finite**2).mean()), rtol=1e-6)
    assert float(s["min"]) == -3.0 and float(s["max"]) == 1000.0 and float(s["max_abs"]) == 1000
    assert float(s["zero_fraction"]) == 1 / 8
    assert int(s["nan_count"]) == 1 and int(s["inf_count"]) == 1
    # Exponent histogram: n with 2**n <= |x| < 2**(n+1), finite and non-zero.
    nonzero = finite[finite != 0]
    expected = {}
    for n in np.floor(np.log2(np.abs(nonzero))).astype(int):
        expected[int(n)] = expected.get(int(n), 0) + 1
    lo = int(s["exponent_min"])
    got = {lo + int(i): int(c) for i, c in enumerate(np.asarray(s["exponent_counts"])) if c}
    assert got == expected
    # float8_e4m3fn: 1000 overflows (max 448), 1e-5 underflows (smallest subnormal 2**-9).
    assert int(s["overflow"]) == 1 and int(s["underflow"]) == 1
    assert np.asarray(s["dtype"]).dtype == np.float32


def test_stats_of_integers_and_bfloat16():
    s = stx.stats(jnp.arange(5))
    assert float(s["mean"]) == 2.0 and np.asarray(s["dtype"]).dtype == np.int32
    s = stx.stats(jnp.array([1.0, 2.0], jnp.bfloat16))
    assert np.asarray(s["dtype"]).dtype == jnp.bfloat16 and float(s["mean"]) == 1.5


@pytest.mark.parametrize(
    "offset, spread, n, dtype",
    [
        (1.0, 1e-4, 65536, np.float32),  # E[x**2] - mean**2 gave 0.0
        (1000.0, 0.01, 4096, np.float32),  # ... and 0.225
        (-3e4, 0.5, 10000, np.float32),
        (1e6, 1.0, 1000, np.float32),
        (0.0, 1e-30, 1000, np.float32),  # tiny values, no offset
        (100.0, 0.5, 4096, jnp.bfloat16),
        (500.0, 0.25, 4096, np.float16),
        (1e8, 1e-3, 1000, np.float64),
    ],
)
def test_stats_mean_and_std_are_stable(offset, spread, n, dtype):
    rng = np.random.default_rng(0)
    x = (offset + spread * rng.standard_normal(n)).astype(dtype)
    x[::97] = np.nan  # non-finite values are left out, and must not disturb the rest
    exact = x.astype(np.float64)
    exact = exact[np.isfinite(exact)]
    with jax.enable_x64(dtype is np.float64):
        s = jax.jit(stx.stats)(jnp.asarray(x))
        np.testing.assert_allclose(s["std"], exact.std(), rtol=2e-3)
        np.testing.assert_allclose(s["mean"], exact.mean(), rtol=1e-6, atol=1e-3 * exact.std())


def model(x):
    h = stx.save_inter(jnp.tanh(x @ jnp.ones((16, 32))), name="hidden")
    return jnp.sum(stx.save_inter(h * 2, name="double"))


X = jnp.linspace(-1, 1, 64 * 16).reshape(64, 16)


def test_summarize_inside_the_compiled_program():
    out, summaries = stx.pull(model, summarize=stx.stats)(X)
    _, inters = stx.pull(model)(X)
    for key in inters:
        np.testing.assert_allclose(summaries[key]["rms"], stx.stats(inters[key])["rms"], rtol=1e-6)
    # Only the summaries leave the device: no output is as large as an activation.
    lowered = jax.jit(stx.pull(model, summarize=stx.stats)).lower(X)
    sizes = [np.prod(o.shape) for o in jax.tree_util.tree_leaves(lowered.out_info)]
    assert max(sizes) < 64 * 32
    # Any function of a pytree will do.
    assert set(stx.pull(model, summarize=jnp.mean)(X)[1]) == {"hidden_0", "double_0"}
