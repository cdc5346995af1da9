"""The compute devices of this llama.cpp build (ggml's backend registry): what the startup line names, and the
free device memory --fit sizes a GPU build's context by."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as ll

GGML_DEVICE_TYPE_CPU = 0


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: CPU, CUDA0, Metal, Vulkan0, ...
    description: str
    is_cpu: bool
    free: int  # bytes; a CPU device reports all of the machine's memory as free
    total: int


def _ggml():
    """libggml as llama-cpp-python loaded it, with the few device calls typed: its bindings do not wrap them."""
    from llama_cpp import _ggml  # llama-cpp-python's own handle on the library it ships

    lib = _ggml.libggml
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    return lib


def devices() -> list[Device]:
    """ggml's devices, CPU included; empty where this build's library does not expose them."""
    try:
        lib = _ggml()
        found = []
        for i in range(lib.ggml_backend_dev_count()):
            dev = lib.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            found.append(Device(lib.ggml_backend_dev_name(dev).decode(errors="replace"),
                                lib.ggml_backend_dev_description(dev).decode(errors="replace"),
                                lib.ggml_backend_dev_type(dev) == GGML_DEVICE_TYPE_CPU, free.value, total.value))
        return found
    except (ImportError, AttributeError, OSError):
        return []


def accelerators() -> list[Device]:
    return [d for d in devices() if not d.is_cpu]


def build_kind() -> str:
    """'CPU-only build' or the build's GPU backends by name (e.g. 'CUDA build: CUDA0 (NVIDIA H100 80GB HBM3)')."""
    if not ll.llama_supports_gpu_offload():
        return "CPU-only build"
    named = ", ".join(f"{d.name} ({d.description})" for d in accelerators())
    return f"GPU build: {named}" if named else "GPU build"
