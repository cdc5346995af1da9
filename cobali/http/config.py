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
ROUTERS = ("kv", "text", "least-busy")  # --router: by the replicas' KV, by a prompt text tree, by load alone


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
    # Ray Serve's autoscaling instead of a fixed --replicas (cobali.ray.serve): --min-replicas, --max-replicas and
    # --target-ongoing-requests (requests in flight per replica it aims at); None: not autoscaled.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    # The replicas' router (cobali.ray.router): --router kv, text or least-busy, None for the default (kv); the kv
    # router's weights (prefix, queue, KV use) and balance thresholds (absolute, relative), None for its defaults.
    router: str | None = None
    router_weights: tuple[float, float, float] | None = None
    router_balance: tuple[int, float] | None = None
    routing_stats_period_s: float | None = None  # --routing-stats-period: how often replicas report their KV
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
    access_log: bool = True  # --access-log/--no-access-log: uvicorn's line per request

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) < len(names) or self.served_model_name in names:
            raise ValueError(f"--lora-modules names must differ from each other and from the served model: {names}")
        self._check_replicas()
        if self.runtime_lora and self.on_ray:
            raise ValueError("--allow-runtime-lora-updating loads an adapter into one engine: not with --replicas")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
        if self.ssl_keyfile is not None and self.on_ray:
            raise ValueError("--ssl-keyfile/--ssl-certfile: with --replicas, Ray Serve's proxy serves HTTP, not TLS")
        if not self.on_ray and self.ray_address is not None:
            raise ValueError("--ray-address needs --replicas > 1 (one replica runs in this process)")

    @property
    def on_ray(self) -> bool:
        """Whether the server is several engine replicas behind Ray Serve (a fixed number, or autoscaled)."""
        return self.replicas > 1 or self.max_replicas is not None

    def _check_replicas(self) -> None:
        if self.min_replicas is not None and self.max_replicas is None:
            raise ValueError("--min-replicas needs --max-replicas (autoscaling between the two)")
        if self.target_ongoing_requests is not None and self.max_replicas is None:
            raise ValueError("--target-ongoing-requests needs --max-replicas (it steers autoscaling)")
        if self.max_replicas is not None:
            if self.replicas > 1:
                raise ValueError("--replicas fixes the number of replicas: not with --max-replicas (autoscaled)")
            if (1 if self.min_replicas is None else self.min_replicas) > self.max_replicas:
                raise ValueError(f"--min-replicas {self.min_replicas} is more than --max-replicas "
                                 f"{self.max_replicas}")
        if self.router not in (None, *ROUTERS):
            raise ValueError(f"--router: {self.router!r} is not one of {', '.join(ROUTERS)}")
        routed = {"--router": self.router, "--router-weights": self.router_weights,
                  "--router-balance": self.router_balance, "--routing-stats-period": self.routing_stats_period_s}
        given = [flag for flag, value in routed.items() if value is not None]
        if given and not self.on_ray:
            raise ValueError(f"{given[0]} routes among replicas: it needs --replicas > 1 or --max-replicas")
        if self.router not in (None, "kv"):
            for flag in ("--router-weights", "--router-balance"):
                if routed[flag] is not None:
                    raise ValueError(f"{flag} tunes the kv router: not with --router {self.router}")
