"""statax quickstart: pull a model's activations out through jit, grad and vmap."""

import equinox as eqx
import jax
import jax.numpy as jnp

import statax as stx


class MLP(eqx.Module):
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.layers = [eqx.nn.Linear(8, 8, key=k) for k in keys]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = stx.save_inter(jax.nn.tanh(layer(x)), name=f"layer{i}")
        return x


def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


model = MLP(jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (32, 8))

# Values saved inside vmap come back batched; grad sees the primal values.
(loss_value, grads), acts = stx.pull(eqx.filter_jit(eqx.filter_value_and_grad(loss)))(model, x)
print(f"loss {loss_value:.4f}")
for name, act in acts.items():
    print(f"{name}: shape {act.shape}, mean {act.mean():+.4f}, std {act.std():.4f}")

# The other order gives the same values.
(_, acts2), _ = eqx.filter_value_and_grad(stx.pull(loss), has_aux=True)(model, x)
assert all(jnp.allclose(acts[k], acts2[k], atol=1e-6) for k in acts)
print("pull(value_and_grad(loss)) == value_and_grad(pull(loss)): ok")
