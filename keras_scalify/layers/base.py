"""Shared base of the scaled layers."""

import contextlib
import functools

import keras
import numpy as np

from keras_scalify import ops as sops
from keras_scalify.backend.scalar import _compiling
from keras_scalify.core.formats import FORMATS
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.layers.variable import ScaledVariable
from keras_scalify.layers.weights import add_grad_scale_state
from keras_scalify.layers.weights import assign_weights
from keras_scalify.layers.weights import count_weight_params
from keras_scalify.layers.weights import weight_values
from keras_scalify.ops.boundary import as_scaled
from keras_scalify.ops.boundary import encode
from keras_scalify.ops.symbolic import _has_symbolic

_DEFAULTS = {
    "compute_dtype": None,
    "matmul_dtype": None,
    "grad_dtype": None,
    "master_dtype": "float32",
    "state_dtype": "float32",
}


def policy_field(policy, field):
    """A scaled policy's `field` (matmul, grad, master, compute, state
    dtype); for a plain Keras policy the defaults: no low-precision casts
    (the compute dtype) and float32 master weights and states."""
    value = getattr(policy, field, None)
    if value is None:
        value = _DEFAULTS[field]
    if value is None:
        value = policy.compute_dtype
    return value


@contextlib.contextmanager
def name_scopes_of(layer):
    """The name scopes `layer` was created in: a layer made in them has
    `layer`'s path, and its variables have the paths of `layer`'s (paths
    name weights in optimizers, layout maps and summaries; two weights
    with one path made training on torch diverge)."""
    with contextlib.ExitStack() as scopes:
        for part in layer.path.split("/")[:-1]:
            scopes.enter_context(keras.name_scope(part))
        yield


