"""The exported PyTorch module in train mode is Caffe's TRAIN phase: the same outputs, the same
weight gradients (within 1e-4) and the same BatchNorm sums and moving-average factor after a
forward, on LeNet, the CIFAR ResNet and ResNet-50."""
import numpy as np
import pytest

from conftest import ROOT

torch = pytest.importorskip("torch")

from sncaffe.export import check, deploy, pytorch as to_torch  # noqa: E402

NETS = [("lenet_train_test.prototxt", (2, 1, 28, 28)), ("cifar10_resnet.prototxt", (2, 3, 32, 32)),
        ("resnet50.prototxt", (1, 3, 224, 224))]       # its 7x7 pool5 needs the full input


@pytest.mark.parametrize("name, shape", NETS, ids=[n for n, _ in NETS])
def test_train_mode_gradients_match_sncaffe(name, shape):
    net = deploy.load(ROOT / "prototxt" / name, "TRAIN", shapes={"data": shape}, batch=shape[0],
                      force_backward=True)
    src = to_torch.source(net)
    module = src.module().train()
    inputs = check.random_inputs(net, seed=1)
    rng = np.random.default_rng(2)
    grads = {o: rng.standard_normal(net.blobs[o].data.shape).astype(np.float32) for o in net.outputs}

    want = check.reference(net, inputs)
    for o, g in grads.items():
        net.blobs[o].diff[...] = g
    net.backward()

    ys = module(*(torch.from_numpy(inputs[n]) for n in net.inputs))
    ys = ys if isinstance(ys, tuple) else (ys,)
    for o, y in zip(net.outputs, ys):
        assert check.relative(want[o], y.detach().numpy()) <= 1e-4, o
    sum((y * torch.from_numpy(grads[o])).sum() for o, y in zip(net.outputs, ys)).backward()

    state = dict(module.named_parameters()) | dict(module.named_buffers())
    compared = 0
    for layer, keys in src.blob_keys.items():
        for blob, key in zip(net.params.get(layer, []), keys):
            t = state[key]
            if t.requires_grad:         # a weight: its gradient
                ours = t.grad.numpy().reshape(blob.diff.shape)
                assert check.relative(blob.diff, ours) <= 1e-4, key
            else:                       # BatchNorm's sums and factor, after one forward
                assert check.relative(blob.data, t.numpy().reshape(blob.data.shape)) <= 1e-4, key
            compared += 1
    assert compared == sum(len(b) for b in net.params.values())
