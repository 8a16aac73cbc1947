"""The key format, owned by one type (`statax._core.meta.KeyName`): what `pull` writes, `plant`,
`first_nonfinite`, `describe` and `stx.sites` read back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import statax as stx
from statax._core.meta import GRAD, RAN, KeyName


@pytest.mark.parametrize(
    ("key", "parts"),
    [
        ("h_0", ("h", 0, "")),
        ("h_12.grad", ("h", 12, GRAD)),
        ("h_0.ran", ("h", 0, RAN)),
        ("enc/attn_out_3", ("enc/attn_out", 3, "")),
        ("layers[0]_1.grad", ("layers[0]", 1, GRAD)),
        ("loss", ("loss", None, "")),
        ("loss.ran", ("loss", None, RAN)),
        ("block_1", ("block", 1, "")),  # (a reduced name `block_1` reads as an occurrence)
    ],
)
def test_a_key_reads_back_into_its_parts_and_writes_the_same(key, parts):
    parsed = KeyName.parse(key)
    assert (parsed.name, parsed.occurrence, parsed.suffix) == parts
    assert str(parsed) == key
    assert parsed.grad == (parts[2] == GRAD)
    assert str(parsed.value()) == key.removesuffix(GRAD).removesuffix(RAN)


def test_every_key_pull_returns_reads_back():
    def f(x):
        a = stx.save_inter(jnp.sin(x), name="a_1")  # (a name that ends as an occurrence does)
        b = stx.save_inter(jnp.cos(a), name="b")
        stx.save_inter(b, name="total", reduce="sum")
        return jnp.sum(b)

    _, inters = stx.pull(jax.grad(f), cotangents=True, ran=True)(jnp.ones(3))
    for key in inters:
        assert str(KeyName.parse(key)) == key
    assert sorted(inters) == sorted(
        ["a_1_0", "a_1_0.grad", "b_0", "b_0.grad", "total", "a_1_0.ran", "b_0.ran"]
    )
    np.testing.assert_allclose(inters["b_0.grad"], jnp.ones(3))