class ScaledLayer(keras.layers.Layer):
    """A layer that takes and returns ScaledTensors.

    - Keras's input autocasting is turned off: it would cast the float32
      scale and grad scale of a ScaledTensor to the compute dtype.
    - `add_scaled_weight` creates a `ScaledVariable` in the policy's master
      dtype; `get_weights`/`set_weights` work on represented values, in the
      order of the Keras counterpart (delayed-rescaling states, which are
      bookkeeping, are left out; `.keras` files keep every variable).
    - `policy_dtype(field)` reads the scaled policy's fields (matmul, grad,
      master, compute dtypes); a plain Keras policy means no low-precision
      casts and float32 master weights.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        self._scaled_weights = []
        self._plain_io_dtype = None

    @property
    def plain_io(self):
        """Whether the layer takes and returns plain tensors (see
        `enable_plain_io`)."""
        return self._plain_io_dtype is not None

    def enable_plain_io(self, dtype="float32", keras_name=None):
        """Make this built layer take plain tensors and return plain tensors
        of `dtype`, for use inside plain Keras code (what `scalify` does to
        the sublayers of custom layers; `keras_scalify.layers.plain_io`).
        Adds the `plain_io_grad_scale_state` weight of the output's delayed
        gradient rescale. Not saved in `get_config`: the layer that holds
        this one decides it.

        The layer takes a subclass of its class (named `keras_name`, the
        Keras class it replaces, when given: Keras's saving names the
        layers of a Functional graph after their class, so the weights file
        of the converted model has the original's layout, and the
        `scalify` replayed by `load_model` finds its weights, see
        `keras_scalify.models`) whose output spec is plain, so symbolic
        calls record plain outputs."""
        if not self.built:
            raise ValueError(
                f"Layer {self.name!r} must be built before `enable_plain_io`."
            )
        if self.plain_io:
            return
        self._tracker.unlock()
        try:
            self.plain_io_grad_scale_state = add_grad_scale_state(
                self, "plain_io_grad_scale_state"
            )
        finally:
            self._tracker.lock()
        self._plain_io_dtype = keras.backend.standardize_dtype(dtype)
        object.__setattr__(
            self,
            "__class__",
            _plain_io_class(type(self), keras_name or type(self).__name__),
        )

    def __repr__(self):
        if not self.plain_io:
            return super().__repr__()
        cls = getattr(type(self), "_scaled_class_name", type(self).__name__)
        return f"<{cls} name={self.name}, built={self.built}, plain_io=True>"

    def compute_output_spec(self, *args, **kwargs):
        """By default, traced from `call` (Keras would derive it from
        `compute_output_shape`, which is derived from this)."""
        return keras.Operation.compute_output_spec(self, *args, **kwargs)

    def compute_output_shape(self, *args, **kwargs):
        """The data shape(s) of `compute_output_spec` on inputs of these
        shapes (Keras layers, keras-hub blocks and wrappers such as
        `TimeDistributed` ask for shapes)."""

        def spec(shape):
            if isinstance(shape, (tuple, list)) and all(
                d is None or isinstance(d, (int, np.integer)) for d in shape
            ):
                return keras.KerasTensor(tuple(shape), dtype=self.compute_dtype)
            return shape

        out = self.compute_output_spec(
            *[spec(a) for a in args], **{k: spec(v) for k, v in kwargs.items()}
        )
        return keras.tree.map_structure(lambda t: tuple(t.shape), plain_shapes_of(out))

    def __call__(self, *args, **kwargs):
        # Input autocasting is off (see above), so NumPy inputs are turned
        # into tensors here: Keras builds layers from tensor shapes only.
        args = tuple(_numpy_to_tensor(a) for a in args)
        kwargs = {
            k: _numpy_to_tensor(v) if k in TENSOR_KWARGS else v
            for k, v in kwargs.items()
        }
        args = tuple(_repack_scaled(a) for a in args)
        min_ndim = getattr(self, "_min_input_ndim", None)
        if min_ndim is not None and args:
            x = args[0].data if is_scaled(args[0]) else args[0]
            if hasattr(x, "shape") and len(x.shape) < min_ndim:
                raise ValueError(
                    f"Input 0 of layer {self.name!r} is incompatible with the "
                    f"layer: expected min_ndim={min_ndim}, found "
                    f"ndim={len(x.shape)} (`inputs` of shape {tuple(x.shape)})."
                )
        kwargs = {k: _repack_scaled(v) for k, v in kwargs.items()}
        if (
            self.built
            and self.input_spec is None
            and "call" not in self.__dict__
            and not _symbolic_or_compiling(args, kwargs)
        ):
            # Eager: each ScaledTensor passes Keras's `Layer.__call__` as
            # one opaque leaf, unwrapped by the class's `call`
            # (`__init_subclass__`; a `call` set on the instance, as
            # `debug` and `scalify`'s regions do, gets them as they are).
            # Keras walks the arguments ~6 times per call (conversion,
            # CallSpec, masks, symbolic checks), and its torch tree rebuilds
            # a named tuple at each walk (~15 µs per ScaledTensor, against
            # 0.2 for a leaf; ~3 ms per step of the benchmarks' GPT).
            args = tuple(_as_leaf(a) for a in args)
            kwargs = {k: _as_leaf(v) for k, v in kwargs.items()}
        return super().__call__(*args, **kwargs)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("call")
        if call is not None and not getattr(call, "_ksc_unwraps_leaves", False):
            cls.call = _unwrapping_leaves(call)

    @property
    def fp8_route(self):
        """The FP8 GEMM route this layer's last call took (None if it ran
        no FP8 GEMM): see `keras_scalify.backend.fp8`."""
        return getattr(self, "_fp8_route", None)

    def policy_dtype(self, field):
        return policy_field(self.dtype_policy, field)

    def _check_quantize_args(self, mode, compute_dtype):
        # Keras runs this check first in every layer's `quantize`.
        raise ValueError(
            f"Layer {self.name!r} is a keras_scalify scaled layer: Keras's "
            f"`quantize({mode!r})` applies to plain layers. Quantize the "
            f"plain model: `keras_scalify.unscalify(model)` (the trained, "
            f"represented weights), then `model.quantize({mode!r})`; a model "
            f"that `scalify` converted in place does both in its own "
            f"`quantize`."
        )

    def add_scaled_weight(self, name, shape, initializer, trainable=True):
        sv = ScaledVariable(
            self,
            name,
            shape,
            initializer,
            self.policy_dtype("master_dtype"),
            trainable,
            self.policy_dtype("state_dtype"),
        )
        self._scaled_weights.append(sv)
        return sv

    @property
    def scaled_weights(self):
        return list(self._scaled_weights)

    def get_weights(self):
        """The Keras twin's weights: a scaled weight's represented float32
        value (`weight_values`), plain weights as they are."""
        return weight_values(self)

    def set_weights(self, weights):
        """Sets the Keras twin's weights (`get_weights` order): a scaled
        weight is split into data and pow2 scale (`assign_weights`)."""
        assign_weights(self, weights)

    def count_params(self):
        """The Keras twin's parameter count (`count_weight_params`)."""
        return count_weight_params(self)

    def get_build_config(self):
        """Keras's build config with plain shapes: a ScaledTensor input
        records `ScaledTensor(shape, (), ())`, which neither JSON nor
        `build_from_config` (used when a `.keras` file is loaded) can read;
        its data shape is kept."""
        config = super().get_build_config()
        return None if config is None else plain_shapes(config)


