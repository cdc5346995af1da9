from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    from cobali.backends.embedded_model import embedded_model_path

    return embedded_model_path()
