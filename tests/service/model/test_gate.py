"""The model gate (service/model/gate.py) as the warm-up runs it: a model whose weights hold
NaN, or whose finite weights score every beam NaN or -inf, is refused before it serves;
a model that answers passes, with the canary's figures — on the CPU, and on a GPU through
the captured graphs in bf16 and FP8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.request import FilterMode
from contracts.targeting import Targeting
from service.index.loaded import LoadedIndex
from service.model.features import VIEW, UserFeatures
from service.model.gate import ModelRefused, canary, check_finite
from service.model.precision import for_serving
from service.model.retriever import GenerativeRetriever
from service.pipeline.stages import Stages
from tests.service.pipeline.test_pipeline import BEAMS, CONFIG, world

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]


def model(kind: str, seed: int = 0) -> GenerativeRetriever:
    """A tiny model: untrained ("good"), every weight NaN ("nan", a diverged run), or
    finite with head weights so large that every logit overflows ("overflow")."""
    torch.manual_seed(seed)
    m = GenerativeRetriever(CONFIG).eval()
    with torch.no_grad():
        if kind == "nan":
            for p in m.parameters():
                p.fill_(float("nan"))
        elif kind == "overflow":
            m.decoder.head.weight.fill_(3e38)
    return m


def test_check_finite_names_the_tensors_holding_nan_or_inf() -> None:
    m = model("good")
    check_finite(m.state_dict(), "good")
    with torch.no_grad():
        m.decoder.head.bias[3] = float("inf")
        m.encoder.state_dict()[next(iter(m.encoder.state_dict()))].view(-1)[0] = float("nan")
    with pytest.raises(ModelRefused, match=r"m: weights not finite: 2 of \d+ tensors .*decoder"):
        check_finite(m.state_dict(), "m")
    ints = {"ids": torch.arange(4), "w": torch.ones(3)}  # integer tensors are not weights
    check_finite(ints, "ints")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["auto", "fp8"])
def test_the_warm_up_refuses_a_model_that_answers_nothing(device: str, precision: str) -> None:
    if precision == "fp8" and (device == "cpu" or torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("FP8 serves on a GPU of compute capability 8.9 or more")
    _, cpu_index = world(0)
    index = LoadedIndex.from_arrays(cpu_index.arrays, version="v0", device=device)
    stages = Stages(device, max_batch=4)
    runtimes = {}
    for kind in ("good", "nan", "overflow"):
        m = for_serving(model(kind).to(device), precision, device)  # type: ignore[arg-type]
        runtimes[kind] = stages.runtime(m, version=kind)
    runtimes["good"].prepare(index, BEAMS)  # passes
    with pytest.raises(ModelRefused, match="model nan: weights not finite"):
        runtimes["nan"].prepare(index, BEAMS)
    with pytest.raises(ModelRefused, match="model overflow: a canary of 4 requests on index "
                       "v0 yielded no SIDs"):  # fmt: skip
        runtimes["overflow"].prepare(index, BEAMS)


def test_the_canary_measures_sids_and_ads_per_request() -> None:
    """Seven requests (two batches of the largest bucket, 4) with US targeting: the good
    model brings SIDs and ads to each; the overflowing one nothing, every answer empty."""
    ads, index = world(0)
    history = np.array([a.ad_id for a in ads[:5]], np.int64)
    users = [UserFeatures(i, Targeting(country="US"), history, np.full(5, VIEW),
                          np.arange(5, dtype=np.int64)) for i in range(7)]  # fmt: skip
    stages = Stages("cpu", max_batch=4)
    good = canary(stages.runtime(model("good"), version="good"), index, users, BEAMS)
    assert good.index_version == index.version and good.requests == 7
    assert good.sids_per_request == BEAMS[-1] and 0 < good.ads_per_request <= 100
    assert good.empty_share == 0
    silent = canary(stages.runtime(model("overflow"), version="o"), index, users, BEAMS,
                    FilterMode.CD_ONLY)  # fmt: skip
    assert (silent.sids_per_request, silent.ads_per_request, silent.empty_share) == (0, 0, 1)
