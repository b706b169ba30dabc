"""Server settings: what `grace serve` reads once at start-up, before anything is loaded.

Sources, highest precedence first:

    1. overrides passed by the caller (CLI flags, as a dict; None values are ignored)
    2. environment variables `GRACE_<FIELD>` (case-insensitive), e.g. `GRACE_PORT=50052`
    3. a config file (TOML, JSON or YAML by suffix) named by the `config` override,
       `GRACE_CONFIG`, or `load_settings(config_file=...)`; keys are the field names
    4. the defaults below

Relative paths are relative to the working directory, not to the config file. Beam
schedules from the environment may be JSON (`[1,64,128,128]`) or comma-separated
(`1,64,128,128`). `Limits.from_settings` (service/validation.py) derives the request
limits; nothing downstream reads a setting per request. This module is longer than the
house's ~300 lines because it is the settings reference: one field per setting, each with
the description `grace serve --help` prints and the docs show, and its check — long
because the settings are many, not because it does several things.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
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
from service.model.config import PROFILES

# the precision a model serves in (the setting `dtype`: service/model/precision.py)
Precision = Literal["auto", "float32", "bfloat16", "fp8"]

# Batches in flight that make the pipeline busy (the batcher keeps a forming batch filling
# while at least this many compute): on a GPU 1 — batches go when the pipeline drains, so
# they never queue on the shared GPU; on a CPU 2 — the stage threads share the cores, and
# a second batch in flight keeps them busy. docs/OPERATIONS.md gives the measurements.
BUSY_BATCHES = 2
BUSY_BATCHES_GPU = 1
MAX_GROUPS = 2  # decode groups per batch (docs/RELIABILITY.md: the cost of a mixed batch)


def default_busy_batches(device: str) -> int:
    """The busy threshold for a server on `device` ("cpu", "cuda", "cuda:N")."""
    return BUSY_BATCHES_GPU if device.startswith("cuda") else BUSY_BATCHES


_FILE_SOURCES = {
    ".toml": TomlConfigSettingsSource,
    ".json": JsonConfigSettingsSource,
    ".yaml": YamlConfigSettingsSource,
    ".yml": YamlConfigSettingsSource,
}

Schedule = Annotated[tuple[int, ...] | None, NoDecode]


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
        description="Address the gRPC and metrics ports listen on: 127.0.0.1, this machine "
        "only (a demo on a laptop); 0.0.0.0, every interface, in a container or on a "
        "server others call (GRACE_HOST=0.0.0.0, grace serve --host 0.0.0.0).",
    )
    port: int = Field(50051, description="gRPC port; 0 lets the OS pick a free one (tests).")
    workers: int = Field(
        1,
        description="Serving processes per GPU (on a CPU: in all) sharing the gRPC port "
        "(SO_REUSEPORT), each with its own model, index, GPU pipeline and GIL (one "
        "process's event loop and stage threads share one GIL: docs/OPERATIONS.md). Worker "
        "i serves metrics on metrics_port + i. More than one in all needs a fixed port.",
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
        "on the port that hands each request to the worker with the fewest in flight, the "
        "workers on private unix sockets (service/balancer.py; one local hop more).",
    )
    mps: bool | None = Field(
        None,
        description="With workers > 1 on CUDA: run a private CUDA MPS control daemon so the "
        "workers' kernels share the GPU side by side instead of time-slicing between their "
        "contexts (service/mps.py; needs nvidia-cuda-mps-control on PATH). Unset: on "
        "whenever it can be (workers > 1, CUDA, the binary on PATH, no MPS daemon already "
        "configured in CUDA_MPS_PIPE_DIRECTORY); true: required, an error otherwise.",
    )
    metrics_port: int = Field(
        9464, description="Prometheus HTTP port; 0 lets the OS pick a free one (tests)."
    )
    data_dir: Path = Field(
        Path("data"), description="Working data directory (world, model, index)."
    )
    index_root: Path | None = Field(
        None, description="Index root holding versions and CURRENT; default <data_dir>/index."
    )
    model_dir: Path | None = Field(
        None, description="Model checkpoint directory (grace train); default <data_dir>/model."
    )
    profile: str = Field(
        "tiny", description=f"Model profile, one of {sorted(PROFILES)} (service/model/config.py)."
    )
    device: str = Field(
        "auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'."
    )
    dtype: Precision = Field(
        "auto",
        description="The precision a model serves in (service/model/precision.py): 'auto' is "
        "bfloat16 on CUDA and float32 on CPU (bfloat16 is slow on most CPUs); 'fp8' (opt-in) "
        "is 'auto' with the decode step's linear layers in FP8 e4m3 (docs/FP8.md), on CUDA "
        "compute capability 8.9 or newer (Ada, Hopper).",
    )
    max_batch: int = Field(16, description="Most requests in one batch.")
    graph_buckets: Annotated[list[int] | None, NoDecode] = Field(
        None,
        description="GPU only: batch sizes the CUDA graphs are captured for; a batch runs "
        "padded to the next one (max_batch is always added). Finer buckets waste less GPU "
        "on padding but take longer to capture at start-up and on each index swap (two "
        "decode plans and their buffers per bucket); sizes >= max_batch are ignored. "
        "Default: 2, 4, ..., 16 (GRAPH_BUCKETS in service/pipeline/stages.py).",
    )
    max_wait_ms: float = Field(
        5.0,
        description="Longest a request waits for its batch to fill while the pipeline is "
        "nearly idle, in milliseconds.",
    )
    max_wait_busy_ms: float = Field(
        20.0,
        description="Longest a batch keeps filling while the pipeline is busy (busy_batches "
        "or more batches in flight: a small batch would only queue and waste the GPU), in ms.",
    )
    busy_batches: int | None = Field(
        None,
        description="Batches in flight from which the pipeline counts as busy and a forming "
        "batch keeps filling for up to max_wait_busy_ms instead of max_wait_ms: 1 fills "
        "batches as soon as anything is in flight (fewer, fuller GPU batches), 2 as soon as "
        "one batch waits behind a computing one. Default: 1 on CUDA, 2 on CPU "
        "(default_busy_batches, above).",
    )
    queue_capacity: int = Field(
        256,
        description="Requests waiting for a batch; beyond it new ones get RESOURCE_EXHAUSTED. "
        "Requests with a deadline are refused earlier when it leaves no room for the "
        "predicted wait (service/admission.py).",
    )
    max_decode_groups: int = Field(
        MAX_GROUPS,
        description="Most decode groups in one batch: requests sharing a beam schedule and "
        "filter mode are one decode run, so a batch mixing many schedules costs many runs. "
        "A request of another group waits for a later batch, keeping its place.",
    )
    default_max_ads: int = Field(1000, description="Ads returned when a request's max_ads is 0.")
    max_ads_limit: int = Field(10_000, description="Largest max_ads a request may ask for.")
    max_history_events: int = Field(
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
    scoring: Scoring = Field(
        "masked",
        description="How each decode step scores a token (contracts/request.py Scoring): "
        "'masked' adds its log-softmax over the tokens the CD+GTM mask allows (renormalised: "
        "a prefix with few eligible children keeps most of its mass); 'unmasked' the "
        "model's own log-softmax over the whole vocabulary, barred tokens still excluded, "
        "so a SID scores its model log-probability in either filter mode.",
    )
    index_poll_seconds: float = Field(
        1.0,
        description="How often the rollout reads <index_root>/CURRENT and the model "
        "repository's CURRENT, in seconds.",
    )
    rollout_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="The most of the wall time a swap takes while the server serves: a "
        "model's load (each checksum chunk, each chunk of a tensor's copy to the device) and "
        "every swap's prepare (each CUDA graph's capture), their GPU work included; after "
        "each step the rollout rests so that requests keep the GPU, cores and GIL "
        "(service/pace.py). An index's load is not paced (its tables go to the GPU in "
        "chunks). 1 turns pacing off; start-up is never paced.",
    )
    max_connection_age_seconds: float = Field(
        120.0,
        description="Close client connections after this age (with a GOAWAY) so that "
        "clients re-resolve and rebalance across replicas — HTTP/2 otherwise pins them; "
        "0 turns it off.",
    )
    max_connection_age_grace_seconds: float = Field(
        30.0, description="Time calls on an aged connection get to finish, in seconds."
    )
    drain_seconds: float = Field(
        10.0, description="Grace period for in-flight requests on SIGTERM, in seconds."
    )
    stall_seconds: float = Field(
        60.0,
        description="A pipeline with batches in flight and no stage finished for this "
        "long is wedged (a stuck GPU call, a deadlock): the process writes every thread's "
        "stack to stderr and exits 3, so its supervisor or the orchestrator restarts it "
        "(service/watchdog.py). 0 turns the watchdog off.",
    )
    request_log: Path | None = Field(
        None,
        description="Append every valid Retrieve request to this file as one line of "
        "protobuf JSON (the JSON Lines that `grace record` writes and loadtest/ replays); "
        "off when unset. Written by its own thread: when it falls behind, requests are "
        "dropped from the log (counted), never slowed (service/request_log.py).",
    )
    request_log_max_mb: float = Field(
        256.0,
        description="Rotate the request log when it reaches this many MiB: the file becomes "
        "<file>.1 (older ones <file>.2, <file>.3; the oldest is removed). 0: never rotate.",
    )
    tracing: Literal["off", "console", "otlp"] = Field(
        "off",
        description="OpenTelemetry spans per Retrieve RPC, per batch and per pipeline stage "
        "(service/tracing.py): 'console' writes them to stderr, 'otlp' exports them over "
        "OTLP/gRPC (the `otlp` extra; endpoint from OTEL_EXPORTER_OTLP_ENDPOINT, default "
        "localhost:4317). A caller's W3C traceparent metadata makes them part of its trace.",
    )
    tracing_sample_ratio: float = Field(
        1.0,
        description="The share of new traces kept (0..1) when tracing is on; a trace the "
        "caller started follows the caller's sampling decision.",
    )

    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines: 'text' (one readable line each) or 'json' (one JSON object "
        "per line: ts, level, logger, message, worker, request_id, exc, and the access "
        "log's fields — service/logs.py). Env: GRACE_LOG_FORMAT; grace serve --log-format.",
    )
    access_log_sample: float = Field(
        0.0,
        description="Share of OK Retrieve calls that get an access-log line (logger "
        "grace.access: request id, code, latency, batch size, versions, ads, peer); every "
        "failed call gets one while this is above 0. 0 (the default): no access log — a "
        "line is ~250 bytes and ~10 us of the event loop, so at 1,000 req/s one worker "
        "would write ~20 GB a day of what the metrics already count (docs/SERVICE.md).",
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
        return init_settings, env_settings, _file_source(settings_cls, Path(path))

    @field_validator("port", "metrics_port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"must be a TCP port in 0..65535 (0 = any free port), got {v}")
        return v

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

    @field_validator(
        "max_batch",
        "queue_capacity",
        "max_decode_groups",
        "default_max_ads",
        "max_ads_limit",
        "busy_batches",
    )
    @classmethod
    def _at_least_one(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

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

    @field_validator("max_history_events")
    @classmethod
    def _non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator(
        "max_wait_ms",
        "max_wait_busy_ms",
        "drain_seconds",
        "stall_seconds",
        "request_log_max_mb",
        "max_connection_age_seconds",
        "max_connection_age_grace_seconds",
    )
    @classmethod
    def _non_negative_time(cls, v: float) -> float:
        if not v >= 0:  # also refuses NaN
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator("tracing_sample_ratio")
    @classmethod
    def _ratio(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @field_validator("access_log_sample")
    @classmethod
    def _share(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:  # also refuses NaN
            raise ValueError(f"must be a share in 0..1, got {v}")
        return v

    @field_validator("index_poll_seconds")
    @classmethod
    def _positive_time(cls, v: float) -> float:
        if not 0 < v < float("inf"):
            raise ValueError(f"must be a positive number of seconds, got {v}")
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
            _check_schedule(v)
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
        if self.default_max_ads > self.max_ads_limit:
            raise ValueError(
                f"default_max_ads ({self.default_max_ads}) exceeds max_ads_limit "
                f"({self.max_ads_limit})"
            )
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
        return self

    def resolve_busy_batches(self, device: str) -> int:
        """The batcher's busy threshold on `device`: `busy_batches`, or the device's default."""
        return default_busy_batches(device) if self.busy_batches is None else self.busy_batches

    def resolve_device(self) -> str:
        """The torch device to run on: `device`, with 'auto' resolved."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _check_schedule(beams: tuple[int, ...]) -> None:
    check_schedule(tuple(beams), SID_LENGTH, VOCAB_SIZE)


def _file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    source = _FILE_SOURCES.get(path.suffix.lower())
    if source is None:
        raise ValueError(f"config file {path}: unknown type; use one of {sorted(_FILE_SOURCES)}")
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    return source(settings_cls, path)


def load_settings(
    overrides: Mapping[str, Any] | None = None, *, config_file: Path | str | None = None
) -> ServerSettings:
    """Settings from CLI overrides > environment > config file > defaults.

    `overrides` maps field names to values; None values (flags not given) are dropped.
    `config_file` is the same as an override `config` (so it wins over GRACE_CONFIG).
    Raises pydantic.ValidationError (a ValueError) naming each bad field.
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if config_file is not None:
        given.setdefault("config", Path(config_file))
    return ServerSettings(**given)
