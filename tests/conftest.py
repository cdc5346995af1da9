"""The embedded model, for every test that runs the real model.

A missing model reads the same everywhere: the test is skipped with the fix in its reason, except under CI
(`CI` set), where it is an error, because a CI run that skipped the real model would prove nothing about it."""

from __future__ import annotations

import os

import pytest


def require_embedded_model() -> str:
    from cobali.backends.embedded_model import embedded_model_path

    try:
        return embedded_model_path()
    except ValueError as err:
        message = f"this test runs the embedded model: {err}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def model_path() -> str:
    return require_embedded_model()
