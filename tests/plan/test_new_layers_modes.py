"""The remaining BVLC layer types in every memory mode: a small net holding them trains to the same bits as
mode ``none``, and the measured pool peak equals the plan, iteration by iteration."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import MODES
from sncaffe.prototxt import parse_text
from sncaffe.proto import sncaffe_pb2 as pb

NET = """
name: "issue14"
layer { name: "input" type: "Input" top: "data" top: "ref" top: "label" top: "word" top: "order" top: "sel" top: "H"
  input_param { shape { dim: 2 dim: 3 dim: 7 dim: 9 } shape { dim: 2 dim: 4 dim: 5 dim: 6 } shape { dim: 2 }
                shape { dim: 2 } shape { dim: 2 } shape { dim: 2 } shape { dim: 4 dim: 4 } } }
layer { name: "label_filter" type: "Filter" bottom: "label" bottom: "sel" top: "kept_label" }
layer { name: "thr" type: "Threshold" bottom: "data" top: "thr" threshold_param { threshold: 0.5 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bnll" type: "BNLL" bottom: "conv" top: "conv" }
layer { name: "mvn" type: "MVN" bottom: "conv" top: "mvn" }
layer { name: "swish" type: "Swish" bottom: "mvn" top: "swish" swish_param { beta: 1.5 } }
layer { name: "crop" type: "Crop" bottom: "swish" bottom: "ref" top: "crop" crop_param { offset: 1 } }
layer { name: "im2col" type: "Im2col" bottom: "crop" top: "cols" convolution_param { kernel_size: 2 } }
layer { name: "tile" type: "Tile" bottom: "cols" top: "tile" tile_param { axis: 1 tiles: 2 } }
layer { name: "spp" type: "SPP" bottom: "tile" top: "spp" spp_param { pyramid_height: 2 pool: MAX } }
layer { name: "ip" type: "InnerProduct" bottom: "spp" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "clip" type: "Clip" bottom: "ip" top: "ip" clip_param { min: -5 max: 5 } }
layer { name: "exp" type: "Exp" bottom: "ip" top: "exp" exp_param { scale: 0.5 } }
layer { name: "log" type: "Log" bottom: "exp" top: "log" log_param { shift: 1 } }
layer { name: "embed" type: "Embed" bottom: "word" top: "embed"
  embed_param { input_dim: 5 num_output: 4 weight_filler { type: "uniform" min: -1 max: 1 } } }
layer { name: "param" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 4 } } }
layer { name: "sum" type: "Eltwise" bottom: "log" bottom: "embed" bottom: "p" top: "score" }
layer { name: "reindex" type: "BatchReindex" bottom: "score" bottom: "order" top: "perm" }
layer { name: "filter" type: "Filter" bottom: "perm" bottom: "sel" top: "kept" }
layer { name: "softmax" type: "Softmax" bottom: "kept" top: "prob" }
layer { name: "mlr" type: "MultinomialLogisticLoss" bottom: "prob" bottom: "kept_label" top: "mlr" }
layer { name: "hinge" type: "HingeLoss" bottom: "kept" bottom: "kept_label" top: "hinge" hinge_loss_param { norm: L2 } }
layer { name: "infogain" type: "InfogainLoss" bottom: "score" bottom: "label" bottom: "H" top: "infogain" }
layer { name: "sumsq" type: "Reduction" bottom: "score" top: "sumsq" reduction_param { operation: SUMSQ axis: 1 }
  loss_weight: 0.01 }
