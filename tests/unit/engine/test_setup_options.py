"""EngineSetup.from_options: a Python caller's keyword options become the two typed configs, as the CLI's flags do."""

from __future__ import annotations

import pytest

from cobali.engine.setup import EngineSetup
from cobali.frontend.offline import LLM


def test_each_option_lands_in_the_config_that_has_it() -> None:
    setup = EngineSetup.from_options("m.gguf", max_slots=8, n_ctx=4096, async_scheduling=True, n_gpu_layers=0)
    assert (setup.engine.max_slots, setup.engine.async_scheduling) == (8, True)
    assert (setup.backend.model_path, setup.backend.n_ctx, setup.backend.n_gpu_layers) == ("m.gguf", 4096, 0)


def test_the_backend_is_sized_for_the_slots_and_shares_n_batch() -> None:
    setup = EngineSetup.from_options(max_slots=6, n_batch=256)
    assert (setup.backend.n_seq_max, setup.backend.n_batch, setup.engine.n_batch) == (6, 256, 256)
    assert setup.backend.model_path is None  # the embedded model


def test_an_unknown_option_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown option.*max_slot"):
        EngineSetup.from_options(max_slot=3)


def test_options_do_not_reconfigure_an_engine_given() -> None:
    from cobali.backends.fake import FakeBackend
    from cobali.engine.engine import Engine

    with pytest.raises(ValueError, match="max_slots"):
        LLM(Engine(FakeBackend()), max_slots=2)
