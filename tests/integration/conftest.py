from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    from cobali.model import embedded_model_path

    return embedded_model_path()
