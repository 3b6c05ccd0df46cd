"""Google's Deep Dream notebook on BVLC GoogLeNet: its make_step and deepdream, in Python 3.

The notebook reshapes the input blob to each octave's image size and runs ``forward(end=...)``
and ``backward(start=...)`` to an inception layer only. At sizes other than 224 x 224 the layers
after that end (pool5's 7x7 kernel, the classifier's 1024 inputs) do not fit the new size;
Caffe reshapes only the layers a forward runs, so they are never set up for it.
"""
import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import read_text
from conftest import SHARED, needs_shared

END = "inception_4c/output"
MEAN = np.float32([104.0, 116.0, 122.0])


def googlenet_deploy(path):
    """BVLC GoogLeNet's deploy net from its train_val, as the model zoo's deploy.prototxt has it: an
    Input of one 224 x 224 image, no auxiliary classifiers, losses or accuracies, a Softmax "prob";
    and ``force_backward``, which the notebook sets to get the image's gradient."""
    train_val = read_text(SHARED / "zoo/bvlc/bvlc_googlenet__train_val.prototxt", pb.NetParameter())
    net = pb.NetParameter(name=train_val.name, force_backward=True)
    net.layer.add(name="data", type="Input", top=["data"]).input_param.shape.add().dim.extend([1, 3, 224, 224])
    for lp in train_val.layer:
        if lp.type in ("Data", "SoftmaxWithLoss", "Accuracy") or lp.name.startswith(("loss1/", "loss2/")):
            continue
        net.layer.add().CopyFrom(lp)
    net.layer.add(name="prob", type="Softmax", bottom=["loss3/classifier"], top=["prob"])
    path.write_text(str(net))
    return path


