"""Process-wide llama.cpp calls that need no model loaded: its log, and the quantizer."""

from __future__ import annotations

import ctypes
import sys
from collections import deque

import llama_cpp as ll

GGML_LOG_LEVEL_DEBUG = 1
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5  # the rest of the line before


class LlamaLogs:
    """llama.cpp's (and ggml's) log, taken from its callback. The last lines are kept: a load or context that
    fails says why with them, and a context's resolved flash attention is read from them. With `verbose` the
    text also goes to stderr, as llama.cpp's own tools print it."""

    def __init__(self, keep: int = 400) -> None:
        self.verbose = False
        self.count = 0  # lines seen so far: a mark to read the lines since
        self._lines: deque[tuple[int, int, str]] = deque(maxlen=keep)  # (serial, level, text)
        self._partial = ""
        self._level = 0
        self.callback = ll.llama_log_callback(self._on_log)  # kept alive with this object

    def _on_log(self, level: int, text: bytes, _data) -> None:
        if level != GGML_LOG_LEVEL_CONT and not self._partial:
            self._level = level
        if self._level == GGML_LOG_LEVEL_DEBUG:  # thousands of graph lines a load: llama.cpp's tools hide them too
            return
        piece = text.decode("utf-8", errors="replace") if text else ""
        if self.verbose:
            sys.stderr.write(piece)
        *done, self._partial = (self._partial + piece).split("\n")
        for line in done:
            self._lines.append((self.count, self._level, line))
            self.count += 1

    def since(self, mark: int) -> list[tuple[int, str]]:
        """(level, text) of the lines logged since `mark` (an earlier `count`) that are still kept."""
        return [(level, text) for serial, level, text in self._lines if serial >= mark]


_LOGS: LlamaLogs | None = None


def llama_logs(verbose: bool = False) -> LlamaLogs:
    """The process's llama.cpp log tap, installed on first use; `verbose` passes llama.cpp's text to stderr."""
    global _LOGS
    if _LOGS is None:
        _LOGS = LlamaLogs()
        ll.llama_log_set(_LOGS.callback, ctypes.c_void_p(0))
    _LOGS.verbose = verbose
    return _LOGS


def silence_logs() -> None:
    llama_logs(verbose=False)



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