layer { name: "contrastive" type: "ContrastiveLoss" bottom: "log" bottom: "embed" bottom: "label" top: "contrastive" }
"""


SELECT = [(1, 0), (2.5, -1), (0, 1)]      # Filter keeps 1, then 2, then 1 item(s)


def feed(net, rng, it):
    values = {"word": rng.integers(0, 5, 2), "order": rng.permutation(2), "sel": SELECT[it % len(SELECT)],
              "label": rng.integers(0, 4, 2), "H": np.eye(4) + rng.random((4, 4))}
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = values[name] if name in values else rng.standard_normal(blob.shape)


def train(mode, iters=3):
    device = CPUDevice("256MiB")
    net = Net(parse_text(NET, pb.NetParameter()), "TRAIN", device=device, memory=mode, seed=1)
    rng = np.random.default_rng(0)
    net.params["param"][0].data[...] = rng.standard_normal((2, 4))
    steps = []
    for it in range(iters):
        feed(net, rng, it)
        net.clear_param_diffs()
        device.pool.reset_peak()
        kept = []       # Filter's top right after its forward (later modes may free or drop it)
        net.step_hook = lambda op, _: kept.append(net.blobs["kept"].data.copy()) if op.name == "filter:forward" else 0
        loss = net.forward()
        net.backward()
        kept = kept[0]
        state = {"loss": np.float64(loss), "thr": net.blobs["thr"].data.copy(), "kept": kept}
        for name, blobs in net.params.items():
            for i, b in enumerate(blobs):
                state[f"{name}[{i}]"], state[f"{name}[{i}].diff"] = b.data.copy(), b.diff.copy()
        steps.append((device.pool.peak, state))
        for blobs in net.params.values():
            for b in blobs:
                b.data -= np.float32(0.01) * b.diff
    return net.plan, steps


@pytest.fixture(scope="module")
def reference():
    return train("none")


@pytest.mark.parametrize("mode", MODES)
def test_new_layers_every_mode(mode, reference):
    plan, steps = train(mode)
    assert [peak for peak, _ in steps] == [plan.peak] * len(steps), "pool peak != planned peak"
    assert plan.peak <= reference[0].peak
    for it, ((_, state), (_, ref)) in enumerate(zip(steps, reference[1])):
        assert state.keys() == ref.keys()
        differ = [k for k in ref if state[k].tobytes() != ref[k].tobytes()]
        assert not differ, f"iteration {it}: differs from mode none in {differ}"
    assert all(np.any(s["conv[0].diff"]) and np.any(s["param[0].diff"]) for _, s in steps)
    # Filter kept 1 or 2 items, changing between iterations (Caffe's reshape at every forward)
    assert {len(s["kept"]) for _, s in steps} == {1, 2}


@pytest.mark.parametrize("mode", ["recompute", "all"])
def test_new_layers_recomputed(mode, reference, monkeypatch):
    """With recomputation forced (on this small net the cost-aware planner may drop it), the cheap
    new layers are replayed in backward, and the run still matches mode none bit for bit."""
    import functools
    from sncaffe.plan import planner
    monkeypatch.setattr(planner, "make_plan", functools.partial(planner.make_plan, cost_aware=False))
    plan, steps = train(mode)
    replayed = {ins.op.node.type for ins in plan.schedule if ins.kind == "run" and ins.recompute}
    assert {"BNLL", "Clip", "Exp", "Log"} <= replayed, replayed
    assert [peak for peak, _ in steps] == [plan.peak] * len(steps), "pool peak != planned peak"
    for (_, state), (_, ref) in zip(steps, reference[1]):
        assert not [k for k in ref if state[k].tobytes() != ref[k].tobytes()]


def test_layer_classes_carry_their_knowledge():
    """What the memory runtime asks of a layer lives on its class: cheap to recompute, FLOPs."""
    from sncaffe.graph import build_graph
    from sncaffe.plan.planner import layer_flops
    from sncaffe.plan.recompute import is_cheap
    graph = build_graph(parse_text(NET, pb.NetParameter()), pb.TRAIN)
    mvn, bnll, spp = graph.layer("mvn"), graph.layer("bnll"), graph.layer("spp")
    assert layer_flops(mvn) == 6 * int(np.prod(mvn.tops[0].shape))
    assert layer_flops(bnll) == 4 * int(np.prod(bnll.tops[0].shape))
    assert is_cheap(bnll) and is_cheap(graph.layer("crop")) and not is_cheap(spp)