_PLAIN_IO_CLASSES = {}


def plain_shapes_of(spec):
    """A ScaledTensor spec as the KerasTensor of its data (structures
    walked)."""
    return map_scaled(lambda x: x.data if is_scaled(x) else x, spec)


def _plain_io_class(cls, name):
    """The plain-I/O subclass of scaled class `cls`, named `name`: its
    output spec is the scaled spec's data, in the plain dtype (cached)."""
    key = (cls, name)
    if key not in _PLAIN_IO_CLASSES:

        def call(self, *args, **kwargs):
            # At the `call` level, so that wrappers calling `layer.call`
            # directly (TimeDistributed) get plain values too.
            # (Local: plain_io imports base, directly and through regions.)
            from keras_scalify.layers.plain_io import plain_io_call

            return plain_io_call(
                self, functools.partial(cls.call, self), args, kwargs
            )

        def compute_output_spec(self, *args, **kwargs):
            out = plain_shapes_of(cls.compute_output_spec(self, *args, **kwargs))
            return keras.tree.map_structure(
                lambda t: keras.KerasTensor(t.shape, dtype=self._plain_io_dtype),
                out,
            )

        _PLAIN_IO_CLASSES[key] = type(
            name,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": f"{cls.__qualname__}.{name}",
                "_scaled_class_name": cls.__name__,
                "call": call,
                "compute_output_spec": compute_output_spec,
            },
        )
    return _PLAIN_IO_CLASSES[key]


# Keyword arguments that carry input tensors (attention's query/value/key).
TENSOR_KWARGS = ("inputs", "query", "value", "key")


def _numpy_to_tensor(x):
    """A NumPy array or scalar as a tensor (float64 as float32)."""
    if not isinstance(x, (np.ndarray, np.generic)) or isinstance(x, np.bool_):
        return x
    x = np.asarray(x)
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    return keras.ops.convert_to_tensor(x)


