"""tools/torch_memory.py: PyTorch's savers measured in real steps, each figure from a run."""
import sys

import pytest

from conftest import ROOT

pytest.importorskip("torch", reason="PyTorch (sncaffe[torch]) is not installed")
sys.path.insert(0, str(ROOT / "tools"))
import torch_memory  # noqa: E402

SMALL = dict(blocks=(1, 1, 1, 1), batch=2, image_size=32)


def test_every_saver_runs_the_same_step_and_says_where_its_bytes_are():
    runs = {v: torch_memory.measure(variant=v, **SMALL) for v in torch_memory.VARIANTS}
    losses = {round(r["loss"], 5) for r in runs.values()}
    assert len(losses) == 1                                   # the same math in every variant
    params = 3 * sum(p.numel() * 4 for p in torch_memory_model_params())   # weights, grads, momentum
    for v, r in runs.items():
        assert r["device"] > params, v                       # at least what lives for the whole step
        assert (r["host"] > 0) == ("save_on_cpu" in v), v    # only the savers put bytes on the host
        assert r["rss"] >= r["rss_before_step"] > 0


def torch_memory_model_params():
    import torch_idiomatic
    return list(torch_idiomatic.resnet(SMALL["blocks"]).parameters())


def test_a_child_process_measures_and_a_failed_step_does_not_fit():
    r = torch_memory.measure_in_child(SMALL["blocks"], SMALL["batch"], SMALL["image_size"], "checkpoint")
    assert r["segments"] == torch_memory.best_segments(1 + sum(SMALL["blocks"]) + 1)
    assert 0 < r["device"] < r["rss"]
    # a child that dies (here: a variant it does not know; on a real run, the OOM killer) does not fit
    bad = torch_memory.measure_in_child(SMALL["blocks"], SMALL["batch"], SMALL["image_size"], "no-such-saver")
    assert "failed" in bad and bad["rss"] == float("inf")
