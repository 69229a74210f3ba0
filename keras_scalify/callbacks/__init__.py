"""Callbacks: watching scales during `fit`.

`ScaleMonitor` records, every `every` training steps, how well each scaled
layer's tensors fit their formats, as a history of NumPy arrays (and
CSV/JSON/TensorBoard files with `log_dir`); `keras_scalify.plot.scales`
draws it.

- `monitor.py`: the `ScaleMonitor` callback (its hooks, the records it
  keeps, its CSV/JSON/TensorBoard writing);
- `measuring.py`: `measure`, one record of statistics (weights,
  activations, gradients) from a model, with its compiled JAX and
  TensorFlow paths;
- `capture.py`: the scaled layers of a model (`scaled_layers`) and the
  interception of their calls that the activation and gradient records
  read;
- `history.py`: the history files: their names, the CSV/JSON writers and
  `load_history`.
"""

from keras_scalify.callbacks.capture import scaled_layers
from keras_scalify.callbacks.history import HISTORY_FILE
from keras_scalify.callbacks.history import JSON_FILE
from keras_scalify.callbacks.history import TRACE_FILE
from keras_scalify.callbacks.history import load_history
from keras_scalify.callbacks.measuring import FORMAT_KEYS
from keras_scalify.callbacks.measuring import GEMM_WEIGHTS
from keras_scalify.callbacks.measuring import STATS
from keras_scalify.callbacks.measuring import layer_key
from keras_scalify.callbacks.measuring import measure
from keras_scalify.callbacks.monitor import GLOBAL_COLUMNS
from keras_scalify.callbacks.monitor import ScaleMonitor
