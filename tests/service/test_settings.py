"""Server settings: precedence CLI > environment > config file > defaults, and validators."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from service.model.config import PROFILES
from service.model.precision import weights_dtype
from service.settings import ServerSettings, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("GRACE_"):
            monkeypatch.delenv(key)


def _write(path: Path, fmt: str, values: dict) -> Path:
    if fmt == "toml":
        lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        path.write_text("\n".join(lines) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps(values))
    else:
        path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


def test_defaults() -> None:
    s = load_settings()
    assert (s.port, s.metrics_port, s.profile, s.device) == (50051, 9464, "tiny", "auto")
    assert (s.max_batch, s.max_ads_limit, s.default_max_ads) == (16, 10_000, 1000)
    assert s.index_root == Path("data") / "index"
    assert s.model_dir == Path("data") / "model"
    assert s.beam_max == s.beams == PROFILES["tiny"].beams


def test_every_field_is_documented() -> None:
    undocumented = [n for n, f in ServerSettings.model_fields.items() if not f.description]
    assert not undocumented


@pytest.mark.parametrize("fmt", ["toml", "json", "yaml"])
def test_precedence_cli_over_env_over_file_over_default(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _write(
        tmp_path / f"grace.{fmt}", fmt, {"port": 1001, "metrics_port": 1002, "max_batch": 3}
    )
    monkeypatch.setenv("GRACE_CONFIG", str(cfg))
    monkeypatch.setenv("GRACE_PORT", "2001")
    monkeypatch.setenv("GRACE_METRICS_PORT", "2002")
    s = load_settings({"port": 3001, "metrics_port": None})  # None = flag not given
    assert s.port == 3001  # CLI
    assert s.metrics_port == 2002  # env beats file
    assert s.max_batch == 3  # file beats default
    assert s.max_wait_ms == 5.0  # default


def test_explicit_config_file_beats_grace_config(tmp_path: Path, monkeypatch) -> None:
    env_file = _write(tmp_path / "env.json", "json", {"port": 1})
    cli_file = _write(tmp_path / "cli.toml", "toml", {"port": 2})
    monkeypatch.setenv("GRACE_CONFIG", str(env_file))
    assert load_settings(config_file=cli_file).port == 2
    assert load_settings().port == 1


def test_paths_follow_data_dir_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACE_DATA_DIR", "/srv/grace")
    s = load_settings({"model_dir": "/models/m1"})
    assert s.index_root == Path("/srv/grace/index")
    assert s.model_dir == Path("/models/m1")


@pytest.mark.parametrize("raw", ["1,32,64,64", "[1, 32, 64, 64]"])
def test_beam_max_from_env(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACE_BEAM_MAX", raw)
    s = load_settings()
    assert s.beam_max == (1, 32, 64, 64)
    assert s.beams == (1, 32, 64, 64)  # profile default (1, 64, 128, 128) capped


def test_profile_sets_beam_defaults() -> None:
    s = load_settings({"profile": "demo"})
    assert s.beam_max == s.beams == PROFILES["demo"].beams


@pytest.mark.parametrize(
    ("overrides", "field", "text"),
    [
        ({"port": 65536}, "port", "0..65535"),
        ({"port": -1}, "port", "0..65535"),
        ({"metrics_port": 70000}, "metrics_port", "0..65535"),
        ({"max_batch": 0}, "max_batch", ">= 1"),
        ({"queue_capacity": 0}, "queue_capacity", ">= 1"),
        ({"max_wait_ms": -1}, "max_wait_ms", ">= 0"),
        ({"max_wait_ms": float("nan")}, "max_wait_ms", ">= 0"),
        ({"index_poll_seconds": 0}, "index_poll_seconds", "positive"),
        ({"profile": "huge"}, "profile", "unknown profile"),
        ({"device": "tpu"}, "device", "cuda:N"),
        ({"beam_max": [1, 64, 128]}, "beam_max", "4 positive widths"),
        ({"beam_max": [2, 64, 128, 128]}, "beam_max", "starting at 1"),
        ({"beam_max": [1, 1, 1, 600]}, "beam_max", "exceeds"),
        ({"beams": [1, 64, 256, 128]}, "beam_max", "exceed beam_max"),
        ({"default_max_ads": 20_000}, "max_ads_limit", "exceeds max_ads_limit"),
        ({"no_such_setting": 1}, "no_such_setting", "Extra inputs"),
    ],
)
def test_validators_name_the_field(overrides: dict, field: str, text: str) -> None:
    with pytest.raises(ValidationError) as e:
        load_settings(overrides)
    assert field in str(e.value) and text in str(e.value)


def test_bad_env_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRACE_MAX_BATCH", "many")
    with pytest.raises(ValidationError, match="max_batch"):
        load_settings()


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_settings(config_file=tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="unknown type"):
        load_settings(config_file=_write(tmp_path / "grace.ini", "json", {}))
    with pytest.raises(ValidationError, match="prot"):  # a typo in a file is an error
        load_settings(config_file=_write(tmp_path / "grace.json", "json", {"prot": 1}))


def test_device_resolution() -> None:
    assert load_settings({"device": "cpu"}).resolve_device() == "cpu"
    assert load_settings({"device": "cuda:1"}).resolve_device() == "cuda:1"
    assert load_settings().resolve_device() in ("cpu", "cuda")


def test_connection_ageing_becomes_grpc_options_and_zero_turns_it_off() -> None:
    from service.grpc_server import server_options

    opts = dict(server_options(load_settings({"max_connection_age_seconds": 90})))
    assert opts["grpc.max_connection_age_ms"] == 90_000
    assert opts["grpc.max_connection_age_grace_ms"] == 30_000  # the default grace
    ageless = dict(server_options(load_settings({"max_connection_age_seconds": 0}), 1000))
    assert not any(k.startswith("grpc.max_connection_age") for k in ageless)
    assert ageless["grpc.max_receive_message_length"] == 2000  # the transport's backstop
    assert ageless["grpc.max_concurrent_streams"] == 256  # rapid-reset pushback
    with pytest.raises(ValueError, match="max_connection_age_seconds"):
        load_settings({"max_connection_age_seconds": -1})


def test_the_connection_cap_keeps_a_reserve_of_open_files_and_zero_turns_it_off() -> None:
    import resource

    from service.grpc_server import FD_RESERVE, server_options

    cap = "grpc.max_allowed_incoming_connections"
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:  # default: what the open-files limit leaves
        assert dict(server_options(load_settings()))[cap] == max(soft - FD_RESERVE, soft // 2)
    assert dict(server_options(load_settings({"max_connections": 300})))[cap] == 300
    assert cap not in dict(server_options(load_settings({"max_connections": 0})))
    with pytest.raises(ValueError, match="max_connections"):
        load_settings({"max_connections": -1})


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu() -> None:
    s = load_settings({})
    assert s.dtype == "auto"
    assert weights_dtype(s.dtype, "cuda") == weights_dtype(s.dtype, "cuda:1") == torch.bfloat16
    assert weights_dtype(s.dtype, "cpu") == torch.float32
    assert weights_dtype(load_settings({"dtype": "float32"}).dtype, "cuda") == torch.float32
    fp8 = load_settings({"dtype": "fp8"}).dtype  # its weights are kept as 'auto' keeps them
    assert (weights_dtype(fp8, "cuda"), weights_dtype(fp8, "cpu")) == (
        torch.bfloat16,
        torch.float32,
    )
    with pytest.raises(ValueError, match="dtype"):
        load_settings({"dtype": "float64"})


def test_graph_buckets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: the built-in buckets (None); "4,8,16" or JSON from the environment; sizes
    that are not increasing are refused at start-up, not at the first capture."""
    assert load_settings().graph_buckets is None
    for raw, want in (("4,8,16", [4, 8, 16]), ("[4, 8, 16]", [4, 8, 16]), ("8", [8])):
        monkeypatch.setenv("GRACE_GRAPH_BUCKETS", raw)
        assert load_settings().graph_buckets == want
    for raw in ("8,4", "0,8", "4,4", ""):
        monkeypatch.setenv("GRACE_GRAPH_BUCKETS", raw)
        with pytest.raises(ValidationError, match="graph_buckets"):
            load_settings()


