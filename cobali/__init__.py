"""cobali: continuous batching and prefill splitting over llama.cpp."""

from cobali.engine.engine import Engine, EngineConfig
from cobali.engine.request import FinishReason, Request, RequestState
from cobali.engine.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "FinishReason", "Request", "RequestState", "SamplingParams", "__version__"]
