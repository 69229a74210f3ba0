"""The ops of scale arithmetic, with the least dispatch per call.

Scale rules and the power-of-two helpers run thousands of ops per training
step, nearly all on scalars (a GPT step of `benchmarks/step_time.py`: ~6,000
`keras.ops` calls). On eager torch, Keras's torch ops convert every operand
and resolve a result dtype before the kernel (5-20 µs per call on a scalar,
`divide_no_nan` ~20); the torch functions themselves take 1-2 µs. This
package gives the handful of ops the helpers use, named as in `keras.ops`,
as the torch functions on torch, and as `keras.ops` elsewhere (JAX and
TensorFlow trace them once into a compiled step, where dispatch costs
nothing per step).

The torch versions take what the helpers pass: tensors, and Python numbers
for the second operand (masks, shift counts, constants), whose dtype then
follows the tensor's, as in Keras. They are plain torch calls, so
`torch.compile` traces them too.

Use it as one module (`from keras_scalify.backend import scalar as S`):
the names below are its interface. Each submodule defines its torch
versions and those of JAX and TensorFlow side by side, and imports only
the submodules listed before it:

- `base.py`: the backend flag `TORCH`, the torch types, compile and
  inference-mode state (`_compiling`), and the checks on dtypes and
  tensors (`dtype_name`, `to_torch_dtype`, `is_tensor`, `has_dtype`,
  `valid_scaled_fields`, `needs_gradient`);
- `host.py`: what the host knows of scalars' values: the value keys kept
  on tensors, `host_value`, `is_one`, `unless_one`, `kept`, `on_host`,
  `memo_disabled`, `host_reads_disabled`, `synchronizing_reads`;
- `memo.py`: `memoize_scalars` and `signature`;
- `constants.py`: Python numbers as tensors (`float32_scalar`,
  `full_scalar`, and the cached constants of the torch ops);
- `elementwise.py`: the elementwise ops named as in `keras.ops` (`add`,
  `where`, `bitwise_and`, ...), `cast`, `view`, `stop_gradient`,
  `identity_in_custom_gradient`;
- `reduction.py`: `mean`, `max`, `rms`, `rms_all`, `rms_all_on_host`,
  `sum_to`, `stack`, `unstack`;
- `in_place.py`: the `*_in_place` ops, `multiply_all_in_place`, and the
  reused scratch buffers of a chunk (`ELEMENTWISE_CHUNK`,
  `scratch_buffer`, `scratch_like`, `right_shift_into`);
- `rounding.py`: the stochastic-rounding noise (`indexed_pair_noise`,
  `pair_noise`, `weyl_chunk`, `int32_range`), `chunked` passes, and the
  small tensors rounded together (`batches`, `concatenate_flat`,
  `split_like`, `gather`);
- `variables.py`: `variable_value`, `detached_variable_value`,
  `detached_tensor`, `note_written`.

`in_place.py` and `rounding.py` read `ELEMENTWISE_CHUNK` from this
package at each call, and `rms_all_on_host` calls this package's
`rms_all`: setting either here (a test, a benchmark's counter) reaches
them.
"""

