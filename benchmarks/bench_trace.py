"""What `pull` costs around the compiled program: tracing, and dispatch of a cached call.

Every figure is the median ratio of interleaved runs against the same work written by hand:

* trace: `jax.make_jaxpr(stx.pull(f))` / `jax.make_jaxpr(f_hand)`, where `f_hand` is `f`
  written to return its intermediates itself. Each run builds fresh function objects, so that
  no cache of JAX's or statax's is hit, and times everything from the call to the finished
  jaxpr. Workloads: the README's 16-layer MLP (16 marks), a training step on it
  (`value_and_grad` + SGD), a transformer layer in a `lax.scan`, and straight-line programs of
  1k / 10k / 50k equations with a mark every 10;
* unpulled marks: `jax.make_jaxpr(f)` / `jax.make_jaxpr(f_plain)` (no `pull`; `f_plain` has no
  `save_inter`), on the MLP; and, for scale, the floor of any mark that stages an equation:
  the same MLP staging a bare mark per layer (params made ahead of time, no checks) / `f_plain`;
* dispatch: eager `stx.pull(jax.jit(f))(...)` / `jax.jit(f_hand)(...)`, second and later calls,
  on a 16-layer MLP of width 64 and batch 8.

Run: `python benchmarks/bench_trace.py` (about three minutes on 2 CPU cores).
"""

import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report
from bench_core import by_hand, init, marked, unmarked
from jax import lax

import statax as stx
from statax._core import staging as _staging
from statax._core.primitive import array_params


def mlp_params(width, key=0):
    return init(jax.random.key(key), width)


# An unpulled mark's params, made once, as statax makes them once per call site and name.
_BARE_PARAMS = array_params("layer", (None, 0), None)


def bare_marks(params, x):
    """`unmarked`, with a bare unpulled mark on each layer: the least a staged mark can cost."""
    for w in params:
        x = jnp.tanh(x @ w)
        _staging.observe_staged(stx.extend.save_inter_p, x, _BARE_PARAMS)
    return jnp.sum(x)


# ---- the MLP (bench_core's) -----------------------------------------------------------------


def make_mlp():
    """Fresh function objects running bench_core's MLP: `(f, f_hand, f_plain)`."""

    def f(params, x):
        return marked(params, x)

    def f_hand(params, x):
        return by_hand(params, x)

    def f_plain(params, x):
        return unmarked(params, x)

    return f, f_hand, f_plain


# ---- a training step ----------------------------------------------------------------------------


def make_step():
    f, f_hand, _ = make_mlp()

    def step(params, x):
        loss, grads = jax.value_and_grad(f)(params, x)
        return loss, [w - 0.1 * g for w, g in zip(params, grads, strict=True)]

    def step_hand(params, x):
        (loss, acts), grads = jax.value_and_grad(f_hand, has_aux=True)(params, x)
        return (loss, [w - 0.1 * g for w, g in zip(params, grads, strict=True)]), acts

    return step, step_hand


# ---- a transformer layer in a scan ------------------------------------------------------------

HEADS, SEQ, D_MODEL, LAYERS = 4, 32, 64, 4


def transformer_params(key=0):
    k = jax.random.split(jax.random.key(key), 4)
    shape = (LAYERS, D_MODEL, D_MODEL)
    return {name: jax.random.normal(kk, shape) / D_MODEL**0.5 for name, kk in zip("qkvo", k)}


