"""Every integration test runs the real embedded model: without it, each one skips (or, under CI, errors)
with the same message (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _embedded_model(model_path: str) -> str:
    return model_path
