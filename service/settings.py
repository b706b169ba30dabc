"""Server settings: what `grace serve` reads once at start-up, before anything is loaded.

Sources, highest precedence first: overrides passed by the caller (CLI flags; None values
are ignored), `GRACE_<FIELD>` environment variables (case-insensitive), a config file
(TOML, JSON or YAML by suffix, keys the field names: the `config` override or
`GRACE_CONFIG`), the defaults below. Relative paths are relative to the working
directory; lists from the environment may be JSON (`[1,64,128,128]`) or comma-separated.
`Limits.from_settings` (service/validation.py) derives the request limits. Longer than the
house's ~300 lines because it is the settings reference: each field with the description
`grace serve --help` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from contracts.index_format import SID_LENGTH, VOCAB_SIZE
from contracts.request import Scoring, check_schedule
from service.beam_ladder import default_rungs
from service.model.config import PROFILES

# the precision a model serves in (the setting `dtype`: service/model/precision.py)
Precision = Literal["auto", "float32", "bfloat16", "fp8"]

# Batches in flight that make the pipeline busy (a forming batch keeps filling while at
# least this many compute): on a GPU 1, so batches never queue on the shared GPU; on a CPU
# 2, so a second batch keeps the stage threads busy (docs/OPERATIONS.md).
BUSY_BATCHES = 2
BUSY_BATCHES_GPU = 1
MAX_GROUPS = 2  # decode groups per batch (docs/RELIABILITY.md: the cost of a mixed batch)


def default_busy_batches(device: str) -> int:
    """The busy threshold for a server on `device` ("cpu", "cuda", "cuda:N")."""
    return BUSY_BATCHES_GPU if device.startswith("cuda") else BUSY_BATCHES


def _must(holds: Callable[[Any], bool], be: str) -> AfterValidator:
    """A field's check: a value (but None) for which `holds` is false is refused."""

    def check(v: Any) -> Any:
        if v is not None and not holds(v):  # the comparisons below also refuse NaN
            raise ValueError(f"must be {be}, got {v}")
        return v

    return AfterValidator(check)


Port = Annotated[
    int, _must(lambda v: 0 <= v <= 65535, "a TCP port in 0..65535 (0 = any free port)")
]
AtLeastOne = Annotated[int, _must(lambda v: v >= 1, ">= 1")]
_non_negative = _must(lambda v: v >= 0, ">= 0")
NonNegative = Annotated[float, _non_negative]
Ratio = Annotated[float, _must(lambda v: 0 <= v <= 1, "in [0, 1]")]
Share = Annotated[float, _must(lambda v: 0 <= v <= 1, "a share in 0..1")]
Interval = Annotated[float, _must(lambda v: 0 < v < float("inf"), "a positive number of seconds")]
Schedule = Annotated[tuple[int, ...] | None, NoDecode]
_FILE_SOURCES = {
    ".toml": TomlConfigSettingsSource,
    ".json": JsonConfigSettingsSource,
    ".yaml": YamlConfigSettingsSource,
    ".yml": YamlConfigSettingsSource,
}