def zoom(img, factors):
    """scipy.ndimage.zoom(img, factors, order=1) where scipy is installed; else bilinear
    resampling of the last two axes with the same grid (corners kept)."""
    try:
        from scipy import ndimage
        return ndimage.zoom(img, factors, order=1)
    except ImportError:
        pass
    c, h, w = img.shape
    oh, ow = int(round(h * factors[1])), int(round(w * factors[2]))
    ys = np.linspace(0, h - 1, oh) if oh > 1 else np.zeros(1)
    xs = np.linspace(0, w - 1, ow) if ow > 1 else np.zeros(1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = img[:, y0][:, :, x0] * (1 - fx) + img[:, y0][:, :, x1] * fx
    bottom = img[:, y1][:, :, x0] * (1 - fx) + img[:, y1][:, :, x1] * fx
    return (top * (1 - fy) + bottom * fy).astype(img.dtype)


# -- the notebook's code, ported to Python 3 --------------------------------------------------

def preprocess(net, img):
    return np.float32(np.rollaxis(img, 2)[::-1]) - net.transformer.mean["data"]


def deprocess(net, img):
    return np.dstack((img + net.transformer.mean["data"])[::-1])


def objective_L2(dst):
    dst.diff[:] = dst.data


def objective_guide(dst, guide_features):
    x = dst.data[0].copy()
    y = guide_features
    ch = x.shape[0]
    x = x.reshape(ch, -1)
    y = y.reshape(ch, -1)
    A = x.T.dot(y)              # the dot-products of the image's and the guide's features
    dst.diff[0].reshape(ch, -1)[:] = y[:, A.argmax(1)]     # the best-matching guide features


def make_step(net, step_size=1.5, end=END, jitter=32, clip=True, objective=objective_L2, rng=np.random):
    """Basic gradient ascent step."""
    src = net.blobs["data"]     # input image is stored in Net's 'data' blob
    dst = net.blobs[end]
    ox, oy = rng.randint(-jitter, jitter + 1, 2)
    src.data[0] = np.roll(np.roll(src.data[0], ox, -1), oy, -2)     # apply jitter shift
    net.forward(end=end)
    objective(dst)              # specify the optimization objective
    net.backward(start=end)
    g = src.diff[0]
    src.data[:] += step_size / np.abs(g).mean() * g     # normalized ascent step
    src.data[0] = np.roll(np.roll(src.data[0], -ox, -1), -oy, -2)   # unshift image
    if clip:
        bias = net.transformer.mean["data"]
        src.data[:] = np.clip(src.data, -bias, 255 - bias)


def deepdream(net, base_img, iter_n=10, octave_n=4, octave_scale=1.4, end=END, clip=True, **step_params):
    octaves = [preprocess(net, base_img)]      # base images for all octaves
    for _ in range(octave_n - 1):
        octaves.append(zoom(octaves[-1], (1, 1.0 / octave_scale, 1.0 / octave_scale)))
    src = net.blobs["data"]
    detail = np.zeros_like(octaves[-1])        # network-produced details
    for octave, octave_base in enumerate(octaves[::-1]):
        h, w = octave_base.shape[-2:]
        if octave > 0:                          # upscale details from the previous octave
            h1, w1 = detail.shape[-2:]
            detail = zoom(detail, (1, 1.0 * h / h1, 1.0 * w / w1))
        src.reshape(1, 3, h, w)                 # resize the network's input image size
        src.data[0] = octave_base + detail
        for _ in range(iter_n):
            make_step(net, end=end, clip=clip, **step_params)
        detail = src.data[0] - octave_base     # details produced on the current octave
    return deprocess(net, src.data[0])


def size_at_4c(n):
    """An image side at inception_4c: conv1 (7x7, stride 2, pad 3), then three 3x3 stride-2 max
    pools, whose sizes Caffe rounds up."""
    n = (n + 2 * 3 - 7) // 2 + 1
    for _ in range(3):
        n = -(-(n - 3) // 2) + 1
    return n


# -- the test ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dream_net(tmp_path_factory):
    if SHARED is None:
        pytest.skip("../shared (the model zoo's GoogLeNet) is not present")
    deploy = googlenet_deploy(tmp_path_factory.mktemp("dream") / "deploy.prototxt")
    return caffe.Classifier(str(deploy), None, mean=MEAN, channel_swap=(2, 1, 0))    # random weights


@needs_shared
@pytest.mark.parametrize("hw, octave_n", [((100, 100), 1), ((300, 400), 2)])
def test_deepdream_runs_to_an_inception_layer(dream_net, hw, octave_n):
    net = dream_net
    rng = np.random.RandomState(0)
    img = rng.randint(0, 256, hw + (3,)).astype(np.float32)
    weights = {name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()}
    dream = deepdream(net, img, iter_n=1, octave_n=octave_n, rng=rng)
    assert dream.shape == hw + (3,) and np.all(np.isfinite(dream))
    assert np.abs(dream - img).max() > 1        # the steps changed the image
    assert net.blobs[END].shape[2:] == tuple(size_at_4c(d) for d in hw)
    assert net.blobs["pool5/7x7_s1"].shape == (1, 1024, 1, 1)      # after the end: as set up at 224
    for name, arrays in weights.items():
        assert all(np.array_equal(b.data, a) for b, a in zip(net.params[name], arrays)), name


@needs_shared
def test_deepdream_step_ascends_and_the_whole_net_runs_again(dream_net):
    """The gradient reaching the image is the objective's: a small unjittered step raises it;
    then the whole net, reshaped back to 224 x 224, classifies."""
    net = dream_net
    rng = np.random.RandomState(1)
    src, dst = net.blobs["data"], net.blobs[END]
    src.reshape(1, 3, 96, 128)
    src.data[0] = preprocess(net, rng.randint(0, 256, (96, 128, 3)).astype(np.float32))
    net.forward(end=END)
    before = 0.5 * float(np.sum(dst.data.astype(np.float64) ** 2))
    make_step(net, step_size=0.05, jitter=0, clip=False, rng=rng)
    net.forward(end=END)
    assert 0.5 * float(np.sum(dst.data.astype(np.float64) ** 2)) > before
    with pytest.raises(RuntimeError, match="keep the input shapes of an earlier forward"):
        net.backward()          # the classifier was never set up for 96 x 128
    src.reshape(1, 3, 224, 224)
    src.data[...] = 0
    prob = net.forward()["prob"]
    assert prob.shape == (1, 1000) and np.isclose(prob.sum(), 1, atol=1e-4)


@needs_shared
def test_guided_deepdream(dream_net):
    """The notebook's guided dream: the guide's features at inception_3b, then the image's steps
    toward them, each writing the objective into the end blob's diff through a reshaped view."""
    net, end = dream_net, "inception_3b/output"
    rng = np.random.RandomState(2)
    guide = rng.randint(0, 256, (64, 64, 3)).astype(np.float32)
    src, dst = net.blobs["data"], net.blobs[end]
    src.reshape(1, 3, *guide.shape[:2])
    src.data[0] = preprocess(net, guide)
    net.forward(end=end)
    guide_features = dst.data[0].copy()
    img = rng.randint(0, 256, (80, 96, 3)).astype(np.float32)
    dream = deepdream(net, img, iter_n=1, octave_n=1, end=end, rng=rng,
                      objective=lambda d: objective_guide(d, guide_features))
    assert dream.shape == img.shape and np.all(np.isfinite(dream)) and np.abs(dream - img).max() > 1
    assert dst.shape[2:] == (10, 12) and np.any(dst.diff != 0)


SMALL = """name: "s"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 12 dim: 12 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: AVE kernel_size: 12 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "max" type: "Pooling" bottom: "conv" top: "max" pooling_param { pool: MAX kernel_size: 12 } }
"""


def test_a_partial_forward_sets_up_only_the_layers_it_runs(tmp_path):
    """conv's top feeds two pools (a Split after conv, its tops views of conv's): forward(end="conv")
    at 5 x 7, where the pools' 12 x 12 kernels do not fit, sets up data and conv only."""
    (tmp_path / "s.prototxt").write_text(SMALL)
    net = caffe.Net(str(tmp_path / "s.prototxt"), caffe.TEST)
    weights = [b.data.copy() for b in net.params["ip"]]
    rng = np.random.default_rng(0)
    for hw in ((5, 7), (20, 30)):
        net.blobs["data"].reshape(1, 3, *hw)
        net.blobs["data"].data[...] = rng.standard_normal((1, 3) + hw)
        assert net.forward(end="conv")["conv"].shape == (1, 4) + hw
        assert net.blobs["pool"].shape == (1, 4, 1, 1)             # set up at 12 x 12
        net.blobs["conv"].diff[...] = 1
        diff = net.backward(start="conv")["data"]
        assert diff.shape == (1, 3) + hw and np.abs(diff).sum() > 0
    with pytest.raises(ValueError, match=r'layer "ip" \(InnerProduct\): the new input shapes give it bottoms '
                                         r'"pool" \(1, 4, 9, 19\), which need parameters of shapes'):
        net.reshape()           # Caffe's Net::Reshape sets every layer up: the classifier cannot take it
    assert net.forward(end="conv")["conv"].shape == (1, 4, 20, 30)  # the net is still usable
    with pytest.raises(RuntimeError, match='backward from layer "max": the layers after "conv"'):
        net.backward()
    net.blobs["data"].reshape(1, 3, 12, 12)
    assert net.forward()["ip"].shape == (1, 5)
    assert all(np.array_equal(b.data, w) for b, w in zip(net.params["ip"], weights))
