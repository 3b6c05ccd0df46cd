"""tools/torch_idiomatic.py: the PyTorch-as-written baselines compute what the Caffe files compute.

With the same weights (copied from an sncaffe Net), each idiomatic module's logits equal the
Net's and the Caffe-style twin's (tools/torch_net.py) in training mode, and its BatchNorm
running statistics move as Caffe's do."""
import sys

import numpy as np
import pytest

from conftest import ROOT

torch = pytest.importorskip("torch", reason="PyTorch (sncaffe[torch]) is not installed")
sys.path.insert(0, str(ROOT / "tools"))
import torch_idiomatic  # noqa: E402
from torch_net import TorchNet  # noqa: E402

from sncaffe import Net  # noqa: E402
from sncaffe.backend.cpu import CPUDevice  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import read_text, replace_data_layers, set_batch  # noqa: E402


def net_of(file, batch, size, channels=3, dtype=np.float64):
    param = read_text(ROOT / "prototxt" / file, pb.NetParameter())
    if any(lp.type == "Data" for lp in param.layer):
        param = replace_data_layers(param, {"data": (batch, channels, size, size), "label": (batch,)})
    param = set_batch(param, batch)
    dims = param.layer[0].input_param.shape[0].dim
    dims[2] = dims[3] = size
    for lp in param.layer:            # ResNet-50's 7x7 average pool is global at 224x224
        if lp.type == "Pooling" and lp.pooling_param.pool == pb.PoolingParameter.AVE:
            lp.pooling_param.ClearField("kernel_size")
            lp.pooling_param.global_pooling = True
    return Net(param, "TRAIN", seed=0, dtype=dtype, device=CPUDevice(), memory="none")


CASES = {
    # file, batch, image size, channels, model, logits blob
    "resnet50": ("resnet50.prototxt", 2, 64, 3, lambda: torch_idiomatic.resnet((3, 4, 6, 3)), "fc1000"),
    "cifar10_resnet": ("cifar10_resnet.prototxt", 2, 32, 3, lambda: torch_idiomatic.CifarResNet(3), "fc10"),
    "lenet": ("lenet_train_test.prototxt", 4, 28, 1, torch_idiomatic.LeNet, "ip2"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_idiomatic_forward_equals_sncaffe_and_the_caffe_style_twin(name):
    file, batch, size, channels, make, logits = CASES[name]
    net = net_of(file, batch, size, channels)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, channels, size, size))
    y = rng.integers(0, net.blobs[logits].data.shape[1], batch)
    net.blobs["data"].data[...] = x
    net.blobs["label"].data[...] = y
    net.forward()
    expected = np.array(net.blobs[logits].data)
    model = make().double().train().load_caffe(net)
    got = model(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-7, atol=1e-9)
    twin = TorchNet(net_of(file, batch, size, channels))
    twin_out = twin({"data": torch.tensor(x), "label": torch.tensor(y)}, all_blobs=True)
    np.testing.assert_allclose(got, twin_out[logits].detach().numpy(), rtol=1e-7, atol=1e-9)


def test_idiomatic_resnet_is_the_lighter_pytorch():
    """What the idiomatic form is for: fewer tensors saved for backward than the twin's."""
    from torch.autograd.graph import saved_tensors_hooks
    net = net_of("cifar10_resnet.prototxt", 2, 32)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 10, (2,))

    def saved_bytes(run):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(seen.values())
    idiomatic = torch_idiomatic.CifarResNet(3).double().load_caffe(net)
    twin = TorchNet(net)
    light = saved_bytes(lambda: torch_idiomatic.step(idiomatic, x, y))
    heavy = saved_bytes(lambda: twin({"data": x, "label": y.double()}).loss.backward())
    assert 0 < light < heavy
