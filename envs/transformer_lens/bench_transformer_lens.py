"""TransformerLens's activation patching on the weights `benchmarks/bench_sweep.py` sweeps, in
a process of its own: `patching.generic_activation_patch` over every block's output
(`resid_post`) at every position, and attribution patching written with TransformerLens's
hooks (a forward pass caching each block's output, a backward pass caching its gradient), each
checked against statax's results on the same weights and timed, first call and steady state.

Run `python benchmarks/bench_sweep.py --save DIR` first (it writes `DIR/gpt.npz` and
`DIR/sweep.npz`), then `python envs/transformer_lens/bench_transformer_lens.py DIR` (see
README.md here for the environment).
"""

import statistics
import sys
import time

import numpy as np
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig, patching


def build(weights) -> HookedTransformer:
    """The bench's GPT-2-shaped model as a `HookedTransformer`: its layer norms without
    weights (ones, zeros), no biases, no positional embedding, the tanh GELU."""
    layers = len({k.split(".")[1] for k in weights.files if k.startswith("blocks.")})
    vocab, width = weights["embed"].shape
    heads = int(weights["heads"])
    cfg = HookedTransformerConfig(
        n_layers=layers,
        d_model=width,
        n_ctx=weights["clean"].shape[1],
        d_head=width // heads,
        n_heads=heads,
        d_mlp=4 * width,
        d_vocab=vocab,
        act_fn="gelu_new",
        normalization_type="LN",
        default_prepend_bos=False,
        device="cpu",
    )
    model = HookedTransformer(cfg)
    d = width // heads
    tensor = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32)  # noqa: E731
    values = {"embed.W_E": tensor(weights["embed"]), "unembed.W_U": tensor(weights["unembed"])}
    for i in range(layers):
        qkv, proj = weights[f"blocks.{i}.qkv"], weights[f"blocks.{i}.proj"]
        per_head = lambda m: np.stack([m[:, h * d : (h + 1) * d] for h in range(heads)])  # noqa: E731
        values[f"blocks.{i}.attn.W_Q"] = tensor(per_head(qkv[:, :width]))
        values[f"blocks.{i}.attn.W_K"] = tensor(per_head(qkv[:, width : 2 * width]))
        values[f"blocks.{i}.attn.W_V"] = tensor(per_head(qkv[:, 2 * width :]))
        values[f"blocks.{i}.attn.W_O"] = tensor(proj.reshape(heads, d, width))
        values[f"blocks.{i}.mlp.W_in"] = tensor(weights[f"blocks.{i}.up"])
        values[f"blocks.{i}.mlp.W_out"] = tensor(weights[f"blocks.{i}.down"])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in values:
                parameter.copy_(values[name])
            elif name.endswith(".w"):  # a layer norm's weight
                parameter.fill_(1.0)
            else:  # biases, the positional embedding
                parameter.zero_()
    return model


def metric(logits):  # as the bench's: the mean of logit 1 minus logit 2 at the last position
    return (logits[:, -1, 1] - logits[:, -1, 2]).mean()


def exact(model, clean, corrupted):
    _, clean_cache = model.run_with_cache(clean)
    return patching.generic_activation_patch(
        model,
        corrupted,
        clean_cache,
        metric,
        patching.layer_pos_patch_setter,
        "resid_post",
        index_axis_names=("layer", "pos"),
    )


def attribution(model, clean, corrupted):
    """The clean run cached; the corrupted run's block outputs and their gradients, from hooks."""
    names = [f"blocks.{i}.hook_resid_post" for i in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in names)
    acts, grads = {}, {}

    def keep(act, hook):
        acts[hook.name] = act.detach()

    def keep_grad(grad, hook):
        grads[hook.name] = grad.detach()

    with model.hooks(
        fwd_hooks=[(n, keep) for n in names], bwd_hooks=[(n, keep_grad) for n in names]
    ):
        value = metric(model(corrupted))
        value.backward()
    model.zero_grad(set_to_none=True)
    return torch.stack(
        [value.detach() + ((clean_cache[n] - acts[n]) * grads[n]).sum(dim=(0, 2)) for n in names]
    )


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main(folder):
    weights = np.load(f"{folder}/gpt.npz")
    statax = np.load(f"{folder}/sweep.npz")
    clean, corrupted = (torch.tensor(weights[k]) for k in ("clean", "corrupted"))
    start = time.perf_counter()
    model = build(weights)
    built = time.perf_counter() - start
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; the model built in "
        f"{built:.2f} s"
    )
    for name, run, want in (
        ("exact (generic_activation_patch)", exact, statax["exact"]),
        ("attribution (hooks)", attribution, statax["attribution"]),
    ):
        first, got = timed(run, model, clean, corrupted)
        gap = np.abs(got.detach().numpy() - want).max()
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-3, atol=1e-3)
        steady = statistics.median(timed(run, model, clean, corrupted)[0] for _ in range(3))
        print(
            f"{name:<36} first call {first:8.2f} s, steady {steady:8.2f} s; agrees with "
            f"statax to {gap:.1e}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
