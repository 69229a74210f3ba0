"""Variables' values. `variable_value` (on eager torch the variable's own
tensor, read past Keras's scope checks), `detached_variable_value` and
`detached_tensor` (on eager torch a detached alias kept on the tensor,
its value key read once per version), and `note_written` (the keys of
the values the optimizer copied into variables)."""

import keras
from keras import ops

from keras_scalify.backend.scalar.base import TORCH
from keras_scalify.backend.scalar.elementwise import stop_gradient

if TORCH:
    from keras.src.backend.common import global_state as _global_state

    from keras_scalify.backend.scalar.base import _PARAMETER
    from keras_scalify.backend.scalar.base import _TENSOR
    from keras_scalify.backend.scalar.base import _is_compiling
    from keras_scalify.backend.scalar.base import _is_inference
    from keras_scalify.backend.scalar.host import _MEMO_OFF
    from keras_scalify.backend.scalar.host import _VERSIONED_KEY_ATTR
    from keras_scalify.backend.scalar.host import _kept_key
    from keras_scalify.backend.scalar.host import _known_key

    # The attribute under which a variable's tensor keeps the key of the
    # value `assign_all` wrote into it, with the version and storage it
    # holds for.
    _WRITTEN_KEY_ATTR = "_ksc_written_memo_key"
    # The attribute under which a variable's tensor keeps its detached
    # alias (`detached_tensor`).
    _ALIAS_ATTR = "_ksc_detached_alias"

    _VARIABLE = keras.Variable

    def variable_value(variable):
        """The current value of a Keras variable (inside a stateless scope,
        the mapped one).

        Where `Variable.value` would return the variable's own tensor (no
        stateless or autocast scope that applies, not a symbolic call on
        the meta device, not traced), that tensor, read directly: Keras's
        property checks those scopes one by one (~2.5 µs; a GPT step of
        `benchmarks/step_time.py` reads ~500 variables in the rules and
        the optimizer). Keras's private `_value` and `_autocast`, and the
        global-state names its scopes use."""
        if type(variable) is _VARIABLE:  # (a subclass may read otherwise)
            value = variable._value
            get = _global_state.get_global_attribute
            if (
                value is not None
                and get("stateless_scope") is None
                and (not variable._autocast or get("autocast_scope") is None)
                and get("torch_device") is None
                and not _is_compiling()
            ):
                return value
            return variable.value
        if isinstance(variable, keras.Variable):
            return variable.value
        return ops.convert_to_tensor(variable)

    def detached_variable_value(variable):
        """`stop_gradient(variable_value(variable))` of a scalar variable (a
        weight's scale or grad scale): `detached_tensor` of its tensor."""
        return detached_tensor(variable_value(variable))

    def detached_tensor(value):
        """`stop_gradient(value)` of a variable's own scalar tensor. On eager
        torch, for a tensor that needs a gradient (a trainable variable's),
        the detached alias is kept on the tensor and returned again (it
        shares the tensor's storage and version counter), with its memo key
        read once per version of the tensor (`_VERSIONED_KEY_ATTR`; every
        in-place write bumps the version; on a GPU the read is a
        synchronization, none where `note_written` recorded the value
        written): a GPT step of `benchmarks/step_time.py` read ~200 scales,
        each a `detach` and an `item()`. Elsewhere, the plain read."""
        if (
            type(value) is not _PARAMETER
            or not value.requires_grad
            or _MEMO_OFF
            or _is_compiling()
            or _is_inference()
        ):
            return stop_gradient(value)
        attrs = value.__dict__
        alias = attrs.get(_ALIAS_ATTR)
        # (An alias must share the tensor's storage and version counter:
        # not after `param.data = ...`, nor one restored by unpickling.)
        if alias is None or alias.data_ptr() != value.data_ptr() or alias._version != value._version:
            alias = attrs[_ALIAS_ATTR] = value.detach()
        else:
            versioned = alias.__dict__.get(_VERSIONED_KEY_ATTR)
            if versioned is not None and versioned[0] == alias._version:
                return alias
        written = attrs.get(_WRITTEN_KEY_ATTR)
        if written is not None and written[:2] == (alias._version, value.data_ptr()):
            key = written[2]
        else:
            key = _kept_key(alias)
        alias.__dict__[_VERSIONED_KEY_ATTR] = (alias._version, key)
        return alias

    def note_written(pairs):
        """After each `(tensor, value)` of `pairs` was copied in place
        (`backend.optimizer.assign_all`): a 0-d tensor given a value whose
        key the host keeps (`_known_key`) keeps that key for its new
        version, so that `detached_variable_value` need not read it (on a
        GPU, a synchronization per grad scale written per step)."""
        for t, x in pairs:
            if type(x) is _TENSOR and x.ndim == 0 and t.ndim == 0 and x.dtype == t.dtype:
                key = _known_key(x)
                if key is not None:
                    t.__dict__[_WRITTEN_KEY_ATTR] = (t._version, t.data_ptr(), key)

else:
    def variable_value(variable):
        """The current value of a Keras variable as a backend tensor.

        On TensorFlow `convert_to_tensor(variable)` returns the variable
        itself, which is then read inside the next op; when that op is a
        custom gradient (every scale rule is one), an eager
        `tf.GradientTape` finds a variable read inside it and calls the
        gradient function with `variables=`, expecting variable gradients
        back. Reading the value here (`ops.copy` is `tf.identity` on TF)
        keeps the read outside; the gradient still reaches the variable
        through the identity."""
        t = ops.convert_to_tensor(variable)
        if isinstance(t, keras.Variable):
            t = ops.copy(t)
        return t

    def detached_variable_value(variable):
        """`stop_gradient` of the variable's value (see the torch one)."""
        return stop_gradient(variable_value(variable))

    def detached_tensor(value):
        """`stop_gradient(value)` (see the torch one)."""
        return stop_gradient(value)

    def note_written(pairs):
        """Nothing is kept on the host here."""