def contains_scaled(x):
    if is_scaled(x):
        return True
    if isinstance(x, dict):
        return any(contains_scaled(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(contains_scaled(v) for v in x)
    return False


class _Leaf:
    """A ScaledTensor argument carried through Keras's `Layer.__call__` as
    one opaque value (see `ScaledLayer.__call__`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _as_leaf(x):
    """A ScaledTensor argument (or a list or tuple of nothing but
    ScaledTensors) as `_Leaf`s. (Keras refuses a list that mixes tensors
    and other values: a list with plain tensors is left as it is.)"""
    if is_scaled(x):
        return _Leaf(x)
    if type(x) in (list, tuple) and x and all(is_scaled(v) for v in x):
        return type(x)(_Leaf(v) for v in x)
    return x


def _from_leaf(x):
    """`_as_leaf`'s inverse."""
    if type(x) is _Leaf:
        return x.value
    if type(x) in (list, tuple) and any(type(v) is _Leaf for v in x):
        return type(x)(v.value if type(v) is _Leaf else v for v in x)
    return x


def _unwrapping_leaves(call):
    """`call` given its arguments back from `_Leaf`s."""

    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        args = [_from_leaf(a) for a in args]
        kwargs = {k: _from_leaf(v) for k, v in kwargs.items()}
        return call(self, *args, **kwargs)

    wrapper._ksc_unwraps_leaves = True
    return wrapper


def _symbolic_or_compiling(args, kwargs):
    """Whether the arguments hold KerasTensors (a symbolic call, which
    Keras records by walking them) or `torch.compile` is tracing."""
    return _compiling() or _has_symbolic(args, kwargs)


def _repack_scaled(x):
    """Rebuilds ScaledTensor arguments flattened by a saved model's config.

    A Functional model's config stores each call's arguments as JSON, where
    a ScaledTensor (a named tuple) becomes a list of its three symbolic
    tensors, and a mask Keras filled as ScaledTensor(None, None, None)
    becomes [None, None, None]. When `load_model` replays the calls, such
    lists (symbolic: data, then two float32 scalars) are packed back into a
    ScaledTensor, and [None, None, None] into None. Eager values are never
    touched.
    """
    if is_scaled(x):
        return x
    if isinstance(x, dict):
        return {k: _repack_scaled(v) for k, v in x.items()}
    if not isinstance(x, (list, tuple)) or hasattr(x, "_fields"):
        return x
    if len(x) == 3:
        if all(v is None for v in x):
            return None
        if _flattened_scaled(x):
            return ScaledTensor(*x)
    out = [_repack_scaled(v) for v in x]
    return out if isinstance(x, list) else tuple(out)


def _flattened_scaled(x):
    if not all(isinstance(v, keras.KerasTensor) for v in x):
        return False
    data, scale, grad_scale = x
    std = keras.backend.standardize_dtype
    return (
        "float" in std(data.dtype)
        and all(tuple(v.shape) == () and std(v.dtype) == "float32" for v in (scale, grad_scale))
    )


def cast_to_compute(layer, inputs, grad_scale=None):
    """`inputs` as a ScaledTensor in `layer`'s compute dtype: what Keras's
    input autocasting does for plain layers, done on the data only (the
    scale stays float32).

    A ScaledTensor keeps its scale. A plain tensor gets scale 1 when its
    dtype is the compute dtype or narrower; cast to a narrower compute
    dtype (float32 inputs of a float16 layer) it is encoded first with the
    pow2 of its RMS in the scale (`ops.boundary.encode`), so a value beyond
    the compute format (1e30, 2**-30) is represented, not clipped or
    flushed, and ±inf/NaN propagate. `grad_scale` (plain inputs only): the
    pow2 gradient scale given to them (default 1).
    """
    dtype = keras.backend.standardize_dtype(layer.compute_dtype)
    if is_scaled(inputs):
        return inputs if inputs.dtype == dtype else sops.cast(inputs, dtype)
    x = as_scaled(inputs, grad_scale=grad_scale)
    wider = float("inf")
    if FORMATS[dtype].max < getattr(FORMATS.get(x.dtype), "max", wider):
        x = encode(inputs, x.grad_scale)
    return x if x.dtype == dtype else sops.cast(x, dtype)


def to_float32(x):
    """A ScaledTensor's data in float32 (a no-op when it already is).

    Scaled layers do their elementwise work (bias, affine, activation,
    residual sums) in float32 and round once to the compute dtype at the
    end, as a fused GPU epilogue does: fewer roundings, and the gradients
    of biases and norm parameters are summed in float32."""
    return x if x.dtype == "float32" else sops.cast(x, "float32")


def plain_shapes(structure):
    """`structure` with every ScaledTensor of shapes replaced by its data
    shape (a tuple); lists, tuples and dicts are walked."""
    if is_scaled(structure):
        return plain_shapes(structure.data)
    if isinstance(structure, dict):
        return {k: plain_shapes(v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        if all(d is None or isinstance(d, (int, np.integer)) for d in structure):
            return tuple(None if d is None else int(d) for d in structure)
        out = [plain_shapes(v) for v in structure]
        return out if isinstance(structure, list) else tuple(out)
    return structure


class KernelBiasMixin:
    """`kernel`/`bias` (ScaledVariables) and their float32 values."""

    @property
    def kernel(self):
        return self._kernel

    @property
    def bias(self):
        return self._bias

    @property
    def kernel_value(self):
        """The represented float32 kernel."""
        return self._kernel.value

    @property
    def bias_value(self):
        return None if self._bias is None else self._bias.value


def scaled_spec(shape, dtype):
    """A symbolic ScaledTensor: data of `shape`/`dtype`, float32 scalars."""
    return ScaledTensor(
        keras.KerasTensor(tuple(shape), dtype=dtype),
        keras.KerasTensor((), dtype="float32"),
        keras.KerasTensor((), dtype="float32"),
    )


def spec_like(x):
    """Fresh symbolic tensors with the shapes and dtypes of `x`."""
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), x
    )
