"""Process-wide llama.cpp calls that need no model loaded: quiet logs, and the quantizer."""

from __future__ import annotations

import ctypes

import llama_cpp as ll

_LOG_CALLBACK = None  # keep the ctypes callback alive for the life of the process


def silence_logs() -> None:
    global _LOG_CALLBACK
    _LOG_CALLBACK = ll.llama_log_callback(lambda level, text, data: None)
    ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))



def quantize_model(src: str, dst: str, quant: str, n_threads: int = 0) -> None:
    """Rewrite the GGUF at `src` into `dst` with weights of type `quant` (a llama_ftype name such as
    Q5_K_M), through llama.cpp's own quantizer: the same mixes llama-quantize makes."""
    ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}", None)
    if ftype is None:
        raise ValueError(f"unknown quantization type {quant!r} (llama_ftype names, e.g. Q5_K_M, Q4_K_M, Q8_0)")
    silence_logs()
    ll.llama_backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    code = ll.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if code != 0:
        raise ValueError(f"llama_model_quantize failed ({code}) for {src} -> {dst} as {quant}")
