"""Scale rules of contractions: matmul, dot, einsum.

Rule (jax-scalify's `dot_general`, generalised to batch dims and einsum):
`s = Π s_i · r` and `d = contraction(data) / r` with `r = P(sqrt(K))`, K the
contracted size. Gradient scale (inverse unit-scaling backward rule): the
backward of operand i contracts `n_i = size(out)·K/size(i)` elements, so
`g = mean_i(g_i / (Π_{j≠i} s_j · P(sqrt(n_i))))`, over the operands whose
grad scale was measured (`calibrated=`; a weight's guess does not vote).

- `rules.py`: the rule's scalars (scale, grad scale, cotangent and GEMM
  factors), `operand_grad_scale`, and `_contract`, which applies the rule
  to a contraction of the operands' data;
- `shapes.py`: what a contraction reads of its operands: argument checks,
  result shapes (memoized), einsum parsing (the contracted size K) and the
  equations the one-custom-gradient GEMMs of `ops/_gemm.py` run;
- `contractions.py`: `matmul`, `dot`, `einsum`, `conv`, and
  `rebalanced_einsum`, `cast_contraction`;
- `epilogue.py`: `contraction_plus`, a contraction with its bias add and
  activation as one custom gradient (Dense layers);
- `float8.py`: `fp8_einsum`, `fp8_matmul`.
"""

# Read from here by `contraction_plus` at each call (`epilogue.py`).
from keras_scalify.backend.fused import gate_epilogue
from keras_scalify.ops.linalg.contractions import cast_contraction
from keras_scalify.ops.linalg.contractions import conv
from keras_scalify.ops.linalg.contractions import dot
from keras_scalify.ops.linalg.contractions import einsum
from keras_scalify.ops.linalg.contractions import matmul
from keras_scalify.ops.linalg.contractions import rebalanced_einsum
from keras_scalify.ops.linalg.epilogue import contraction_plus
from keras_scalify.ops.linalg.float8 import fp8_einsum
from keras_scalify.ops.linalg.float8 import fp8_matmul
from keras_scalify.ops.linalg.rules import operand_grad_scale
