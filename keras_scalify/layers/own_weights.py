"""Scaled kernels held by custom layers: mixture-of-experts banks and the like.

keras-hub's mixture-of-experts models (Mixtral, Qwen-MoE, Qwen3-MoE)
keep their experts' kernels as weights of a custom layer (one
`(experts, in, out)` tensor per projection) and contract them with
`keras.ops.einsum` in its `call`: there is no Dense layer to convert.
`scalify` converts such weights wherever they are (`scale_own_weights`):
a float, trainable weight of rank >= 2 held by a custom layer (not one of
Keras's own, whose code calls backend ops directly) whose parent is a
layer, not a model (so the layer runs inside a scaled region: a model's
graph nodes take no ScaledTensor) becomes a `ScaledVariable` of the same
path, in the policy's master dtype, and the layer's attribute holds it.

While the layer runs (`layers/regions.py`), the attribute holds the
weight's read (`ScaledVariable.read()`, a ScaledTensor), so the layer's
own code computes on it through the `keras.ops` dispatch, and a
two-operand `keras.ops.einsum` / `matmul` with it as an operand runs the
policy's GEMM (`contract`: FP8 under `scaled_fp8`, the casts of the
policy otherwise), as a Dense layer's kernel does. `unscale_own_weights`
puts plain variables with the represented values back (`unscalify`).
"""

import keras
import numpy as np

from keras_scalify.convert_inplace import walk_sublayers
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import name_scopes_of
from keras_scalify.layers.base import policy_field
from keras_scalify.layers.dense import policy_matmul
from keras_scalify.layers.variable import ScaledVariable
from keras_scalify.ops.boundary import encode

_ATTR = "_ksc_own_weights"


class _WeightPolicy:
    """What `policy_matmul` reads of a layer, for a custom layer's own
    weights: the scaled policy's fields and compute dtype."""

    def __init__(self, policy):
        self.dtype_policy = policy
        self.compute_dtype = policy.compute_dtype
        self._fp8_route = None  # the last contraction's (`policy_matmul`)

    def policy_dtype(self, field):
        return policy_field(self.dtype_policy, field)


def has_own_weights(layer):
    """Whether `scale_own_weights` converted `layer`'s weights."""
    return _ATTR in layer.__dict__


def _own_kernels(layer):
    """`[(attribute, variable)]`: the float trainable weights of rank >= 2
    that `layer` holds itself (not through sublayers), by attribute."""
    own = {id(v) for v in layer._trainable_variables}
    out = []
    for attr, value in list(vars(layer).items()):
        if not isinstance(value, keras.Variable) or id(value) not in own:
            continue
        dtype = keras.backend.standardize_dtype(value.dtype)
        if "float" in dtype and len(value.shape) >= 2:
            out.append((attr, value))
    return out


def _eligible(parent, layer):
    return not (
        isinstance(layer, (ScaledLayer, keras.Model))
        or isinstance(parent, keras.Model)
        or type(layer).__module__.startswith("keras.")
        or has_own_weights(layer)
    )


def plain_kernel_owners(root):
    """`{id(variable): layer}` of the kernels `scale_own_weights` would
    convert under `root` (`debug.gemm_coverage` counts their GEMMs)."""
    owners = {}

    def visit(parent, layer):
        if _eligible(parent, layer):
            owners.update({id(v): layer for _, v in _own_kernels(layer)})
        return True

    walk_sublayers(root, visit)
    return owners


def scale_own_weights(parent, layer, policy):
    """Converts `layer`'s own kernels (see the module) under `policy` (a
    dtype policy); returns whether it converted any."""
    if not _eligible(parent, layer):
        return False
    kernels = _own_kernels(layer)
    if not kernels:
        return False
    holder = _WeightPolicy(policy)
    weights = {}
    for attr, variable in kernels:
        value = np.asarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)
        layer._untrack_variable(variable)
        sv = _add(layer, variable.name, value, holder, variable.trainable)
        weights[attr] = (sv, keras.backend.standardize_dtype(variable.dtype))
        object.__setattr__(layer, attr, sv)
    object.__setattr__(layer, _ATTR, weights)
    object.__setattr__(layer, "_ksc_weight_policy", holder)
    return True


def _add(layer, name, value, holder, trainable):
    layer._tracker.unlock()
    try:
        with name_scopes_of(layer):
            return ScaledVariable(
                layer,
                name,
                value.shape,
                lambda shape, dtype=None: keras.ops.convert_to_tensor(value, dtype),
                holder.policy_dtype("master_dtype"),
                trainable,
                holder.policy_dtype("state_dtype"),
            )
    finally:
        layer._tracker.lock()


def unscale_own_weights(layer):
    """Plain variables with the represented values again (`unscalify`)."""
    weights = layer.__dict__.get(_ATTR)
    if weights is None:
        return
    for attr, (sv, dtype) in weights.items():
        value = sv.numpy()
        trainable = sv.data.trainable
        for v in sv.variables:
            layer._untrack_variable(v)
        layer._tracker.unlock()
        try:
            with name_scopes_of(layer):
                variable = layer.add_weight(
                    name=sv.name,
                    shape=value.shape,
                    initializer=lambda shape, dtype=None, value=value: keras.ops.convert_to_tensor(value, dtype),
                    dtype=dtype,
                    trainable=trainable,
                )
        finally:
            layer._tracker.lock()
        object.__setattr__(layer, attr, variable)
    object.__delattr__(layer, _ATTR)
    object.__delattr__(layer, "_ksc_weight_policy")


def weight_reads(layer):
    """`[(attribute, read, contract)]` for one call of `layer`: each own
    weight read once (a ScaledTensor) and its contraction (see `contract`)."""
    holder = layer._ksc_weight_policy
    out = []
    for attr, (sv, _) in layer.__dict__[_ATTR].items():

        def contract_with(subscripts, operands, index, sv=sv):
            return contract(holder, sv, subscripts, operands, index)

        contract_with.layer = layer  # (for `debug.gemm_coverage`)
        out.append((attr, sv.read(), contract_with))
    return out


def contract(holder, sv, subscripts, operands, index):
    """`einsum(subscripts, *operands)` (or `matmul` for None) with the
    weight `sv`'s read at `operands[index]`, as `policy_matmul` runs a
    Dense layer's: the weight second (an einsum's operands are swapped
    when it is first), plain float operands encoded with the pow2 of
    their RMS (`ops.boundary.encode`). None (the rule runs) for an
    einsum without an explicit output."""
    if subscripts is not None and "->" not in subscripts:
        return None
    x, w = [o if is_scaled(o) else encode(o) for o in operands]
    calibrated = sv.calibrated
    if index == 0:
        if subscripts is None:  # `matmul(w, x)`: no vote for the weight
            calibrated = None
        else:
            inputs, output = subscripts.replace(" ", "").split("->")
            first, second = inputs.split(",")
            subscripts = f"{second},{first}->{output}"
            x, w = w, x
    return policy_matmul(holder, subscripts, x, w, calibrated=calibrated)
