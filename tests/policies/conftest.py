"""Fixtures for the policy tests: every test leaves the global dtype policy
and the policy hook as it found them."""

import keras
import pytest

from keras_scalify import policies
from keras_scalify.policies.resolve import KERAS_SET_DTYPE_POLICY


@pytest.fixture(autouse=True)
def restore_global_policy():
    saved = keras.config.dtype_policy()
    yield
    if not policies.is_policy_hook_installed():
        policies.install_policy_hook()
    KERAS_SET_DTYPE_POLICY("float32")
    if saved.name != "float32":
        KERAS_SET_DTYPE_POLICY(saved)
