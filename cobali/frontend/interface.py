"""What the faces take from below the frontend, re-exported: the HTTP layer imports the frontend and never the
engine or a backend (tests/unit/test_layers.py checks it)."""

from __future__ import annotations

from cobali.engine.adapters import AdapterLimit
from cobali.engine.messages import TickSummary
from cobali.engine.outputs import EngineStats, RequestOutput, RequestStats
from cobali.engine.request import FinishReason
from cobali.engine.sampling import TokenLogprob
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.setup import EngineSetup
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo, SlotState

__all__ = ["AdapterLimit", "EngineSetup", "EngineStats", "FinishReason", "ModelInfo", "RequestOutput", "RequestStats",
           "SamplingParams", "SlotState", "TickSummary", "TokenLogprob", "Tokenizer"]
