"""ScaledMultiHeadAttention: `keras.layers.MultiHeadAttention` on ScaledTensors."""

import math

import keras
from keras import ops
from keras.src.layers.attention.multi_head_attention import _build_attention_equation
from keras.src.layers.attention.multi_head_attention import _build_proj_equation
from keras.src.layers.attention.multi_head_attention import _get_output_shape

from keras_scalify import ops as sops
from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import scaled_spec
from keras_scalify.layers.weights import weight_values
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.einsum_dense import ScaledEinsumDense
from keras_scalify.ops.linalg import rebalanced_einsum
from keras_scalify.layers.einsum_dense import check_unsupported
from keras_scalify.layers.einsum_dense import plain_policy
from keras_scalify.layers.einsum_dense import plain_shape
from keras_scalify.layers.merging import ScaledDropout
from keras_scalify.ops.nn import masked_softmax


def _shape_of(x):
    """The shape of a tensor or of a ScaledTensor's data, as a tuple."""
    return tuple((x.data if is_scaled(x) else x).shape)


def _check_value_key(value_shape, key_shape):
    if tuple(value_shape[1:-1]) != tuple(key_shape[1:-1]):
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, "
            f"must be equal. Received: value_shape={value_shape} and "
            f"key_shape={key_shape}"
        )


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledMultiHeadAttention(ScaledLayer):
    """`keras.layers.MultiHeadAttention` on ScaledTensors.

    The same computation as Keras's explicit (non-fused) path: projections
    `query`, `key`, `value` (and `gate` with `use_gate=True`) and
    `attention_output` are `ScaledEinsumDense` sublayers with Keras's
    equations, weight shapes and names; the scores are `einsum(key, query)`
    times `1/sqrt(key_dim)` (in the GEMMs' factors: `einsum(multiplier=)`),
    masked (boolean `attention_mask`, `use_causal_mask`, `sliding_window`),
    normalized by `ksc.ops.softmax` (output scale `P(1/sqrt(n))`; on eager
    torch the masked softmax is one node, `backend.fused.masked_softmax`),
    dropped out in training, and combined with the values. With the same
    weights it gives Keras's outputs and gradients; rows whose every
    position is masked give zero attention (Keras's explicit path; Keras's fused
    `dot_product_attention` path, taken when `dropout == 0` and no scores
    are returned, differs there).

    The combined values are rebalanced statically (exact) by
    `P(S**(1/4))`, S the number of attended positions: attention averages
    over them, so their data RMS lies between ~1/sqrt(S) (uniform rows) and
    ~1 (one-hot rows); the rebalance centres that range on 1. No tensor
    statistic is measured.

    Masking keeps the scores' scale: masked positions get a constant of
    represented value -1e9 (as `keras.layers.Softmax`) stored with the
    scores' own scale, so `where` rescales nothing; the masked softmax is
    evaluated on float32 data (as `ksc.ops.softmax` computes anyway) and
    its output cast back to the compute dtype.

    Gradient scales: each projection weight's gradient scale is its
    `ScaledVariable.grad_scale`, which the optimizer calibrates from the
    previous step's weight-gradient statistic (0 = not calibrated yet, read
    as `1/scale`). At init, near-uniform attention shrinks the true
    gradients of all four projections' weights by about `sqrt(seq_len)`
    (softmax backward for query/key, the average over queries for value,
    the averaged output for `attention_output`); the first calibrated step
    absorbs this (see `docs/design.md` §6). Attention is bilinear in its
    input, which the forward rules do not see: the probabilities take their
    grad scale from the values' side (`dP = d(out)·vᵀ`), and the query and
    key projections take a measured kernel grad scale's prediction alone
    (their input's grad scale measures the values' path too), so inputs
    carried at 2^k keep exact gradients for k in [-60, 60] (design §7).

    Args:
        num_heads, key_dim, value_dim, dropout, use_bias, output_shape,
            attention_axes, kernel_initializer, bias_initializer, seed,
            use_gate, sliding_window: as in `keras.layers.MultiHeadAttention`.
            `attention_axes` may name any axes strictly between the batch
            axis and the feature axis (the default: all of them).
        Regularizers and constraints are accepted only as None;
        `flash_attention` only as None or False.

    `call(query, value, key=None, attention_mask=None,
    return_attention_scores=False, training=None, use_causal_mask=False)`
    takes ScaledTensors or plain tensors (scale 1) and returns a
    ScaledTensor, or `(output, scores)` ScaledTensors. ScaledTensors carry
    no Keras masks: pass padding as `attention_mask`.

    `from_keras(layer)` converts a built Keras MultiHeadAttention (same
    config, same represented weights); `to_keras()` goes back.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        seed=None,
        use_gate=False,
        sliding_window=None,
        flash_attention=None,
        **kwargs,
    ):
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(
                f"`num_heads` must be a positive int, got {num_heads!r}."
            )
        if not isinstance(key_dim, int) or key_dim <= 0:
            raise ValueError(f"`key_dim` must be a positive int, got {key_dim!r}.")
        if value_dim is not None and (not isinstance(value_dim, int) or value_dim <= 0):
            raise ValueError(
                f"`value_dim` must be None or a positive int, got {value_dim!r}."
            )
        if not 0 <= dropout <= 1:
            raise ValueError(f"`dropout` must be in [0, 1], got {dropout!r}.")
        if flash_attention:
            raise ValueError(
                "`flash_attention` is not supported by "
                "ScaledMultiHeadAttention (the scores are computed "
                "explicitly); it must be None or False."
            )
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or sliding_window <= 0
        ):
            raise ValueError(
                f"`sliding_window` must be None or a positive int, got "
                f"{sliding_window!r}."
            )
        check_unsupported(type(self).__name__, kwargs)
        super().__init__(**kwargs)
        self.supports_masking = True
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim if value_dim else key_dim
        self._dropout = float(dropout)
        self._use_bias = use_bias
        self._use_gate = use_gate
        if output_shape:
            if isinstance(output_shape, int):
                output_shape = (output_shape,)
            try:
                output_shape = tuple(output_shape)
            except TypeError:
                raise ValueError(
                    f"`output_shape` must be an int, a tuple or a list, got "
                    f"{output_shape!r}."
                ) from None
        self._output_shape = output_shape
        self._kernel_initializer = keras.initializers.get(kernel_initializer)
        self._bias_initializer = keras.initializers.get(bias_initializer)
        if isinstance(attention_axes, int) and not isinstance(attention_axes, bool):
            attention_axes = (attention_axes,)
        elif attention_axes is not None and not (
            isinstance(attention_axes, (list, tuple))
            and all(isinstance(a, int) and not isinstance(a, bool) for a in attention_axes)
            and len(attention_axes) > 0
        ):
            raise ValueError(
                f"`attention_axes` must be None, an int, or a non-empty list "
                f"or tuple of ints, got {attention_axes!r}."
            )
        self._attention_axes = (
            None if attention_axes is None else tuple(attention_axes)
        )
        self._sliding_window = sliding_window
        self.seed = seed
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(self._key_dim))
        self._shapes = None

    # --- properties mirroring Keras ------------------------------------------
    @property
    def num_heads(self):
        return self._num_heads

    @property
    def key_dim(self):
        return self._key_dim

    @property
    def value_dim(self):
        return self._value_dim

    @property
    def dropout(self):
        return self._dropout

    @property
    def use_bias(self):
        return self._use_bias

    @property
    def attention_axes(self):
        return self._attention_axes

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    # --- build ------------------------------------------------------------------
    def _sublayer_kwargs(self):
        kernel = self._kernel_initializer.__class__.from_config(
            self._kernel_initializer.get_config()
        )
        bias = self._bias_initializer.__class__.from_config(
            self._bias_initializer.get_config()
        )
        return dict(
            kernel_initializer=kernel,
            bias_initializer=bias,
            dtype=self.dtype_policy,
        )

    def _projection(self, name, input_rank, last_dims, activation=None):
        equation, bias_axes, output_rank = _build_proj_equation(
            input_rank - 1, bound_dims=1, output_dims=2
        )
        return ScaledEinsumDense(
            equation,
            output_shape=_get_output_shape(output_rank - 1, last_dims),
            bias_axes=bias_axes if self._use_bias else None,
            activation=activation,
            name=name,
            **self._sublayer_kwargs(),
        )

    def _normalize_axes(self, rank):
        """Attention axes as non-negative axes of the projected tensors of
        rank `rank` (Keras's convention), validated."""
        input_rank = rank - 1
        if self._attention_axes is None:
            axes = tuple(range(1, rank - 2))
        else:
            axes = tuple(a if a >= 0 else (rank - 1) + a for a in self._attention_axes)
        valid = range(1, input_rank - 1)
        if not axes or any(a not in valid for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(
                f"`attention_axes` of {self.name} must name distinct axes "
                f"strictly between the batch axis and the feature axis of "
                f"inputs of rank {input_rank} (1 to {input_rank - 2}, or "
                f"{-(input_rank - 1)} to -2), got {self._attention_axes!r}."
            )
        return axes

    def build(self, query_shape, value_shape, key_shape=None):
        query_shape = plain_shape(query_shape)
        value_shape = plain_shape(value_shape)
        key_shape = value_shape if key_shape is None else plain_shape(key_shape)
        _check_value_key(value_shape, key_shape)
        if len(query_shape) != len(value_shape):
            raise ValueError(
                f"`query` and `value` of {self.name} must have the same rank, "
                f"got shapes {query_shape} and {value_shape}."
            )
        if len(query_shape) < 3:
            raise ValueError(
                f"`query` of {self.name} must have rank >= 3 (batch, "
                f"attention axes..., features), got shape {query_shape}."
            )
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape[-1] is None:
                raise ValueError(
                    f"`{name}` of {self.name} needs a known last dimension, "
                    f"got shape {shape}."
                )
        rank = len(query_shape) + 1
        axes = self._normalize_axes(rank)
        self._shapes = {
            "query_shape": query_shape,
            "value_shape": value_shape,
            "key_shape": key_shape,
        }
        heads = self._num_heads
        self._query_dense = self._projection("query", len(query_shape), [heads, self._key_dim])
        self._query_dense.build(query_shape)
        self._key_dense = self._projection("key", len(key_shape), [heads, self._key_dim])
        self._key_dense.build(key_shape)
        # The inputs of the query and key projections also feed the values
        # (self-attention: one tensor for all three), whose path their grad
        # scale measures; once measured, the kernels' own grad scales
        # predict the cotangents of q and k (∝ the scores' gradient, which
        # is 2^(2k) off the values' path for inputs at 2^k).
        self._query_dense._input_votes_when_calibrated = False
        self._key_dense._input_votes_when_calibrated = False
        if self._use_gate:
            self._gate_dense = self._projection(
                "gate", len(query_shape), [heads, self._value_dim], activation="sigmoid"
            )
            self._gate_dense.build(query_shape)
        self._value_dense = self._projection("value", len(value_shape), [heads, self._value_dim])
        self._value_dense.build(value_shape)

        self._attention_axes = axes
        (
            self._dot_product_equation,
            self._combine_equation,
            scores_rank,
        ) = _build_attention_equation(rank, attn_axes=axes)
        self._norm_axes = tuple(range(scores_rank - len(axes), scores_rank))
        self._dropout_layer = ScaledDropout(
            rate=self._dropout, seed=self.seed, dtype=self.dtype_policy
        )
        # No weights; never called when dropout is 0. Left unbuilt, it would
        # make Keras's trainers re-trace the model before every step.
        self._dropout_layer.built = True

        output_shape = self._output_shape or [query_shape[-1]]
        equation, bias_axes, output_rank = _build_proj_equation(
            len(query_shape) - 1, bound_dims=2, output_dims=len(output_shape)
        )
        self._output_dense = ScaledEinsumDense(
            equation,
            output_shape=_get_output_shape(output_rank - 1, output_shape),
            bias_axes=bias_axes if self._use_bias else None,
            name="attention_output",
            **self._sublayer_kwargs(),
        )
        out_in = list(self._query_dense.compute_output_shape(query_shape))
        out_in[-1] = self._value_dim
        self._output_dense.build(tuple(out_in))

    def get_build_config(self):
        if self._shapes is None:
            return None
        return {"shapes_dict": dict(self._shapes)}

    # --- masks ----------------------------------------------------------------
    def _compute_causal_mask(self, query, value=None):
        q_len = ops.shape(query)[1]
        v_len = q_len if value is None else ops.shape(value)[1]
        ones = ops.ones((1, q_len, v_len), dtype="int32")
        row = ops.cumsum(ones, axis=-2)
        col = ops.cumsum(ones, axis=-1)
        return ops.greater_equal(row, col)

    def _compute_sliding_window_mask(self, query, value=None):
        q_len = ops.shape(query)[1]
        v_len = q_len if value is None else ops.shape(value)[1]
        row = ops.reshape(ops.arange(q_len, dtype="int32"), (1, q_len, 1))
        col = ops.reshape(ops.arange(v_len, dtype="int32"), (1, 1, v_len))
        return ops.less(ops.abs(row - col), self._sliding_window)

    def _compute_attention_mask(
        self, query, value, attention_mask=None, use_causal_mask=False
    ):
        """Keras's mask merge: causal, sliding window and `attention_mask`,
        combined with a logical and. `query` and `value` are the data
        tensors (only their shapes are read)."""
        auto = None
        if use_causal_mask:
            m = self._compute_causal_mask(query, value)
            auto = m if auto is None else ops.logical_and(auto, m)
        if self._sliding_window is not None:
            m = self._compute_sliding_window_mask(query, value)
            auto = m if auto is None else ops.logical_and(auto, m)
        if attention_mask is not None:
            attention_mask = ops.cast(attention_mask, "bool")
        if auto is not None:
            attention_mask = (
                auto if attention_mask is None else ops.logical_and(attention_mask, auto)
            )
        return attention_mask

    def _softmax(self, scores):
        """`ksc.ops.softmax` over the normalized (trailing) axes."""
        n = len(self._norm_axes)
        if n == 1:
            return sops.softmax(scores, axis=-1)
        shape = ops.shape(scores.data)
        flat = sops.reshape(scores, tuple(shape[:-n]) + (-1,))
        return sops.reshape(sops.softmax(flat, axis=-1), shape)

    def _masked_softmax(self, scores, attention_mask=None, value=None):
        """Softmax of `scores` in float32, masked (fully masked rows give
        zeros); float32 probabilities. With `value`: their grad scale set
        from the combination with it (`ksc.ops.nn.masked_softmax`)."""
        scores = sops.cast(scores, "float32")
        if attention_mask is not None:
            axis = -len(self._attention_axes) * 2 - 1
            for _ in range(len(scores.shape) - len(attention_mask.shape)):
                attention_mask = ops.expand_dims(attention_mask, axis=axis)
        return masked_softmax(
            scores, attention_mask, value, self._combine_equation,
            softmax_fn=None if len(self._norm_axes) == 1 else self._softmax,
        )

    # --- call -----------------------------------------------------------------
    def _check_inputs(self, query, value, key):
        for name, x, want in (
            ("query", query, self._shapes["query_shape"]),
            ("value", value, self._shapes["value_shape"]),
            ("key", key, self._shapes["key_shape"]),
        ):
            shape = tuple(x.shape)
            if len(shape) != len(want) or (
                shape[-1] is not None and shape[-1] != want[-1]
            ):
                raise ValueError(
                    f"`{name}` of {self.name} must have rank {len(want)} and "
                    f"last dimension {want[-1]} (the layer was built for "
                    f"shape {want}), got shape {shape}."
                )

    def _combine_rebalance(self, scores):
        """`P(S**(1/4))`, S the static number of attended (key) positions."""
        n = 1
        for d in scores.shape[-len(self._attention_axes):]:
            n *= int(d) if isinstance(d, int) else 1
        return pow2.np_pow2_round_down(max(n, 1) ** 0.25)

    def _compute_attention(self, query, key, value, attention_mask=None, training=None):
        # Scores in float32 (the GEMM's accumulator), multiplied by
        # 1/sqrt(d) in the GEMMs' own factors (`einsum(multiplier=)`) rather
        # than on the query: no pass of its own, forward or backward.
        scores = sops.einsum(
            self._dot_product_equation, key, query, out_dtype="float32",
            multiplier=self._inverse_sqrt_key_dim,
        )
        # The probabilities' grad scale is set from the values' side of the
        # combination (`_probs_grad_scale`), in float32, before the
        # rounding to the compute dtype, so the softmax backward converts
        # any ratio.
        scores = self._masked_softmax(scores, attention_mask, value)
        scores = sops.cast(scores, keras.backend.standardize_dtype(self.compute_dtype))
        if self._dropout > 0.0:
            final = self._dropout_layer(scores, training=training)
        else:
            final = scores
        # The combination averages values: with softmax's scale P(1/sqrt(S))
        # its data RMS ranges from ~1/sqrt(S) (uniform attention) to ~1
        # (one-hot). A static, exact rebalance by P(S**(1/4)) centres that
        # range on 1 geometrically: no statistic is measured. (In the
        # GEMM's own factor where it can be: `rebalanced_einsum`.)
        output = rebalanced_einsum(
            self._combine_equation, final, value, self._combine_rebalance(scores)
        )
        return output, scores

    def call(
        self,
        query,
        value,
        key=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        q = cast_to_compute(self, query)
        v = cast_to_compute(self, value)
        k = v if key is None or key is value else cast_to_compute(self, key)
        self._check_inputs(q, v, k)
        mask = self._compute_attention_mask(
            q.data,
            v.data,
            attention_mask=attention_mask,
            use_causal_mask=use_causal_mask,
        )
        gate = self._gate_dense(q) if self._use_gate else None
        q = self._query_dense(q)
        k = self._key_dense(k)
        v = self._value_dense(v)
        output, scores = self._compute_attention(q, k, v, mask, training)
        if gate is not None:
            output = sops.multiply(output, gate)
        output = self._output_dense(output)
        if return_attention_scores:
            return output, scores
        return output

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        q_shape = _shape_of(query)
        v_shape = _shape_of(value)
        k_shape = v_shape if key is None else _shape_of(key)
        _check_value_key(v_shape, k_shape)
        out_shape = q_shape[:-1] + (self._output_shape or (q_shape[-1],))
        out = scaled_spec(tuple(out_shape), self.compute_dtype)
        if not return_attention_scores:
            return out
        # (batch dims..., heads, query attention dims..., key attention dims...)
        axes = self._attention_axes
        batch = [d for i, d in enumerate(q_shape[:-1]) if i not in axes]
        s_shape = tuple(batch + [self._num_heads] + [q_shape[a] for a in axes] + [v_shape[a] for a in axes])
        return out, scaled_spec(s_shape, self.compute_dtype)

    # --- config and conversion ---------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self._num_heads,
                "key_dim": self._key_dim,
                "value_dim": self._value_dim,
                "dropout": self._dropout,
                "use_bias": self._use_bias,
                "use_gate": self._use_gate,
                "output_shape": self._output_shape,
                "attention_axes": self._attention_axes,
                "sliding_window": self._sliding_window,
                "kernel_initializer": keras.initializers.serialize(
                    self._kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(
                    self._bias_initializer
                ),
                "kernel_regularizer": None,
                "bias_regularizer": None,
                "activity_regularizer": None,
                "kernel_constraint": None,
                "bias_constraint": None,
                "seed": self.seed,
            }
        )
        return config

    @staticmethod
    def _shapes_of(build_config, name):
        shapes = (build_config or {}).get("shapes_dict")
        if not shapes or "query_shape" not in shapes or "value_shape" not in shapes:
            raise ValueError(
                f"`layer` {name!r} is built but has no recorded query/value "
                f"shapes; call it once on inputs."
            )
        return {
            k: plain_shape(shapes[k])
            for k in ("query_shape", "value_shape", "key_shape")
            if shapes.get(k) is not None
        }

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledMultiHeadAttention with `layer`'s config and represented
        weights.

        `layer` is a `keras.layers.MultiHeadAttention`; when it is built,
        the result is built on the same query/value/key shapes and holds
        the same weight values. `overrides` replace config entries, e.g.
        `dtype="scaled_fp8"`.
        """
        if not isinstance(layer, keras.layers.MultiHeadAttention):
            raise TypeError(
                f"`layer` must be a keras.layers.MultiHeadAttention, got "
                f"{type(layer).__name__}."
            )
        config = layer.get_config()
        config.update(overrides)
        scaled = cls.from_config(config)
        if layer.built:
            scaled.build(**cls._shapes_of(layer.get_build_config(), layer.name))
            scaled.set_weights(weight_values(layer))
        return scaled

    def to_keras(self, **overrides):
        """A plain `keras.layers.MultiHeadAttention` with this config and
        the represented weights (built when this layer is). A scaled dtype
        policy becomes float32; `overrides` replace config entries."""
        config = self.get_config()
        config["dtype"] = plain_policy(self)
        config.update(overrides)
        layer = keras.layers.MultiHeadAttention.from_config(config)
        if self.built:
            layer.build(**self._shapes_of(self.get_build_config(), self.name))
            layer.set_weights(weight_values(self))
        return layer
