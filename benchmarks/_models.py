"""A GPT-2-shaped transformer in plain JAX, its every block's output marked (`"resid"`), for
the benchmarks that record or patch a model's residual stream."""

import jax
import jax.numpy as jnp
import numpy as np

import statax as stx


def init_blocks(key, layers: int, width: int) -> list[dict]:
    keys = jax.random.split(key, layers * 4)
    s = width**-0.5
    return [
        {
            "qkv": jax.random.normal(keys[4 * i], (width, 3 * width)) * s,
            "proj": jax.random.normal(keys[4 * i + 1], (width, width)) * s,
            "up": jax.random.normal(keys[4 * i + 2], (width, 4 * width)) * s,
            "down": jax.random.normal(keys[4 * i + 3], (4 * width, width)) * s * 0.5,
        }
        for i in range(layers)
    ]


def norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def block(p, x, heads: int):
    """Causal self-attention and an MLP, each with a residual: `(batch, seq, width)`."""
    b, t, width = x.shape
    q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(b, t, heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    attn = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, width)
    x = x + attn @ p["proj"]
    return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]


def blocks(params: list[dict], x, heads: int):
    """Every block in turn, each one's output marked `"resid"`."""
    for p in params:
        x = stx.save_inter(block(p, x, heads), name="resid")
    return x
