"""`ScaledDTypePolicy`: the dtype policy of scaled (Scalify) training."""

import keras

from keras_scalify.policies import named

# Dtypes accepted by each field, in the order they are listed in errors.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
MATMUL_DTYPES = FLOAT_DTYPES + FP8_DTYPES
GRAD_DTYPES = FLOAT_DTYPES + FP8_DTYPES
MASTER_DTYPES = FLOAT_DTYPES
STATE_DTYPES = FLOAT_DTYPES
COMPUTE_DTYPES = FLOAT_DTYPES

# The default of a dtype argument that was not given (None is refused).
_UNSET = type("Unset", (), {"__repr__": lambda self: "<named policy's or float32>"})()

# Every name a scaled policy may take starts with this prefix; the policy hook
# routes exactly these names to `keras_scalify`.
NAME_PREFIX = "scaled_"
CUSTOM_NAME = "scaled_custom"

# The fields of a policy besides its name, in `repr` order.
FIELDS = (
    "matmul_dtype",
    "grad_dtype",
    "master_dtype",
    "compute_dtype",
    "state_dtype",
)

_WHY_NOT_FP8 = {
    "master_dtype": (
        "Trainable weights are updated by an optimizer, and FP8 storage "
        "cannot hold an update (use float16 or bfloat16: the weight is then "
        "stored scaled)."
    ),
    "state_dtype": (
        "Optimizer state is updated every step, and FP8 storage cannot "
        "hold it (use float16 or bfloat16)."
    ),
    "compute_dtype": (
        "FP8 is only used inside matmuls: set `matmul_dtype` (and "
        "`grad_dtype`) instead."
    ),
}


def standardize_policy_dtype(dtype, arg_name, allowed):
    """Returns `dtype` as a standard dtype string, checked against `allowed`.

    Args:
        dtype: A dtype: a string such as `"float16"`, or a NumPy/ml_dtypes
            dtype.
        arg_name: The name of the argument, used in errors.
        allowed: The dtype strings this argument accepts.

    Returns:
        The standardized dtype string.
    """
    try:
        if dtype is None:
            # `standardize_dtype(None)` would silently give floatx.
            raise ValueError
        standard = keras.backend.standardize_dtype(dtype)
    except Exception:
        raise ValueError(
            f"Invalid `{arg_name}`: {dtype!r} is not a dtype. Expected one "
            f"of {list(allowed)}."
        ) from None
    if standard not in allowed:
        why = ""
        if standard in FP8_DTYPES and arg_name in _WHY_NOT_FP8:
            why = " " + _WHY_NOT_FP8[arg_name]
        raise ValueError(
            f"Invalid `{arg_name}`: {standard!r}. Expected one of "
            f"{list(allowed)}.{why}"
        )
    return standard


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledDTypePolicy(keras.dtype_policies.DTypePolicy):
    """A dtype policy for scaled (Scalify) training in FP8/FP16.

    Scaled layers keep their tensors as `ScaledTensor`s (data times a
    power-of-two scale) and read their dtypes from this policy. Built-in
    Keras layers see a plain mixed-precision policy: variables in
    `variable_dtype` (float32) and computations in `compute_dtype`. The
    policy is never quantized (`quantization_mode` is None), so built-in
    layers keep their normal call path, and its name is never
    `"mixed_float16"`, so `Model.compile` does not wrap the optimizer in a
    `LossScaleOptimizer`: scaling replaces loss scaling.

    Named policies (`"scaled_float32"`, `"scaled_fp16"`, `"scaled_bf16"`,
    `"scaled_fp8"`) can be passed by name wherever Keras takes a policy
    name once `keras_scalify` is imported; see
    `keras_scalify.policies.get_named_policy`.

    >>> policy = ScaledDTypePolicy(
    ...     matmul_dtype="float8_e4m3fn", grad_dtype="float8_e5m2",
    ...     master_dtype="float16", compute_dtype="float16")
    >>> policy
    <ScaledDTypePolicy "scaled_fp8" matmul=float8_e4m3fn grad=float8_e5m2 \
master=float16 compute=float16 state=float32>

    Args:
        name: The policy name. Must start with `"scaled_"`. Defaults to the
            name of the named policy with the same dtypes, if any, otherwise
            `"scaled_custom"`. The name of a named policy may only be given
            with that policy's dtypes (dtypes not given are that policy's:
            `ScaledDTypePolicy("scaled_fp8")` is the named policy). Any
            other name needs at least one dtype: `"scaled_fp9"` alone is a
            typo and raises. Dtypes not given default to float32.
        compute_dtype: Dtype of activations and of non-matmul ops: one of
            `"float32"`, `"float16"`, `"bfloat16"`.
        matmul_dtype: Dtype of the inputs of forward matmuls: one of
            `"float32"`, `"float16"`, `"bfloat16"`, `"float8_e4m3fn"`,
            `"float8_e5m2"`.
        grad_dtype: Dtype of the gradients of matmul outputs in the backward
            pass; same choices as `matmul_dtype`.
        master_dtype: Storage dtype of trainable weight data (scaled
            weights): one of `"float32"`, `"float16"`, `"bfloat16"`. Never
            FP8, since an optimizer updates it.
        state_dtype: Storage dtype of optimizer state: one of `"float32"`,
            `"float16"`, `"bfloat16"`.
    """

    def __init__(
        self,
        name=None,
        *,
        compute_dtype=_UNSET,
        matmul_dtype=_UNSET,
        grad_dtype=_UNSET,
        master_dtype=_UNSET,
        state_dtype=_UNSET,
    ):
        given = {
            "matmul_dtype": matmul_dtype,
            "grad_dtype": grad_dtype,
            "master_dtype": master_dtype,
            "compute_dtype": compute_dtype,
            "state_dtype": state_dtype,
        }
        defaults = _defaults_for(name, given)
        matmul_dtype, grad_dtype, master_dtype, compute_dtype, state_dtype = (
            defaults[k] if given[k] is _UNSET else given[k] for k in FIELDS
        )
        fields = {
            "matmul_dtype": standardize_policy_dtype(
                matmul_dtype, "matmul_dtype", MATMUL_DTYPES
            ),
            "grad_dtype": standardize_policy_dtype(
                grad_dtype, "grad_dtype", GRAD_DTYPES
            ),
            "master_dtype": standardize_policy_dtype(
                master_dtype, "master_dtype", MASTER_DTYPES
            ),
            "compute_dtype": standardize_policy_dtype(
                compute_dtype, "compute_dtype", COMPUTE_DTYPES
            ),
            "state_dtype": standardize_policy_dtype(
                state_dtype, "state_dtype", STATE_DTYPES
            ),
        }
        name = _check_name(name, fields)
        # Built-in layers under this policy behave as under mixed precision:
        # float32 variables, computations in `compute_dtype`.
        super().__init__("float32")
        self._compute_dtype = fields["compute_dtype"]
        self._matmul_dtype = fields["matmul_dtype"]
        self._grad_dtype = fields["grad_dtype"]
        self._master_dtype = fields["master_dtype"]
        self._state_dtype = fields["state_dtype"]
        self._name = name
        named.remember_policy(self)

    @property
    def name(self):
        """The name of this policy, e.g. `"scaled_fp8"`.

        Keras's `DTypePolicyMap.get_config` may set `_name` to None on the
        policies it holds; the name is then derived from the dtypes.
        """
        if self._name is None:
            return _default_name(self._fields())
        return self._name

    @property
    def matmul_dtype(self):
        """Dtype of the inputs of forward matmuls."""
        return self._matmul_dtype

    @property
    def grad_dtype(self):
        """Dtype of the gradients of matmul outputs (backward pass)."""
        return self._grad_dtype

    @property
    def master_dtype(self):
        """Storage dtype of trainable weight data (never FP8)."""
        return self._master_dtype

    @property
    def state_dtype(self):
        """Storage dtype of optimizer state."""
        return self._state_dtype

    @property
    def compute_dtype(self):
        """Dtype of activations and of non-matmul ops."""
        return self._compute_dtype

    @property
    def variable_dtype(self):
        """Dtype of the variables of built-in Keras layers: always float32."""
        return self._variable_dtype

    def _fields(self):
        return {field: getattr(self, "_" + field) for field in FIELDS}

    def get_config(self):
        return {"name": self.name, **self._fields()}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        short = {
            "matmul_dtype": "matmul",
            "grad_dtype": "grad",
            "master_dtype": "master",
            "compute_dtype": "compute",
            "state_dtype": "state",
        }
        fields = " ".join(
            f"{short[field]}={value}" for field, value in self._fields().items()
        )
        return f'<{self.__class__.__name__} "{self.name}" {fields}>'

    def __eq__(self, other):
        if type(other) is not type(self):
            return False
        return self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self).__name__,) + tuple(self.get_config().values()))


