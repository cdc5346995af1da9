"""llama.cpp through llama-cpp-python's low-level C bindings. The only package that imports llama_cpp."""

from cobali.backends.llama_cpp.backend import LlamaCppBackend
from cobali.backends.llama_cpp.sampler import LlamaCppSampler
from cobali.backends.llama_cpp.tools import quantize_model

__all__ = ["LlamaCppBackend", "LlamaCppSampler", "quantize_model"]
