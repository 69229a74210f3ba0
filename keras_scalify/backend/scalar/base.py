"""The backend flags, the torch types, compile and inference-mode state,
and the checks on tensors and dtypes (`dtype_name`, `is_tensor`,
`has_dtype`, `valid_scaled_fields`, `needs_gradient`) that the other
submodules of `backend.scalar` build on."""

import keras
from keras import ops

TORCH = keras.backend.backend() == "torch"

_DTYPE_NAMES = {}


def dtype_name(dtype):
    """Keras's `standardize_dtype`, memoized by the dtype object (the rules
    ask for operands' dtypes thousands of times per step)."""
    if dtype is None:  # floatx, which may change
        return keras.backend.standardize_dtype(dtype)
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = keras.backend.standardize_dtype(dtype)
        if not _compiling():
            # (Under `torch.compile`, a write to a global inside a custom
            # gradient is a graph break.)
            _DTYPE_NAMES[dtype] = name
        return name
    except TypeError:  # unhashable
        return keras.backend.standardize_dtype(dtype)


def _compiling():
    """Whether `torch.compile` is tracing this call."""
    if not TORCH:
        return False
    import torch

    return torch.compiler.is_compiling()


if TORCH:
    import torch

    from keras.src.backend.torch.core import to_torch_dtype as _keras_torch_dtype

    _DTYPES = {}
    _NUMBERS = (int, float, bool)

    def to_torch_dtype(dtype):
        """Keras's `to_torch_dtype`, memoized (it standardizes the name on
        every call)."""
        out = _DTYPES.get(dtype)
        if out is None:
            out = _keras_torch_dtype(dtype)
            if not _compiling():
                _DTYPES[dtype] = out
        return out

    _TENSOR = torch.Tensor
    _is_compiling = torch.compiler.is_compiling
    # A tensor made under `torch.inference_mode` cannot be saved for a
    # backward outside it: no cached tensor is made there.
    _is_inference = torch.is_inference_mode_enabled

    _PARAMETER = torch.nn.Parameter

    def is_tensor(x):
        return isinstance(x, torch.Tensor)

    _FLOAT_DTYPES = {
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    }

    def valid_scaled_fields(data, scale, grad_scale):
        """Whether a ScaledTensor takes these as they are (its checks would
        pass and convert nothing): torch tensors, float data, 0-d float32
        scales. The rules build ~300 ScaledTensors per step of a small
        GPT."""
        return (
            type(scale) is _TENSOR
            and type(grad_scale) is _TENSOR
            and type(data) is _TENSOR
            and scale.dtype is torch.float32
            and grad_scale.dtype is torch.float32
            and data.dtype in _FLOAT_DTYPES
            and scale.dim() == 0
            and grad_scale.dim() == 0
        )

    def has_dtype(x, dtype):
        """Whether `x` is a tensor of the (standardized) `dtype`."""
        return isinstance(x, torch.Tensor) and x.dtype == to_torch_dtype(dtype)

    def needs_gradient(x):
        """Whether autograd will ask for `x`'s cotangent (`requires_grad`;
        a model's input does not, so the first layer's GEMM skips its
        input gradient, as Keras's own layers do)."""
        return not isinstance(x, torch.Tensor) or x.requires_grad

else:
    _TF = keras.backend.backend() == "tensorflow"

    is_tensor = ops.is_tensor

    def valid_scaled_fields(data, scale, grad_scale):
        """False: a ScaledTensor checks its fields (traced once here)."""
        return False

    def has_dtype(x, dtype):
        """Whether `x` is a tensor of the (standardized) `dtype`."""
        return ops.is_tensor(x) and dtype_name(x.dtype) == dtype

    def needs_gradient(x):
        """Always (traced backends drop an unused cotangent themselves)."""
        return True