def test_busy_batches_by_device_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    default = load_settings()
    assert default.resolve_busy_batches("cuda:0") == 1  # GPU: fill while anything computes
    assert default.resolve_busy_batches("cpu") == 2  # CPU: keep two batches in flight
    monkeypatch.setenv("GRACE_BUSY_BATCHES", "1")
    assert load_settings().resolve_busy_batches("cpu") == 1
    monkeypatch.setenv("GRACE_BUSY_BATCHES", "0")
    with pytest.raises(ValidationError, match="busy_batches"):
        load_settings()


def test_scoring_validates_and_reaches_the_decode_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scoring`: "masked" by default, "unmasked" from a flag, the environment or a file,
    anything else refused; the server hands it to its Stages (service/app.py), which give
    it to every model runtime's DecodeEngine."""
    import service.app
    from service.model.retriever import GenerativeRetriever
    from service.pipeline.stages import Stages

    assert load_settings().scoring == "masked"
    assert load_settings({"scoring": "unmasked"}).scoring == "unmasked"
    cfg = _write(tmp_path / "grace.toml", "toml", {"scoring": "unmasked"})
    assert load_settings(config_file=cfg).scoring == "unmasked"
    monkeypatch.setenv("GRACE_SCORING", "unmasked")
    assert load_settings().scoring == "unmasked"
    with pytest.raises(ValidationError, match="scoring"):
        load_settings({"scoring": "renormalised"})

    made: list[Stages] = []

    class Recorded(Stages):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
            raise RuntimeError("stop after the stages")  # nothing past them is loaded

    monkeypatch.setattr(service.app, "Stages", Recorded)
    with pytest.raises(RuntimeError, match="stop after the stages"):
        asyncio.run(service.app.start(load_settings({"device": "cpu", "port": 0})))
    assert [s.scoring for s in made] == ["unmasked"]  # GRACE_SCORING, above
    runtime = made[0].runtime(GenerativeRetriever(PROFILES["tiny"]), version="m")
    assert runtime.engine.scoring == "unmasked"
    assert (
        Stages("cpu").runtime(GenerativeRetriever(PROFILES["tiny"]), version="m").engine.scoring
        == "masked"
    )
