"""The Backend over one llama.cpp model and context: decode, KV sequences, adapters, sampling, embeddings; its
text side (vocabulary, templates) is LlamaCppVocabulary's, over the same model."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import llama_cpp as ll
import numpy as np

from cobali.backends.base import Backend, BackendInfo, BatchArrays, EmbeddingLimits, SamplerChain
from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp.batch import OwnedBatch, decode_batch
from cobali.backends.llama_cpp.config import PREFILL_TILE, LlamaCppConfig
from cobali.backends.llama_cpp.counters import DecodeCounter, DecodeCounts
from cobali.backends.llama_cpp.device_greedy import DeviceGreedy
from cobali.backends.llama_cpp.devices import build_kind
from cobali.backends.llama_cpp.embedder import EMBEDDING_CTX, EMBEDDING_SEQS, Embedder
from cobali.backends.llama_cpp.kv_size import kv_bytes_per_token
from cobali.backends.llama_cpp.loading import (
    KvPlan,
    load_line,
    load_model,
    model_desc,
    new_context,
    plan_kv,
    repack_choice,
    repacked_mib,
)
from cobali.backends.llama_cpp.repack import RepackChoice
from cobali.backends.llama_cpp.sampler import LlamaCppSampler
from cobali.backends.llama_cpp.tools import llama_logs
from cobali.backends.llama_cpp.vocab import LlamaCppVocabulary
from cobali.backends.memory import gpu_present

log = logging.getLogger("cobali.backend")


class LlamaCppBackend(LlamaCppVocabulary, Backend):
    """A vocabulary (its base) over the model loaded whole, with a context to decode in."""

    def __init__(self, options: LlamaCppConfig) -> None:
        model_path = options.model_path or embedded_model_path()
        logs = llama_logs(options.verbose)  # kept to say why a load failed; on stderr too with --verbose
        mark = logs.count
        ll.llama_backend_init()
        self.options = options
        super().__init__(load_model(model_path, options))
        self.counter = DecodeCounter(options.n_seq_max) if options.count_decodes else None
        try:
            plan = plan_kv(self.model, options)
            self.ctx = new_context(self.model, options, plan, self.counter.eval_callback if self.counter else None)
        except ValueError:
            super().close()
            raise
        self.memory = ll.llama_get_memory(self.ctx)
        lines = logs.since(mark)
        self._log_load(plan, lines, repack_choice(options.repack, model_path))
        self.weights_repacked = repacked_mib(lines) > 0
        self.info = BackendInfo(
            n_vocab=self.n_vocab,
            n_ctx=ll.llama_n_ctx(self.ctx),
            # A unified pool may outgrow the positions the model was trained for: no request goes past those.
            n_ctx_seq=min(ll.llama_n_ctx_seq(self.ctx), ll.llama_model_n_ctx_train(self.model)) if options.kv_unified
            else ll.llama_n_ctx_seq(self.ctx),
            n_seq_max=ll.llama_n_seq_max(self.ctx),
            n_batch=ll.llama_n_batch(self.ctx),
            kv_unified=options.kv_unified,
            description=self._describe(options),
            prefill_tile=PREFILL_TILE,
            kv_bytes_per_token=kv_bytes_per_token(self.model, options),
            # llama.cpp counts the outputs of sequences it samples itself only
            max_outputs_per_seq=options.max_outputs_per_seq if options.backend_sampling else 0,
            n_loras=len(options.lora_paths),
        )
        self._loras = {index: self._load_lora(path) for index, path in enumerate(options.lora_paths, 1)}
        self._next_lora = len(self._loras) + 1  # an index is never used twice
        self._lora_in_use = 0
        self._batch = OwnedBatch(self.info.n_batch)
        self.device_greedy = DeviceGreedy(self.ctx, self.info.n_seq_max) if options.backend_sampling else None
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}
        self._last_logits = np.zeros((0, self.n_vocab), dtype=np.float32)  # the last decode's output rows
        self._embedder: Embedder | None = None

    def _log_load(self, plan: KvPlan, lines: list[tuple[int, str]], repack: RepackChoice) -> None:
        log.info("%s", load_line(self.model, self.ctx, self.options, plan, lines, build_kind(), repack))
        if not ll.llama_supports_gpu_offload() and (gpu := gpu_present()):
            log.warning("this machine has a GPU (%s) but this llama.cpp build is CPU-only: everything runs on the "
                        "CPU. Rebuild llama-cpp-python for it, e.g. CMAKE_ARGS=\"-DGGML_CUDA=on\" make install", gpu)

    def _describe(self, options: LlamaCppConfig) -> str:
        kv = "unified" if options.kv_unified else "per-sequence streams"
        if (options.cache_type_k, options.cache_type_v) != ("f16", "f16"):  # a cost profile's device changes with it
            kv += f" {options.cache_type_k}/{options.cache_type_v}"
        greedy = ", greedy tokens picked in the graph" if options.backend_sampling else ""
        # repacked weights about double prefill's speed: a cost profile's device changes with them
        repacked = ", weights repacked" if self.weights_repacked else ""
        return f"{model_desc(self.model)}{repacked}, {self.info_threads()} threads, KV {kv}{greedy}"

    def info_threads(self) -> int:
        return ll.llama_n_threads(self.ctx)

    # ---- compute ----------------------------------------------------------------------------------

    def decode(self, tokens, positions, seq_ids, want_logits) -> np.ndarray:
        n = self._batch.fill(tokens, positions, seq_ids, want_logits)
        if self.device_greedy is not None:
            rows = self._batch.arrays
            self.device_greedy.prepare(rows.seq_ids[:n], rows.want_logits[:n])
        n_out = int(np.count_nonzero(want_logits[:n]))
        if self.counter is None:
            decode_batch(self.ctx, self._batch)
        else:
            self._counted_decode(self.counter, n_out)
        if n_out == 0:
            return np.zeros((0, self.info.n_vocab), dtype=np.float32)
        self._last_logits = self._logits_view(n_out)
        return self._last_logits

    def _counted_decode(self, counter: DecodeCounter, n_out: int) -> None:
        counter.before_decode(self.ctx, n_out)
        decode_batch(self.ctx, self._batch)
        picked = self.device_greedy.picked_rows if self.device_greedy is not None else []
        counter.after_decode(self.ctx, n_out, picked)

    def graphs_reused(self) -> int:
        """Forward passes since the model loaded that ran the previous pass's graph again (llama.cpp's
        n_reused): the rest were built anew."""
        return ll.llama_perf_context(self.ctx).n_reused

    @property
    def decode_counts(self) -> list[DecodeCounts] | None:
        """What llama.cpp did in each decode since the model loaded, with count_decodes (else None)."""
        return self.counter.decodes if self.counter is not None else None

    def _logits_view(self, n_out: int) -> np.ndarray:
        """The output rows llama_get_logits points at (in batch order), viewed without copying. A view is made
        once per buffer address and row count: making one every tick showed in a one-row tick's host work
        (docs/results.md, "Serving")."""
        pointer = ll.llama_get_logits(self.ctx)
        key = (ctypes.addressof(pointer.contents), n_out)
        view = self._logits_views.get(key)
        if view is None:
            if len(self._logits_views) > 4 * self.info.n_batch:  # buffers llama.cpp has since reallocated
                self._logits_views.clear()
            view = self._logits_views[key] = np.ctypeslib.as_array(pointer, shape=(n_out, self.info.n_vocab))
        return view

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        if self.device_greedy is not None:
            return self.device_greedy.tokens(logits)
        return logits.argmax(axis=1)

    def batch_arrays(self) -> BatchArrays:
        return self._batch.arrays

    def remove_seq(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        ll.llama_memory_seq_rm(self.memory, seq_id, p0, p1)

    def use_lora(self, index: int) -> None:
        adapters = (ll.llama_adapter_lora_p_ctypes * 1)(self._loras[index]) if index else None
        scales = (ctypes.c_float * 1)(1.0) if index else None
        if ll.llama_set_adapters_lora(self.ctx, adapters, 1 if index else 0, scales) != 0:
            raise RuntimeError(f"llama.cpp could not set LoRA adapter {index}")
        self._lora_in_use = index

    def load_lora(self, path: str) -> int:
        adapter = self._load_lora(path)  # a failed load uses up no index
        index, self._next_lora = self._next_lora, self._next_lora + 1
        self._loras[index] = adapter
        return index

    def unload_lora(self, index: int) -> None:
        if self._lora_in_use == index:  # the context must not keep a freed adapter
            self.use_lora(0)
        ll.llama_adapter_lora_free(self._loras.pop(index))

    def _load_lora(self, path: str):
        adapter = ll.llama_adapter_lora_init(self.model, path.encode()) if os.path.isfile(path) else None
        if not adapter:  # freed with the model
            raise ValueError(f"could not load a LoRA adapter for this model from {path}")
        return adapter

    def copy_seq(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        ll.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def save_seq(self, seq_id: int) -> np.ndarray:
        data = _mapped_buffer(ll.llama_state_seq_get_size(self.ctx, seq_id))
        n = ll.llama_state_seq_get_data(self.ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.nbytes,
                                        seq_id)
        assert n == data.nbytes, f"llama.cpp saved {n} of {data.nbytes} bytes of sequence {seq_id}"
        return data

    def load_seq(self, seq_id: int, data: np.ndarray) -> None:
        pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if not ll.llama_state_seq_set_data(self.ctx, pointer, data.nbytes, seq_id):
            raise RuntimeError(f"llama.cpp could not restore {data.nbytes} bytes of KV into sequence {seq_id}")

    # ---- embeddings -------------------------------------------------------------------------------

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings, one row per input, from a context of their own (made on first use)."""
        if self._embedder is None:
            self._embedder = Embedder(self.model, self.options)
        return self._embedder.embed(inputs)

    @property
    def embedding_limits(self) -> EmbeddingLimits:
        # Positions past the model's training context would embed garbage.
        max_tokens = min(EMBEDDING_CTX, ll.llama_model_n_ctx_train(self.model))
        return EmbeddingLimits(max_tokens, EMBEDDING_SEQS, ll.llama_model_n_embd(self.model))

    # ---- sampling ---------------------------------------------------------------------------------

    def new_sampler(self, spec: SamplerChain) -> LlamaCppSampler:
        return LlamaCppSampler(self.ctx, self.vocab, spec)

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self.device_greedy is not None:
            self.device_greedy.close()
            self.device_greedy = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        super().close()  # the model, after every context made from it


def _mapped_buffer(size: int) -> np.ndarray:
    """Host memory with its pages mapped up front (MAP_POPULATE): a save then writes at memory speed instead of
    faulting a page at a time, several times slower (docs/results.md, "KV management")."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, max(size, 1), flags=flags), dtype=np.uint8, count=size)
