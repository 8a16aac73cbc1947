"""Keras layers selected by scope path (a layer's name, under those of the layers that call
it), marked where they run, on their call's output: what `keras.Model(inputs, layer.output)`
gives, not the state updates (a `BatchNormalization`'s moving statistics, a `Dropout`'s seed)
that also leave the layer's scope in training, and also for a layer that makes no equations
(a `Dropout` in inference).

Keras has no method interceptor: for the call, `keras.layers.Layer.__call__` is wrapped, and
put back when it returns. The path is JAX's name stack where the layer is called, and the
layer's name, as Keras names the scope it runs `call` in.
"""

from __future__ import annotations

import functools
import sys

from jax.extend import source_info_util as source_info_api

from .running import mark_selected, marking
from .vocabulary import Scopes
from .where import is_transform

__all__ = ["with_keras"]


def with_keras(call, chosen: tuple[Scopes, ...], tree, *args, **kwargs):
    """`call(tree, *args, **kwargs)` with the Keras layers whose scopes `chosen` selects
    marked as they run."""
    keras = sys.modules.get("keras")
    marked = marking()
    layer = getattr(getattr(keras, "layers", None), "Layer", None)
    if layer is None or marked is None or "__call__" not in vars(layer):
        return call(tree, *args, **kwargs)
    original = vars(layer)["__call__"]

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):  # noqa: N807
        out = original(self, *args, **kwargs)
        stack = source_info_api.current_name_stack().stack
        names = [e.name for e in stack if not is_transform(e)] + [self.name]
        return mark_selected(chosen, names, out, marked)

    layer.__call__ = __call__
    try:
        return call(tree, *args, **kwargs)
    finally:
        layer.__call__ = original