def _layer(x, p, save):
    def heads(y):
        return y.reshape(SEQ, HEADS, D_MODEL // HEADS).transpose(1, 0, 2)

    q, k, v = heads(x @ p["q"]), heads(x @ p["k"]), heads(x @ p["v"])
    att = save(jax.nn.softmax(q @ k.transpose(0, 2, 1) / (D_MODEL // HEADS) ** 0.5), "attn")
    y = (att @ v).transpose(1, 0, 2).reshape(SEQ, D_MODEL) @ p["o"]
    x = save(x + y, "resid")
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def make_transformer():
    def f(params, x):
        def body(x, p):
            return _layer(x, p, lambda v, name: stx.save_inter(v, name=name)), None

        x, _ = lax.scan(body, x, params)
        return jnp.sum(x)

    def f_hand(params, x):
        def body(x, p):
            saved = {}

            def save(v, name):
                saved[f"{name}_0"] = v
                return v

            x = _layer(x, p, save)
            return x, saved

        x, acts = lax.scan(body, x, params)
        return jnp.sum(x), acts

    return f, f_hand


# ---- straight-line programs -------------------------------------------------------------------


def make_chain(n):
    """`n` elementwise equations on a vector, a mark after every tenth."""

    def f(x):
        for i in range(n):
            x = jnp.sin(x) if i % 2 else jnp.cos(x)
            if i % 10 == 9:
                x = stx.save_inter(x, name="c")
        return x

    def f_hand(x):
        acts = {}
        for i in range(n):
            x = jnp.sin(x) if i % 2 else jnp.cos(x)
            if i % 10 == 9:
                acts[f"c_{len(acts)}"] = x
        return x, acts

    return f, f_hand


def trace_ratio(label, make, args, repeats=41):
    """make() -> (f, f_hand), fresh each run."""

    def pulled():
        f, _ = make()
        jax.make_jaxpr(stx.pull(f))(*args)

    def hand():
        _, f_hand = make()
        jax.make_jaxpr(f_hand)(*args)

    report(f"trace    {label}", "<= 1.2", *interleaved_ratio(pulled, hand, repeats=repeats))


def check(make, args):
    f, f_hand = make()
    out, inters = stx.pull(f)(*args)
    ref, ref_inters = f_hand(*args)
    assert set(inters) == set(ref_inters), (sorted(inters), sorted(ref_inters))
    for key in ref_inters:
        assert jnp.allclose(inters[key], ref_inters[key], rtol=1e-4, atol=1e-5), key


def main():
    print(f"JAX {jax.__version__}, {jax.devices()[0].platform}")
    params, x = mlp_params(512), jax.random.normal(jax.random.key(1), (256, 512))
    tparams, tx = transformer_params(), jax.random.normal(jax.random.key(2), (SEQ, D_MODEL))
    chain_x = jnp.linspace(0.0, 1.0, 8)
    check(lambda: make_mlp()[:2], (params, x))
    check(make_step, (params, x))
    check(make_transformer, (tparams, tx))
    check(lambda: make_chain(100), (chain_x,))

    trace_ratio("MLP, 16 marks", lambda: make_mlp()[:2], (params, x))
    trace_ratio("training step (value_and_grad + SGD)", make_step, (params, x))
    trace_ratio("transformer layer in a scan", make_transformer, (tparams, tx))
    for n, repeats in ((1_000, 21), (10_000, 9), (50_000, 5)):
        trace_ratio(f"straight line, {n} equations", lambda n=n: make_chain(n), (chain_x,), repeats)

    def marked():
        jax.make_jaxpr(make_mlp()[0])(params, x)

    def plain():
        jax.make_jaxpr(make_mlp()[2])(params, x)

    def bare():
        jax.make_jaxpr(lambda *args: bare_marks(*args))(params, x)

    report(
        "unpulled marks: make_jaxpr(f) / make_jaxpr(f_plain), MLP",
        "<= 1.05",
        *interleaved_ratio(marked, plain, repeats=41),
    )
    report(
        "  floor: a bare staged mark per layer / f_plain",
        "(info)",
        *interleaved_ratio(bare, plain, repeats=41),
    )

    small, sx = mlp_params(64), jax.random.normal(jax.random.key(3), (8, 64))
    f, f_hand, _ = make_mlp()
    pulled, hand = stx.pull(jax.jit(f)), jax.jit(f_hand)
    out, acts = pulled(small, sx)
    assert set(acts) == set(hand(small, sx)[1])
    report(
        "dispatch pull(jit(f)) / jit(f_hand), MLP width 64, batch 8",
        "<= 1.1",
        *interleaved_ratio(
            lambda: jax.block_until_ready(pulled(small, sx)),
            lambda: jax.block_until_ready(hand(small, sx)),
            repeats=301,
        ),
        unit="us",
        scale=1e6,
    )


if __name__ == "__main__":
    main()