def _default_name(fields):
    """The name of the named policy with these dtypes, else the custom name."""
    for name in named.NAMED_POLICIES:
        if named.named_policy_fields(name) == fields:
            return name
    return CUSTOM_NAME


def _defaults_for(name, given):
    """The dtypes of fields not given: a named policy's own (so
    `ScaledDTypePolicy("scaled_fp8")` is that policy), float32 otherwise.
    A name that is neither a named policy nor given any dtype is a typo
    (`"scaled_fp9"`), not a float32 policy: it raises."""
    if isinstance(name, str) and name in named.NAMED_POLICIES:
        return named.named_policy_fields(name)
    if (
        isinstance(name, str)
        and name.startswith(NAME_PREFIX)
        and name != CUSTOM_NAME
        and all(v is _UNSET for v in given.values())
    ):
        valid = ", ".join(repr(n) for n in named.NAMED_POLICIES)
        raise ValueError(
            f"Invalid `name`: {name!r} is not a named scaled policy ({valid}) "
            f"and no dtype was given. Pass the dtypes of a custom policy "
            f"(e.g. `compute_dtype=`, `matmul_dtype=`), or use a named one."
        )
    return {k: "float32" for k in FIELDS}


def _check_name(name, fields):
    if name is None:
        return _default_name(fields)
    if not isinstance(name, str):
        raise TypeError(
            f"Invalid `name`: expected a string starting with "
            f"'{NAME_PREFIX}'. Received: name={name!r} (of type "
            f"{type(name).__name__})"
        )
    if not name.startswith(NAME_PREFIX):
        raise ValueError(
            f"Invalid `name`: {name!r}. A scaled policy name must start with "
            f"'{NAME_PREFIX}' (Keras saves built-in layers' policies by name, "
            "and only such names resolve back to a scaled policy)."
        )

    if name in named.NAMED_POLICIES:
        expected = named.named_policy_fields(name)
        if expected != fields:
            diff = ", ".join(
                f"{k}={fields[k]} (expected {expected[k]})"
                for k in FIELDS
                if fields[k] != expected[k]
            )
            raise ValueError(
                f"Invalid `name`: {name!r} is a named policy and cannot be "
                f"given other dtypes: {diff}. Pass `name=None` or another "
                "name for a custom policy."
            )
    return name
