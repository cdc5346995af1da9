"""llama.cpp through llama-cpp-python's low-level C bindings. The only module that imports llama_cpp."""

from __future__ import annotations

import ctypes
import os

import llama_cpp as ll
import numpy as np

from cobali.backends.base import (
    BackendInfo,
    BatchArrays,
    DecodeError,
    EmbeddingLimits,
    SamplingParams,
    TemplateSource,
)
from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp_config import PREFILL_TILE, LlamaCppConfig

# The embeddings context: tokens one input may have (and one decode may carry), inputs per decode.
EMBEDDING_CTX = 2048
EMBEDDING_SEQS = 16
_DECODE_ERRORS = {1: "no KV slot for the batch (KV cache full)", 2: "decode aborted"}
_LOG_CALLBACK = None  # keep the ctypes callback alive for the life of the process


def _decode(ctx, batch: _OwnedBatch) -> None:
    code = ll.llama_decode(ctx, batch.struct)
    if code != 0:
        raise DecodeError(_DECODE_ERRORS.get(code, f"llama_decode returned {code}"), code)


def _silence_logs() -> None:
    global _LOG_CALLBACK
    _LOG_CALLBACK = ll.llama_log_callback(lambda level, text, data: None)
    ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class LlamaCppBackend:
    def __init__(self, options: LlamaCppConfig) -> None:
        model_path = options.model_path or embedded_model_path()
        if not os.path.isfile(model_path):
            raise ValueError(f"model file not found: {model_path}")
        if not options.verbose:
            _silence_logs()
        ll.llama_backend_init()
        self.options = options
        self.model = self._load_model(model_path, options)
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.ctx = self._new_context(options)
        self.memory = ll.llama_get_memory(self.ctx)
        n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.info = BackendInfo(
            n_vocab=n_vocab,
            n_ctx=ll.llama_n_ctx(self.ctx),
            n_ctx_seq=ll.llama_n_ctx_seq(self.ctx),
            n_seq_max=ll.llama_n_seq_max(self.ctx),
            n_batch=ll.llama_n_batch(self.ctx),
            kv_unified=options.kv_unified,
            description=self._describe(options),
            prefill_tile=PREFILL_TILE,
        )
        self._batch = _OwnedBatch(self.info.n_batch)
        self._pieces: dict[int, bytes] = {}
        self._embedder: _Embedder | None = None

    @staticmethod
    def _load_model(model_path: str, options: LlamaCppConfig):
        params = ll.llama_model_default_params()
        gpu = options.n_gpu_layers
        params.n_gpu_layers = (999 if ll.llama_supports_gpu_offload() else 0) if gpu < 0 else gpu
        params.use_extra_bufts = options.use_extra_bufts
        model = ll.llama_model_load_from_file(model_path.encode(), params)
        if not model:
            raise ValueError(f"could not load a GGUF model from {model_path}")
        return model

    def _new_context(self, options: LlamaCppConfig):
        params = ll.llama_context_default_params()
        n_ctx = options.total_cells(ll.llama_model_n_ctx_train(self.model))
        threads = options.n_threads or os.cpu_count() or 1
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = options.n_batch  # one decode = one compute graph
        params.n_seq_max = options.n_seq_max
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = options.kv_unified
        params.no_perf = True
        ctx = ll.llama_init_from_model(self.model, params)
        if not ctx:
            raise ValueError(f"could not create a llama.cpp context (n_ctx={n_ctx}, n_seq_max={options.n_seq_max})")
        return ctx

    def _describe(self, options: LlamaCppConfig) -> str:
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buf, len(buf))
        kv = "unified" if options.kv_unified else "per-sequence streams"
        return f"{buf.value.decode(errors='replace')}, {self.info_threads()} threads, KV {kv}"

    def info_threads(self) -> int:
        return ll.llama_n_threads(self.ctx)

    # ---- compute ----------------------------------------------------------------------------------

    def decode(self, tokens, positions, seq_ids, want_logits) -> np.ndarray:
        n = self._batch.fill(tokens, positions, seq_ids, want_logits)
        _decode(self.ctx, self._batch)
        n_out = int(np.count_nonzero(want_logits[:n]))
        if n_out == 0:
            return np.zeros((0, self.info.n_vocab), dtype=np.float32)
        # llama_get_logits returns the output rows in batch order; view them without copying.
        return np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(n_out, self.info.n_vocab))

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        return logits.argmax(axis=1)

    def batch_arrays(self) -> BatchArrays:
        return self._batch.arrays

    def remove_seq(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        ll.llama_memory_seq_rm(self.memory, seq_id, p0, p1)

    def copy_seq(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        ll.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    # ---- vocabulary -------------------------------------------------------------------------------

    def eog_mask(self) -> np.ndarray:
        return np.array([ll.llama_vocab_is_eog(self.vocab, t) for t in range(self.info.n_vocab)], dtype=bool)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        capacity = len(data) + 16
        buf = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, True)
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, True)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        template = ll.llama_model_chat_template(self.model, None)
        if not template:
            raise ValueError("the model has no chat template")
        chat = (ll.llama_chat_message * len(messages))()
        keep = []  # the C structs point into these bytes
        for item, message in zip(chat, messages, strict=True):
            role, content = message["role"].encode(), message["content"].encode()
            keep += [role, content]
            item.role, item.content = role, content
        size = 1024 + 2 * sum(len(b) for b in keep)
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(template, chat, len(messages), True, buf, size)
        if n < 0:
            raise ValueError("the model's chat template is not supported by llama.cpp")
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = ll.llama_chat_apply_template(template, chat, len(messages), True, buf, n)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def chat_template_source(self) -> TemplateSource:
        text = ll.llama_model_chat_template(self.model, None)
        return TemplateSource(text.decode("utf-8", errors="replace") if text else None,
                              self._special_text(ll.llama_vocab_bos(self.vocab)),
                              self._special_text(ll.llama_vocab_eos(self.vocab)),
                              bool(ll.llama_vocab_get_add_bos(self.vocab)))

    def _special_text(self, token: int) -> str:
        if token < 0:  # LLAMA_TOKEN_NULL: the model has no such token
            return ""
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", errors="replace")

    # ---- embeddings -------------------------------------------------------------------------------

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings, one row per input, from a context of their own (made on first use)."""
        if self._embedder is None:
            self._embedder = _Embedder(self.model, self.options)
        return self._embedder.embed(inputs)

    @property
    def embedding_limits(self) -> EmbeddingLimits:
        # Positions past the model's training context would embed garbage.
        max_tokens = min(EMBEDDING_CTX, ll.llama_model_n_ctx_train(self.model))
        return EmbeddingLimits(max_tokens, EMBEDDING_SEQS, ll.llama_model_n_embd(self.model))

    # ---- sampling ---------------------------------------------------------------------------------

    def new_sampler(self, params: SamplingParams) -> LlamaCppSampler:
        return LlamaCppSampler(self, params)

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None


class _Embedder:
    """An embeddings context: the inputs of one call share decodes (up to EMBEDDING_SEQS sequences and
    EMBEDDING_CTX tokens each), pooled the model's way, or by mean for a generative model that has none."""

    def __init__(self, model, options: LlamaCppConfig) -> None:
        self.ctx = self._context(model, options, ll.LLAMA_POOLING_TYPE_UNSPECIFIED)
        if ll.llama_pooling_type(self.ctx) == ll.LLAMA_POOLING_TYPE_NONE:
            ll.llama_free(self.ctx)
            self.ctx = self._context(model, options, ll.LLAMA_POOLING_TYPE_MEAN)
        self.n_embd = ll.llama_model_n_embd(model)
        self.batch = _OwnedBatch(EMBEDDING_CTX)

    @staticmethod
    def _context(model, options: LlamaCppConfig, pooling: int):
        params = ll.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = EMBEDDING_CTX  # pooling needs a sequence in one ubatch
        params.n_seq_max = EMBEDDING_SEQS
        params.kv_unified = True
        params.embeddings = True
        params.pooling_type = pooling
        params.n_threads = params.n_threads_batch = options.n_threads or os.cpu_count() or 1
        ctx = ll.llama_init_from_model(model, params)
        if not ctx:
            raise ValueError("could not create a llama.cpp embeddings context")
        return ctx

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(inputs), self.n_embd), dtype=np.float32)
        group: list[int] = []
        for index, tokens in enumerate(inputs):
            assert 0 < len(tokens) <= EMBEDDING_CTX, "inputs are checked against embedding_limits"
            if group and (len(group) == EMBEDDING_SEQS
                          or sum(len(inputs[i]) for i in group) + len(tokens) > EMBEDDING_CTX):
                self._decode(inputs, group, out)
                group = []
            group.append(index)
        self._decode(inputs, group, out)
        return out

    def _decode(self, inputs: list[list[int]], group: list[int], out: np.ndarray) -> None:
        tokens = np.concatenate([inputs[i] for i in group]).astype(np.int32)
        positions = np.concatenate([np.arange(len(inputs[i])) for i in group])
        seqs = np.concatenate([np.full(len(inputs[i]), seq) for seq, i in enumerate(group)])
        self.batch.fill(tokens, positions, seqs, np.ones(len(tokens), dtype=np.int8))
        memory = ll.llama_get_memory(self.ctx)
        try:
            _decode(self.ctx, self.batch)
            for seq, index in enumerate(group):
                out[index] = np.ctypeslib.as_array(ll.llama_get_embeddings_seq(self.ctx, seq), shape=(self.n_embd,))
        finally:
            ll.llama_memory_clear(memory, True)

    def close(self) -> None:
        ll.llama_free(self.ctx)


