"""What a selection (`at=`) costs against the same values marked by hand.

* program: the number of HLO instructions of the compiled program (XLA's optimised text), for
  `stx.pull(f, at=selection)` against `stx.pull(f_marked)`, where `f_marked` is `f` with a
  `save_inter` at each selected place (the goal: equal); and for `f` unpulled, with its named
  scopes, against `f` without them (equal: a scope nobody selects changes nothing);
* trace: `jax.make_jaxpr(stx.pull(f, at=selection))` / `jax.make_jaxpr(stx.pull(f_marked))`,
  median of interleaved runs, each with fresh function objects (no cache hit), timed from the
  call to the finished jaxpr (goal: <= 1.2).

Workloads: bench_core's 16-layer MLP (width 512, batch 256) with a named scope per layer,
selected by `stx.scopes("layer*")`; bench_trace's transformer layer in a `lax.scan` (4 layers),
its attention and residual under named scopes, selected by `stx.scopes("attn", "resid")`;
and an equinox MLP of 16 `eqx.nn.Linear` layers, selected by `stx.modules("layers[*]")`.

Run: `python benchmarks/bench_select.py` (about a minute on 2 CPU cores).
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
from _timing import interleaved_ratio, report
from bench_core import init, marked
from bench_trace import D_MODEL, SEQ, _layer, transformer_params
from jax import lax

import statax as stx


def hlo_ops(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(r"^\s+\S+ = ", text, flags=re.M))


# ---- the MLP, its layers under named scopes -----------------------------------------------------


def make_mlp():
    def scoped(params, x):
        for i, w in enumerate(params):
            with jax.named_scope(f"layer{i}"):
                x = jnp.tanh(x @ w)
        return jnp.sum(x)

    def hand(params, x):
        return marked(params, x)  # save_inter(..., name=f"layer{i}") per layer

    def plain(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    return scoped, hand, plain, stx.scopes("layer*")


# ---- the transformer layer in a scan ------------------------------------------------------------


def make_transformer():
    def scoped(params, x):
        def body(x, p):
            return _layer_scoped(x, p), None

        return jnp.sum(lax.scan(body, x, params)[0])

    def hand(params, x):
        def body(x, p):
            return _layer(x, p, lambda v, name: stx.save_inter(v, name=name)), None

        return jnp.sum(lax.scan(body, x, params)[0])

    def plain(params, x):
        def body(x, p):
            return _layer(x, p, lambda v, name: v), None

        return jnp.sum(lax.scan(body, x, params)[0])

    return scoped, hand, plain, stx.scopes("attn", "resid")


def _layer_scoped(x, p):
    """bench_trace's `_layer`, with the computations of the values it marks under scopes."""

    def heads(y):
        return y.reshape(SEQ, 4, D_MODEL // 4).transpose(1, 0, 2)

    q, k, v = heads(x @ p["q"]), heads(x @ p["k"]), heads(x @ p["v"])
    with jax.named_scope("attn"):
        att = jax.nn.softmax(q @ k.transpose(0, 2, 1) / (D_MODEL // 4) ** 0.5)
    y = (att @ v).transpose(1, 0, 2).reshape(SEQ, D_MODEL) @ p["o"]
    with jax.named_scope("resid"):
        x = x + y
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


# ---- an equinox MLP, selected by module path -----------------------------------------------------


class Layer(eqx.Module):
    linear: eqx.nn.Linear
    name: str = eqx.field(static=True, default="")

    def __call__(self, x):
        y = jnp.tanh(self.linear(x))
        return stx.save_inter(y, name=self.name) if self.name else y


class MLP(eqx.Module):
    layers: tuple

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return jnp.sum(x)


def make_eqx(width=512, depth=16, names=False):
    keys = jax.random.split(jax.random.key(3), depth)
    return MLP(
        tuple(
            Layer(eqx.nn.Linear(width, width, key=k), f"layers[{i}]" if names else "")
            for i, k in enumerate(keys)
        )
    )


def check(selected, by_hand, args):
    out, inters = selected(*args)
    ref, ref_inters = by_hand(*args)
    assert list(inters) == list(ref_inters), (list(inters), list(ref_inters))
    for key in ref_inters:
        assert jnp.allclose(inters[key], ref_inters[key], rtol=1e-5, atol=1e-6), key


def main():
    print(f"JAX {jax.__version__}, {jax.devices()[0].platform}")
    params, x = init(jax.random.key(0), 512), jax.random.normal(jax.random.key(1), (256, 512))
    tparams, tx = transformer_params(), jax.random.normal(jax.random.key(2), (SEQ, D_MODEL))
    model, model_marked = make_eqx(), make_eqx(names=True)
    batched = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    cases = [
        ("MLP, 16 scopes", make_mlp, (params, x)),
        ("transformer layer in a scan", make_transformer, (tparams, tx)),
    ]
    for label, make, args in cases:
        scoped, hand, plain, sel = make()
        check(stx.pull(scoped, at=sel), stx.pull(hand), args)
        ops = hlo_ops(stx.pull(scoped, at=sel), *args), hlo_ops(stx.pull(hand), *args)
        unselected = hlo_ops(scoped, *args), hlo_ops(plain, *args)
        print(f"program  {label:<48} selected {ops[0]} vs by hand {ops[1]} HLO ops; "
              f"unselected {unselected[0]} vs no scopes {unselected[1]}")  # fmt: skip

    sel = stx.modules("layers[*]")
    check(stx.pull(batched, at=sel), lambda m, x: stx.pull(batched)(model_marked, x), (model, x))
    ops = hlo_ops(stx.pull(batched, at=sel), model, x), hlo_ops(stx.pull(batched), model_marked, x)
    print(f"program  {'equinox MLP, 16 modules':<48} selected {ops[0]} vs by hand {ops[1]} HLO ops")

    for label, make, args in cases:

        def selected(make=make, args=args):
            scoped, _, _, sel = make()
            jax.make_jaxpr(stx.pull(scoped, at=sel))(*args)

        def by_hand(make=make, args=args):
            _, hand, _, _ = make()
            jax.make_jaxpr(stx.pull(hand))(*args)

        report(f"trace    {label}", "<= 1.2", *interleaved_ratio(selected, by_hand, repeats=41))

    def selected_eqx():
        jax.make_jaxpr(stx.pull(lambda m, x: jax.vmap(m)(x), at=stx.modules("layers[*]")))(model, x)

    def by_hand_eqx():
        jax.make_jaxpr(stx.pull(lambda m, x: jax.vmap(m)(x)))(model_marked, x)

    ratio = interleaved_ratio(selected_eqx, by_hand_eqx, repeats=21)
    report("trace    equinox MLP, 16 modules", "<= 1.2", *ratio)


if __name__ == "__main__":
    main()
