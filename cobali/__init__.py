"""cobali: continuous batching and prefill splitting over llama.cpp."""

from cobali.backends.base import SamplingParams
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason, Request, RequestState

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "FinishReason", "Request", "RequestState", "SamplingParams", "__version__"]
