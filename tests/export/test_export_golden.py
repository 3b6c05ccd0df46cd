"""Exports against real Caffe: every golden case (one layer, or a small net, dumped by BVLC Caffe
in its TRAIN phase; ../shared/golden) exports to a PyTorch module whose train-mode outputs and
weight gradients match Caffe's dump within 1e-4, and to ONNX whose outputs do, where the case's
TRAIN phase has a TEST-phase equivalent. A case whose deploy part holds a type without a mapping
must be refused by that type's name."""
import h5py
import numpy as np
import pytest

from conftest import SHARED

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from sncaffe.export import ExportError, check, deploy, onnx as to_onnx, pytorch as to_torch  # noqa: E402

FOLDERS = ("layers", "coverage", "nets", "coverage-nets")
CASES = [(f, c.name) for f in FOLDERS for c in sorted((SHARED / "golden" / f).iterdir())
         if (c / "net.prototxt").is_file()] if SHARED else []


def key(blob):
    return blob.replace("/", "|")       # the dumps' spelling


@pytest.mark.skipif(not CASES, reason="../shared (golden Caffe data) is not present")
@pytest.mark.parametrize("folder, case", CASES, ids=[f"{f}/{c}" for f, c in CASES])
def test_export_matches_caffe(folder, case, tmp_path, monkeypatch):
    d = SHARED / "golden" / folder / case
    monkeypatch.chdir(tmp_path)         # a layer writing files (HDF5Output) writes them here
    try:
        net = deploy.load(d / "net.prototxt", "TRAIN", weights=d / "weights.caffemodel")
    except ExportError as e:
        pytest.skip(f"no deploy part: {e}")
    kept = [n for n in net.graph.layers if n.type != "Input"]
    if not kept:        # only losses or accuracy: the deploy rule dropped every layer but the inputs
        from sncaffe.proto import sncaffe_pb2 as pb
        from sncaffe.prototxt import read_text
        layers = read_text(d / "net.prototxt", pb.NetParameter()).layer
        assert all(lp.type == "Input" or lp.type in deploy.DATA_LAYERS or deploy.dropped(lp.type) for lp in layers)
        return
    unmapped = sorted({n.type for n in kept} - set(to_torch.MAPS))
    if unmapped:
        for exporter in (to_torch, to_onnx):
            with pytest.raises(ExportError, match=f'type "({"|".join(unmapped)})" has no'):
                exporter.export(net, None, rtol=1e-4)
        return
    with h5py.File(d / "input.h5") as inp, h5py.File(d / "expected.h5") as exp:
        inputs = {n: inp["inputs"][key(n)][()].astype(np.float32) for n in net.inputs}
        want = {o: exp["blobs"][key(o)]["data"][()] for o in net.outputs}
        try:
            model, names = to_onnx.build(net)
        except ExportError as e:        # no TEST-phase equivalent, or a setting without a mapping
            assert str(e).startswith('layer "')
        else:
            got = to_onnx.runner(model, names)(inputs)
            for o in net.outputs:
                assert check.relative(want[o], got[o]) <= 1e-4, f"ONNX {o}"
        try:
            src = to_torch.source(net)
        except ExportError as e:
            assert str(e).startswith('layer "')
            return
        module = src.module().train()
        ys = module(*(torch.from_numpy(inputs[n]) for n in net.inputs))
        ys = ys if isinstance(ys, tuple) else (ys,)
        for o, y in zip(net.outputs, ys):
            assert check.relative(want[o], y.detach().numpy()) <= 1e-4, f"PyTorch {o}"
        state = dict(module.named_parameters()) | dict(module.named_buffers())
        stored = {k: exp["params"][key(layer)][str(i)] for layer, keys in src.blob_keys.items()
                  for i, k in enumerate(keys)}
        for k, blob in stored.items():
            if not isinstance(state[k], torch.nn.Parameter):        # BatchNorm's sums after Caffe's forward
                assert check.relative(blob["data"][()], state[k].numpy().reshape(blob["data"].shape)) <= 1e-4, k
        writers = [t.name for n in net.graph.layers for t in n.tops]
        # an output rewritten in place holds, in the dump, the diff of its first writer's top
        if not any(y.requires_grad for y in ys) or any(writers.count(o) > 1 for o in net.outputs):
            return
        sum((y * torch.from_numpy(exp["blobs"][key(o)]["diff"][()])).sum()
            for o, y in zip(net.outputs, ys) if y.requires_grad).backward()
        for k, blob in stored.items():
            t = state[k]
            if t.requires_grad:
                ours = (t.grad.T if k in src.transposed else t.grad).numpy().reshape(blob["diff"].shape)
                assert check.relative(blob["diff"][()], ours) <= 1e-4, f"{k} gradient"
            elif isinstance(t, torch.nn.Parameter):         # frozen (lr_mult 0)
                assert not np.any(blob["diff"][()]), f"{k} has a gradient in Caffe"