class ServerSettings(BaseSettings):
    """Settings of one serving process. Build with `load_settings`."""

    model_config = SettingsConfigDict(env_prefix="GRACE_", extra="forbid")

    config: Path | None = Field(
        None,
        description="Config file (.toml, .json, .yaml/.yml) read below the environment and "
        "CLI flags; must exist when given. Env: GRACE_CONFIG.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the gRPC (and, unless metrics_host, metrics) port listens on: "
        "127.0.0.1, this machine only; 0.0.0.0, every interface (in a container, or for "
        "other machines' clients).",
    )
    metrics_host: str | None = Field(
        None, description="Address the Prometheus port listens on; default: host."
    )
    tls_cert: Path | None = Field(
        None,
        description="PEM certificate (chain) of the gRPC port: TLS with tls_key; read again "
        "when it changes (service/tls.py). Unset: plain text.",
    )
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert (unencrypted).")
    tls_client_ca: Path | None = Field(
        None,
        description="PEM CA certificates that callers' certificates must chain to: mutual TLS "
        "(a caller without one is refused). Needs tls_cert.",
    )
    port: Port = Field(50051, description="gRPC port; 0 lets the OS pick a free one (tests).")
    workers: int = Field(
        1,
        description="Serving processes per GPU (on a CPU: in all) sharing the gRPC port, each "
        "with its own model, index, pipeline and GIL (service/workers.py). Worker i serves "
        "metrics on metrics_port + i. More than one in all needs a fixed port.",
    )
    gpus: Annotated[list[int] | None, NoDecode] = Field(
        None,
        description="Which of the visible GPUs get `workers` workers each, as ordinals "
        "(e.g. '0,1'); unset: every visible GPU when device is 'cuda' or 'auto', the one of "
        "'cuda:N' (service/placement.py). On several GPUs each worker sees only its own.",
    )
    balance: Literal["connection", "request"] = Field(
        "connection",
        description="With workers > 1: 'connection' shares the port through SO_REUSEPORT "
        "(the kernel spreads connections, requests follow them); 'request' puts a front "
        "on the port that hands each request to the worker with the fewest in flight "
        "(service/balancer.py; one local hop more).",
    )
    mps: bool | None = Field(
        None,
        description="With workers > 1 on CUDA: run a private CUDA MPS control daemon so the "
        "workers' kernels share the GPU instead of time-slicing (service/mps.py; needs "
        "nvidia-cuda-mps-control on PATH). Unset: on whenever it can be (CUDA, the binary "
        "on PATH, no daemon already configured in CUDA_MPS_PIPE_DIRECTORY); true: required.",
    )
    metrics_port: Port = Field(9464, description="Prometheus HTTP port; 0 lets the OS pick one.")
    data_dir: Path = Field(Path("data"), description="Data directory (world, model, index).")
    index_root: Path | None = Field(None, description="Index root; default <data_dir>/index.")
    model_dir: Path | None = Field(
        None, description="Model checkpoint directory (grace train); default <data_dir>/model."
    )
    profile: str = Field("tiny", description=f"Model profile, one of {sorted(PROFILES)}.")
    device: str = Field(
        "auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'."
    )
    dtype: Precision = Field(
        "auto",
        description="The precision a model serves in: 'auto' is, per model version, FP8 on a "
        "GPU with FP8 (compute capability 8.9 or newer) where the version's FP8 quality record "
        "(grace publish-model --world) passes, else bfloat16 on CUDA and float32 on CPU; "
        "'fp8' forces the decode step's linear layers in FP8 e4m3, 'bfloat16' and 'float32' "
        "force those (service/model/precision.py, docs/FP8.md).",
    )
    max_batch: AtLeastOne = Field(16, description="Most requests in one batch.")
    graph_buckets: Annotated[list[int] | None, NoDecode] = Field(
        None,
        description="GPU only: batch sizes the CUDA graphs are captured for; a batch runs "
        "padded to the next one (max_batch is always added, larger sizes are ignored). "
        "Finer buckets pad less but take longer to capture, at start-up and on each index "
        "swap. Default: 2, 4, ..., 16 (GRAPH_BUCKETS in service/pipeline/stages.py).",
    )
    max_wait_ms: NonNegative = Field(
        5.0,
        description="Longest a request waits for its batch to fill while the pipeline is "
        "nearly idle, in milliseconds.",
    )
    max_wait_busy_ms: NonNegative = Field(
        20.0,
        description="Longest a batch keeps filling while the pipeline is busy (busy_batches "
        "or more batches in flight: a small batch would only queue), in ms.",
    )
    busy_batches: AtLeastOne | None = Field(
        None,
        description="Batches in flight from which the pipeline counts as busy and a forming "
        "batch keeps filling for up to max_wait_busy_ms instead of max_wait_ms. Default: 1 "
        "on CUDA (fewer, fuller GPU batches), 2 on CPU (default_busy_batches, above).",
    )
    queue_capacity: AtLeastOne = Field(
        256,
        description="Requests waiting for a batch; beyond it new ones get RESOURCE_EXHAUSTED. "
        "Requests with a deadline are refused earlier when it leaves no room for the "
        "predicted wait (service/admission.py).",
    )
    max_decode_groups: AtLeastOne = Field(
        MAX_GROUPS,
        description="Most decode groups in one batch: requests sharing a beam schedule and "
        "filter mode are one decode run. A request of another group waits for a later "
        "batch, keeping its place.",
    )
    default_max_ads: AtLeastOne = Field(1000, description="Ads returned when max_ads is 0.")
    max_ads_limit: AtLeastOne = Field(10_000, description="Largest max_ads a request may ask for.")
    max_history_events: Annotated[int, _non_negative] = Field(
        10_000, description="Most user.history events a request may carry."
    )
    beam_max: Schedule = Field(
        None,
        description="Per-step maxima (M_1..M_4) for Options.beam_widths; default the "
        "profile's beams.",
    )
    beams: Schedule = Field(
        None,
        description="Schedule used when a request sends no beam_widths; default the "
        "profile's beams, capped step by step at beam_max.",
    )
    beam_ladder: str = Field(
        "auto",
        description="Beam schedules a batch of requests without beam_widths decodes at "
        "under load, widest first (service/beam_ladder.py): 'auto' is `beams`, then its "
        "steps after the first halved, then quartered; 'off' is `beams` alone; or schedules "
        "separated by ';' (e.g. '1,512,1024,1024;1,256,512,512'), the first one `beams`.",
    )
    beam_rungs: str = Field(
        "",
        description="The rungs of beam_ladder that load may bring: 'A-B' (0 is the widest), "
        "or 'N' to pin rung N; empty: all of them.",
    )
    scoring: Scoring = Field(
        "masked",
        description="How a decode step scores a token: 'masked' by the log-softmax over the "
        "tokens the CD+GTM mask allows (renormalised); 'unmasked' by the model's own over the "
        "whole vocabulary (barred tokens excluded): a SID scores the same in either filter mode.",
    )
    index_poll_seconds: Interval = Field(
        1.0,
        description="How often the rollout reads <index_root>/CURRENT and the model "
        "repository's CURRENT, in seconds.",
    )
    rollout_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="The most of the wall time a model's load and a swap's prepare (GPU "
        "work included) take while serving: the rollout rests between steps (service/pace.py)."
        " An index's load and start-up are not paced; 1 turns pacing off.",
    )
    max_connection_age_seconds: NonNegative = Field(
        120.0,
        description="Close client connections after this age (with a GOAWAY) so that "
        "clients re-resolve and rebalance across replicas — HTTP/2 otherwise pins them; "
        "0 turns it off.",
    )
    max_connection_age_grace_seconds: NonNegative = Field(
        30.0, description="Time calls on an aged connection get to finish, in seconds."
    )
    max_connections: Annotated[int, _non_negative] | None = Field(
        None,
        description="Most client connections one process holds; gRPC closes new ones beyond "
        "it at once (UNAVAILABLE). Default: the open-files limit, raised to the hard limit at "
        "start, less 512 kept for the rollout's files and the runtime. 0: no cap.",
    )
    drain_seconds: NonNegative = Field(
        10.0, description="Grace period for in-flight requests on SIGTERM, in seconds."
    )
    stall_seconds: NonNegative = Field(
        60.0,
        description="A pipeline with batches in flight and no stage finished for this "
        "long is wedged: the process writes every thread's stack to stderr and exits 3, so "
        "it is restarted (service/watchdog.py). 0 turns the watchdog off.",
    )
    # workers beat every 0.5 s (service/board.py): a timeout of a few beats or more
    worker_heartbeat_seconds: Annotated[
        float, _must(lambda v: v == 0 or v >= 2, "0 (off) or at least 2 (4 beats)")
    ] = Field(
        5.0,
        description="With workers > 1: a serving worker whose event loop has not beaten "
        "for this long (frozen, or its loop blocked) is killed and restarted by the "
        "supervisor (service/supervisor.py). 0: exits are still restarted, freezes not seen.",
    )
    request_log: Path | None = Field(
        None,
        description="Append every valid Retrieve request to this file as one line of "
        "protobuf JSON (what `grace record` writes and loadtest/ replays); off when unset. "
        "A writer behind drops lines (counted), never slows requests.",
    )
    request_log_max_mb: NonNegative = Field(
        256.0,
        description="Rotate the request log when it reaches this many MiB: the file becomes "
        "<file>.1 (older ones <file>.2, <file>.3; the oldest is removed). 0: never rotate.",
    )
    tracing: Literal["off", "console", "otlp"] = Field(
        "off",
        description="OpenTelemetry spans per Retrieve RPC, batch and stage: 'console' writes "
        "them to stderr, 'otlp' exports them over OTLP/gRPC (the `otlp` extra; endpoint "
        "OTEL_EXPORTER_OTLP_ENDPOINT, default localhost:4317; docs/ops/tracing.md).",
    )
    tracing_sample_ratio: Ratio = Field(
        1.0,
        description="The share of new traces kept (0..1) when tracing is on; a trace the "
        "caller started follows the caller's sampling decision.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines: 'text' (one readable line each) or 'json' (one JSON object "
        "per line; service/logs.py). Env: GRACE_LOG_FORMAT; grace serve --log-format.",
    )
    access_log_sample: Share = Field(
        0.0,
        description="Share of OK Retrieve calls that get an access-log line (logger "
        "grace.access); every failed call gets one while this is above 0. 0 (the default): "
        'no access log, as the metrics already count every call (docs/SERVICE.md "Logs").',
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's own name comes from the two sources above it.
        path = init_settings().get("config") or env_settings().get("config")
        if path is None:
            return init_settings, env_settings
        path = Path(path)
        source = _FILE_SOURCES.get(path.suffix.lower())
        if source is None:
            raise ValueError(
                f"config file {path}: unknown type; use one of {sorted(_FILE_SOURCES)}"
            )
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        return init_settings, env_settings, source(settings_cls, path)

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str) -> str:
        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; known: {sorted(PROFILES)}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        kind, _, ordinal = v.partition(":")
        if v in ("auto", "cpu", "cuda") or (kind == "cuda" and ordinal.isdigit()):
            return v
        raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}")

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 0 or len(set(v)) != len(v)):
            raise ValueError(f"gpus must be distinct GPU ordinals >= 0, got {v}")
        return v

    @field_validator("graph_buckets")
    @classmethod
    def _buckets(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(b < 1 for b in v) or v != sorted(set(v))):
            raise ValueError(f"must be increasing sizes >= 1, got {v}")
        return v

    @field_validator("beam_max", "beams", "graph_buckets", "gpus", mode="before")
    @classmethod
    def _parse_schedule(cls, v: Any) -> Any:
        if isinstance(v, str):  # from the environment: "[1,64,128,128]" or "1,64,128,128"
            parts = [p for p in v.strip().strip("[]()").replace(" ", "").split(",") if p]
            return tuple(parts)
        return v

    @field_validator("beam_max", "beams")
    @classmethod
    def _schedule(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None:
            check_schedule(tuple(v), SID_LENGTH, VOCAB_SIZE)
        return v

    @model_validator(mode="after")
    def _resolve(self) -> ServerSettings:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.balance == "request" and self.workers < 2:
            raise ValueError("balance 'request' spreads requests over workers: needs workers > 1")
        if self.mps and (self.workers < 2 or self.device == "cpu"):
            raise ValueError("mps shares one GPU between workers: it needs workers > 1 and CUDA")
        if self.gpus is not None and (self.device == "cpu" or ":" in self.device):
            raise ValueError(f"gpus {self.gpus} picks GPUs for device 'cuda' or 'auto', "
                             f"not {self.device!r}")  # fmt: skip
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 share one port: give a fixed port, not 0")
        if self.metrics_port and self.metrics_port <= self.port < self.metrics_port + self.workers:
            raise ValueError(
                f"port {self.port} is among the workers' metrics ports "
                f"{self.metrics_port}..{self.metrics_port + self.workers - 1}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (TLS) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs the server's tls_cert and tls_key")
        if self.default_max_ads > self.max_ads_limit:
            raise ValueError(
                f"default_max_ads ({self.default_max_ads}) exceeds max_ads_limit "
                f"({self.max_ads_limit})"
            )
        self.metrics_host = self.metrics_host or self.host
        self.index_root = self.index_root or self.data_dir / "index"
        self.model_dir = self.model_dir or self.data_dir / "model"
        self.beam_max = self.beam_max or PROFILES[self.profile].beams
        if self.beams is None:
            self.beams = tuple(map(min, PROFILES[self.profile].beams, self.beam_max))
        over = [t for t in range(SID_LENGTH) if self.beams[t] > self.beam_max[t]]
        if over:
            raise ValueError(
                f"beams {self.beams} exceed beam_max {self.beam_max} at step {over[0] + 1}"
            )
        self.rung_bounds()  # checks the ladder too
        return self

    def ladder(self) -> tuple[tuple[int, ...], ...]:
        """`beam_ladder`'s schedules, widest first (the first is `beams`)."""
        assert self.beams is not None
        spec = self.beam_ladder.strip().lower()
        if spec in ("auto", "off"):
            return default_rungs(self.beams, 3 if spec == "auto" else 1)
        rungs = []
        for part in (p for p in spec.split(";") if p.strip()):
            try:
                rung = tuple(int(x) for x in part.replace(" ", "").strip("()[]").split(","))
            except ValueError:
                raise ValueError(f"beam_ladder: {part!r} is not a schedule of integers") from None
            check_schedule(rung, SID_LENGTH, VOCAB_SIZE)
            rungs.append(rung)
        if not rungs or rungs[0] != tuple(self.beams):
            raise ValueError(f"beam_ladder must start with beams {self.beams}, got {spec!r}")
        return tuple(rungs)

    def rung_bounds(self) -> tuple[int, int]:
        """The widest and the narrowest rung of `ladder()` that load may bring."""
        last = len(self.ladder()) - 1
        spec = self.beam_rungs.strip()
        if not spec:
            return 0, last
        lo, _, hi = spec.partition("-")
        try:
            bounds = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"beam_rungs: expected 'A-B' or 'N', got {spec!r}") from None
        if not 0 <= bounds[0] <= bounds[1] <= last:
            raise ValueError(f"beam_rungs {spec!r} is not within the ladder's rungs 0-{last}")
        return bounds

    def resolve_busy_batches(self, device: str) -> int:
        """The batcher's busy threshold on `device`: `busy_batches`, or the device's default."""
        return default_busy_batches(device) if self.busy_batches is None else self.busy_batches

    def resolve_device(self) -> str:
        """The torch device to run on: `device`, with 'auto' resolved."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def load_settings(
    overrides: Mapping[str, Any] | None = None, *, config_file: Path | str | None = None
) -> ServerSettings:
    """Settings from `overrides` (field names to values, None dropped) > environment >
    config file (`config_file`: an override `config`) > defaults; pydantic's
    ValidationError (a ValueError) names each bad field."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if config_file is not None:
        given.setdefault("config", Path(config_file))
    return ServerSettings(**given)