class _OwnedBatch:
    """A llama_batch whose arrays are numpy buffers: the engine fills them in place (BatchArrays).

    llama_batch_init gives each row its own malloc'd seq_id array, which cannot be filled in one numpy
    operation; here every row's seq_id pointer points into one contiguous int32 array instead.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arrays = a = BatchArrays.zeros(capacity)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        seq_base = a.seq_ids.ctypes.data
        self.seq_ptrs = (ctypes.POINTER(ll.llama_seq_id) * capacity)(
            *(ctypes.cast(seq_base + 4 * i, ctypes.POINTER(ll.llama_seq_id)) for i in range(capacity))
        )
        self.struct = ll.llama_batch()
        self.struct.token = a.tokens.ctypes.data_as(ctypes.POINTER(ll.llama_token))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = a.positions.ctypes.data_as(ctypes.POINTER(ll.llama_pos))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = self.seq_ptrs
        self.struct.logits = a.want_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens, positions, seq_ids, want_logits) -> int:
        """Point the batch at its first n rows, copying only inputs that are not already views of them."""
        n = len(tokens)
        assert 0 < n <= self.capacity, f"batch of {n} rows for a capacity of {self.capacity}"
        a = self.arrays
        for own, given in ((a.tokens, tokens), (a.positions, positions), (a.seq_ids, seq_ids),
                           (a.want_logits, want_logits)):
            if not (isinstance(given, np.ndarray) and given.ctypes.data == own.ctypes.data):
                own[:n] = given
        self.struct.n_tokens = n
        return n


class LlamaCppSampler:
    """One llama.cpp sampler chain per request: penalties, top-k, top-p, min-p, temperature, then a draw."""

    def __init__(self, backend: LlamaCppBackend, params: SamplingParams) -> None:
        self.backend = backend
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        add = lambda s: ll.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if params.grammar is not None:
            grammar = ll.llama_sampler_init_grammar(backend.vocab, params.grammar.encode(), b"root")
            if not grammar:
                self.close()
                raise ValueError("invalid grammar")
            add(grammar)
        if params.logit_bias:
            biases = (ll.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
            add(ll.llama_sampler_init_logit_bias(backend.info.n_vocab, len(params.logit_bias), biases))
        if (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) != (1.0, 0.0, 0.0):
            add(ll.llama_sampler_init_penalties(backend.info.n_vocab, 64, params.repetition_penalty,
                                                params.frequency_penalty, params.presence_penalty))
        if params.temperature == 0:
            add(ll.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            add(ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(ll.llama_sampler_init_min_p(params.min_p, 1))
        add(ll.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else ll.LLAMA_DEFAULT_SEED
        add(ll.llama_sampler_init_dist(seed))

    def sample(self, row: int) -> int:
        # llama_sampler_sample also accepts the token into the chain (penalty history, grammar state).
        return int(ll.llama_sampler_sample(self.chain, self.backend.ctx, row))

    def close(self) -> None:
        if self.chain:
            ll.llama_sampler_free(self.chain)
            self.chain = None


def quantize_model(src: str, dst: str, quant: str, n_threads: int = 0) -> None:
    """Rewrite the GGUF at `src` into `dst` with weights of type `quant` (a llama_ftype name such as
    Q5_K_M), through llama.cpp's own quantizer: the same mixes llama-quantize makes."""
    ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}", None)
    if ftype is None:
        raise ValueError(f"unknown quantization type {quant!r} (llama_ftype names, e.g. Q5_K_M, Q4_K_M, Q8_0)")
    _silence_logs()
    ll.llama_backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = n_threads
    code = ll.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if code != 0:
        raise ValueError(f"llama_model_quantize failed ({code}) for {src} -> {dst} as {quant}")
