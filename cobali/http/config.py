"""The server's typed settings, built once from `cobali serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from cobali.frontend.request_limits import PreprocessLimits, RequestLimits
from cobali.structured.limits import GrammarLimits

# A body is parsed in one call that holds the GIL: this bounds how long the event loop can wait for it.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_SEND_TIMEOUT_S = 30.0
DEFAULT_MAX_STREAM_BUFFER_CHARS = 1024 * 1024
# Requests in flight (connections at work: cobali.http.connections): a common open-files limit, each holding at
# most --max-body-bytes of body; one address may take half, as one client may take half the preprocessing workers.
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 512


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int | None = 256  # requests that may wait for a slot; beyond it HTTP 429 (None: no limit)
    api_keys: tuple[str, ...] = ()  # --api-key, --api-key-file: a request must bear one of them (none: open)
    shared_prefix_cache: bool = False  # --shared-prefix-cache: keys share cached prefixes (else each key its own)
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS  # requests in flight at once; beyond: 503 (None: no cap)
    max_connections_per_client: int | None = DEFAULT_MAX_CONNECTIONS_PER_CLIENT  # per client address; beyond: 429
    allowed_origins: tuple[str, ...] = ()  # --allowed-origins: browser pages that may call the API (CORS)
    ssl_keyfile: str | None = None  # --ssl-keyfile and --ssl-certfile: HTTPS, both or neither
    ssl_certfile: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_name: str | None = None  # None: the GGUF file's name
    shutdown_grace_s: float = 30.0
    replicas: int = 1
    engine_process: bool = False  # --engine-process: the engine in a process of its own, restarted when it dies
    ray_address: str | None = None
    chat_template: str | None = None  # --chat-template: the Jinja text, used instead of the model's own
    reasoning_parser: str = "auto"  # --reasoning-parser: a name, auto (from the chat template) or none
    tool_call_parser: str = "auto"  # --tool-call-parser: a name, or auto (from the chat template)
    stream_interval: int = 1  # tokens per streamed delta at most; the first text and the end never wait
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (model id, adapter GGUF), adapters 1, 2, ...
    runtime_lora: bool = False  # --allow-runtime-lora-updating: vLLM's load/unload routes
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask (--max-choices, ...)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # what one constraint may cost (--max-grammar-bytes)
    preprocess: PreprocessLimits = field(default_factory=PreprocessLimits)  # --preprocess-workers, -timeout, ...
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S  # --send-timeout: a stream's client must read within it
    max_stream_buffer_chars: int = DEFAULT_MAX_STREAM_BUFFER_CHARS  # --max-stream-buffer: text held per stream

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) < len(names) or self.served_model_name in names:
            raise ValueError(f"--lora-modules names must differ from each other and from the served model: {names}")
        if self.runtime_lora and self.replicas > 1:
            raise ValueError("--allow-runtime-lora-updating loads an adapter into one engine: not with --replicas")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
        if self.ssl_keyfile is not None and self.replicas > 1:
            raise ValueError("--ssl-keyfile/--ssl-certfile: with --replicas, Ray Serve's proxy serves HTTP, not TLS")
        if self.replicas == 1 and self.ray_address is not None:
            raise ValueError("--ray-address needs --replicas > 1 (one replica runs in this process)")
