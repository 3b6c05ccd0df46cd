"""tools/torch_memory.py: PyTorch's savers measured in real steps, each figure from a run."""
import sys

import pytest

from conftest import ROOT

pytest.importorskip("torch", reason="PyTorch (sncaffe[torch]) is not installed")
sys.path.insert(0, str(ROOT / "tools"))
import torch_memory  # noqa: E402

SMALL = dict(blocks=(1, 1, 1, 1), batch=2, image_size=32)


def test_every_saver_runs_the_same_steps_and_says_where_its_bytes_are():
    runs = {v: torch_memory.measure(variant=v, **SMALL) for v in torch_memory.VARIANTS}
    eager = runs["eager"]["losses"]
    for v, r in runs.items():             # the same math in every variant, both steps (save_on_cpu's
        assert r["losses"] == pytest.approx(eager, rel=1e-4), v     # contiguous copies round apart)
    params = 3 * sum(p.numel() * 4 for p in torch_memory_model_params())   # weights, grads, momentum
    for v, r in runs.items():
        assert r["device"] > params, v                       # the second step holds the momentum too
        assert (r["host"] > 0) == (v == "save_on_cpu"), v    # only that saver puts bytes on the host
        assert r["rss"] >= r["rss_before_step"] > 0
        assert r["malloc"] == "glibc default" or "MALLOC_" in r["malloc"]


def torch_memory_model_params():
    import torch_idiomatic
    return list(torch_idiomatic.resnet(SMALL["blocks"]).parameters())


def test_a_child_process_measures_and_a_failed_step_does_not_fit():
    r = torch_memory.measure_in_child(SMALL["blocks"], SMALL["batch"], SMALL["image_size"], "checkpoint_sequential")
    assert r["segments"] == torch_memory.best_segments(1 + sum(SMALL["blocks"]) + 1)
    assert 0 < r["device"] < r["rss"]
    # a child that dies (here: a variant it does not know; on a real run, the OOM killer) does not fit
    bad = torch_memory.measure_in_child(SMALL["blocks"], SMALL["batch"], SMALL["image_size"], "no-such-saver")
    assert "failed" in bad and bad["rss"] == float("inf")
