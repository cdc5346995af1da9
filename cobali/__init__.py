"""cobali: continuous batching and prefill splitting over llama.cpp."""

from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.outputs import RequestOutput, RequestStats
from cobali.engine.request import FinishReason, Request, RequestState
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "EngineConfig", "FinishReason", "Request", "RequestOutput", "RequestState",
           "RequestStats", "SamplingParams", "__version__"]
