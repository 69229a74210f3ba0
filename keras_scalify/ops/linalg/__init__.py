"""Scale rules of contractions: matmul, dot, einsum, conv (the rule is
stated in `rules.py`: the product of the operands' scales times
`P(sqrt(K))`, K the contracted size, and its inverse backward rule).

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