from keras_scalify.backend.scalar.base import TORCH
from keras_scalify.backend.scalar.base import _compiling
from keras_scalify.backend.scalar.base import dtype_name
from keras_scalify.backend.scalar.base import has_dtype
from keras_scalify.backend.scalar.base import is_tensor
from keras_scalify.backend.scalar.base import needs_gradient
from keras_scalify.backend.scalar.base import valid_scaled_fields
from keras_scalify.backend.scalar.constants import float32_scalar
from keras_scalify.backend.scalar.constants import full_scalar
from keras_scalify.backend.scalar.elementwise import abs
from keras_scalify.backend.scalar.elementwise import add
from keras_scalify.backend.scalar.elementwise import bitwise_and
from keras_scalify.backend.scalar.elementwise import bitwise_or
from keras_scalify.backend.scalar.elementwise import bitwise_xor
from keras_scalify.backend.scalar.elementwise import cast
from keras_scalify.backend.scalar.elementwise import clip
from keras_scalify.backend.scalar.elementwise import divide
from keras_scalify.backend.scalar.elementwise import divide_no_nan
from keras_scalify.backend.scalar.elementwise import equal
from keras_scalify.backend.scalar.elementwise import floor_divide
from keras_scalify.backend.scalar.elementwise import greater
from keras_scalify.backend.scalar.elementwise import identity_in_custom_gradient
from keras_scalify.backend.scalar.elementwise import isfinite
from keras_scalify.backend.scalar.elementwise import left_shift
from keras_scalify.backend.scalar.elementwise import logical_and
from keras_scalify.backend.scalar.elementwise import logical_not
from keras_scalify.backend.scalar.elementwise import logical_or
from keras_scalify.backend.scalar.elementwise import maximum
from keras_scalify.backend.scalar.elementwise import minimum
from keras_scalify.backend.scalar.elementwise import multiply
from keras_scalify.backend.scalar.elementwise import not_equal
from keras_scalify.backend.scalar.elementwise import ones_like
from keras_scalify.backend.scalar.elementwise import right_shift
from keras_scalify.backend.scalar.elementwise import sqrt
from keras_scalify.backend.scalar.elementwise import square
from keras_scalify.backend.scalar.elementwise import stop_gradient
from keras_scalify.backend.scalar.elementwise import subtract
from keras_scalify.backend.scalar.elementwise import view
from keras_scalify.backend.scalar.elementwise import where
from keras_scalify.backend.scalar.host import UNLESS_ONE_MIN_ELEMENTS
from keras_scalify.backend.scalar.host import host_reads_disabled
from keras_scalify.backend.scalar.host import host_value
from keras_scalify.backend.scalar.host import is_one
from keras_scalify.backend.scalar.host import kept
from keras_scalify.backend.scalar.host import memo_disabled
from keras_scalify.backend.scalar.host import synchronizing_reads
from keras_scalify.backend.scalar.host import unless_one
from keras_scalify.backend.scalar.in_place import ELEMENTWISE_CHUNK
from keras_scalify.backend.scalar.in_place import add_in_place
from keras_scalify.backend.scalar.in_place import bitwise_and_in_place
from keras_scalify.backend.scalar.in_place import bitwise_xor_in_place
from keras_scalify.backend.scalar.in_place import clip_in_place
from keras_scalify.backend.scalar.in_place import multiply_all_in_place
from keras_scalify.backend.scalar.in_place import multiply_in_place
from keras_scalify.backend.scalar.in_place import right_shift_in_place
from keras_scalify.backend.scalar.in_place import right_shift_into
from keras_scalify.backend.scalar.in_place import scratch_like
from keras_scalify.backend.scalar.in_place import subtract_in_place
from keras_scalify.backend.scalar.memo import memoize_scalars
from keras_scalify.backend.scalar.memo import signature
from keras_scalify.backend.scalar.reduction import _sum_to_ops
from keras_scalify.backend.scalar.reduction import max
from keras_scalify.backend.scalar.reduction import mean
from keras_scalify.backend.scalar.reduction import rms
from keras_scalify.backend.scalar.reduction import rms_all
from keras_scalify.backend.scalar.reduction import rms_all_on_host
from keras_scalify.backend.scalar.reduction import stack
from keras_scalify.backend.scalar.reduction import sum_to
from keras_scalify.backend.scalar.reduction import unstack
from keras_scalify.backend.scalar.rounding import batches
from keras_scalify.backend.scalar.rounding import chunked
from keras_scalify.backend.scalar.rounding import indexed_pair_noise
from keras_scalify.backend.scalar.rounding import int32_range
from keras_scalify.backend.scalar.rounding import pair_noise
from keras_scalify.backend.scalar.variables import detached_tensor
from keras_scalify.backend.scalar.variables import detached_variable_value
from keras_scalify.backend.scalar.variables import note_written
from keras_scalify.backend.scalar.variables import variable_value

if TORCH:  # (eager torch's helpers, defined on torch only)
    from keras_scalify.backend.scalar.base import to_torch_dtype
    from keras_scalify.backend.scalar.host import on_host
    from keras_scalify.backend.scalar.in_place import _SCRATCH
    from keras_scalify.backend.scalar.in_place import scratch_buffer
    from keras_scalify.backend.scalar.rounding import _WEYL
    from keras_scalify.backend.scalar.rounding import concatenate_flat
    from keras_scalify.backend.scalar.rounding import gather
    from keras_scalify.backend.scalar.rounding import split_like
    from keras_scalify.backend.scalar.rounding import weyl_chunk
