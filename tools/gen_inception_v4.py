"""Write Inception-v4 (Szegedy et al., 2016) as a Caffe training prototxt.

    python tools/gen_inception_v4.py                       # the net on stdout
    python tools/gen_inception_v4.py --batch 2 --image-size 75 -o tiny.prototxt
    python tools/gen_inception_v4.py --committed           # rewrite prototxt/inception_v4.prototxt
    python tools/gen_inception_v4.py --committed --check   # exit 1 if the committed file is stale

The architecture is Figure 9 of "Inception-v4, Inception-ResNet and the Impact
of Residual Connections on Learning": the stem (Figure 3), 4 Inception-A, a
Reduction-A (k, l, m, n = 192, 224, 256, 384), 7 Inception-B, a Reduction-B,
3 Inception-C, global average pooling, dropout (keep 0.8) and fc 1000, with the
1xn/nx1 order of TF-slim's reference inception_v4.py where the figures differ
(stem and Inception-C), so its 42.7 M parameters have the same shapes. Every
convolution is followed by BatchNorm, Scale (with bias) and ReLU, in place, and
has no bias of its own. "V" (valid) convolutions have no padding, the others
pad to keep the size. At 299x299 the grid is 35, 17 and 8 for the A, B and C
blocks. Other image sizes work where each stride-2 convolution and the pooling
beside it give the same grid (75, for tiny tests, does): Caffe's pooling rounds
up, convolutions round down, and the generator refuses a size where a Concat's
branches would not match.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_resnet import Enum, Writer, emit  # noqa: E402  (one prototxt writer for the generated nets)

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = "prototxt/inception_v4.prototxt"
DEFAULT_BATCH, DEFAULT_SIZE = 16, 299


class Net(Writer):
    """A Writer that follows spatial sizes, so each Concat is checked as it is written."""

    def __init__(self):
        super().__init__()
        self.size = {}
        self.convs = 0

    def conv(self, name, bottom, num_output, kernel, stride=1, valid=False):
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        p = {"num_output": num_output, "bias_term": False}
        ph, pw = (0, 0) if valid else ((kh - 1) // 2, (kw - 1) // 2)
        if kh == kw:
            p["kernel_size"] = kh
            if ph:
                p["pad"] = ph
        else:
            p.update(kernel_h=kh, kernel_w=kw, pad_h=ph, pad_w=pw)
        if stride != 1:
            p["stride"] = stride
        p["weight_filler"] = {"type": "msra"}
        self.convs += 1
        self.layer(name, "Convolution", bottom, name, convolution_param=p)
        h, w = self.size[bottom]
        self.size[name] = ((h + 2 * ph - kh) // stride + 1, (w + 2 * pw - kw) // stride + 1)
        self.layer(f"{name}/bn", "BatchNorm", name, name)
        self.layer(f"{name}/scale", "Scale", name, name, scale_param={"bias_term": True})
        self.layer(f"{name}/relu", "ReLU", name, name)
        return name

    def pool(self, name, bottom, method, kernel, stride, pad=0):
        self.layer(name, "Pooling", bottom, name, pooling_param={
            "pool": Enum(method), "kernel_size": kernel, "stride": stride, **({"pad": pad} if pad else {})})
        self.size[name] = tuple(-(-(s + 2 * pad - kernel) // stride) + 1 for s in self.size[bottom])
        return name

    def concat(self, name, bottoms):
        sizes = {self.size[b] for b in bottoms}
        if len(sizes) != 1:
            raise ValueError(f"{name}: branches of sizes {sorted(sizes)} cannot be concatenated; "
                             "choose an image size whose grids stay odd at each reduction (e.g. 75, 299)")
        self.size[name] = sizes.pop()
        return self.layer(name, "Concat", bottoms, name)


def stem(n, x):
    x = n.conv("stem/conv1_3x3_s2", x, 32, 3, 2, valid=True)
    x = n.conv("stem/conv2_3x3", x, 32, 3, valid=True)
    x = n.conv("stem/conv3_3x3", x, 64, 3)
    x = n.concat("stem/concat1", [n.pool("stem/pool1_3x3_s2", x, "MAX", 3, 2),
                                  n.conv("stem/conv4_3x3_s2", x, 96, 3, 2, valid=True)])
    a = n.conv("stem/conv5a_1x1", x, 64, 1)
    a = n.conv("stem/conv5a_3x3", a, 96, 3, valid=True)
    b = n.conv("stem/conv5b_1x1", x, 64, 1)
    b = n.conv("stem/conv5b_1x7", b, 64, (1, 7))
    b = n.conv("stem/conv5b_7x1", b, 64, (7, 1))
    b = n.conv("stem/conv5b_3x3", b, 96, 3, valid=True)
    x = n.concat("stem/concat2", [a, b])
    return n.concat("stem/concat3", [n.conv("stem/conv6_3x3_s2", x, 192, 3, 2, valid=True),
                                     n.pool("stem/pool2_3x3_s2", x, "MAX", 3, 2)])


def inception_a(n, x, p):
    b0 = n.conv(f"{p}/pool_1x1", n.pool(f"{p}/pool", x, "AVE", 3, 1, 1), 96, 1)
    b1 = n.conv(f"{p}/1x1", x, 96, 1)
    b2 = n.conv(f"{p}/3x3", n.conv(f"{p}/3x3_reduce", x, 64, 1), 96, 3)
    b3 = n.conv(f"{p}/double_3x3_reduce", x, 64, 1)
    b3 = n.conv(f"{p}/double_3x3_2", n.conv(f"{p}/double_3x3_1", b3, 96, 3), 96, 3)
    return n.concat(f"{p}/concat", [b0, b1, b2, b3])


def reduction_a(n, x, p, k=192, l=224, m=256, nn=384):
    b0 = n.conv(f"{p}/3x3_s2", x, nn, 3, 2, valid=True)
    b1 = n.conv(f"{p}/double_3x3_1", n.conv(f"{p}/double_3x3_reduce", x, k, 1), l, 3)
    b1 = n.conv(f"{p}/double_3x3_2_s2", b1, m, 3, 2, valid=True)
    return n.concat(f"{p}/concat", [b0, b1, n.pool(f"{p}/pool_3x3_s2", x, "MAX", 3, 2)])


def inception_b(n, x, p):
    b0 = n.conv(f"{p}/pool_1x1", n.pool(f"{p}/pool", x, "AVE", 3, 1, 1), 128, 1)
    b1 = n.conv(f"{p}/1x1", x, 384, 1)
    b2 = n.conv(f"{p}/1x7_reduce", x, 192, 1)
    b2 = n.conv(f"{p}/7x1", n.conv(f"{p}/1x7", b2, 224, (1, 7)), 256, (7, 1))
    b3 = n.conv(f"{p}/double_7x1_reduce", x, 192, 1)
    for i, (out, k) in enumerate(((192, (7, 1)), (224, (1, 7)), (224, (7, 1)), (256, (1, 7))), 1):
        b3 = n.conv(f"{p}/double_{k[0]}x{k[1]}_{i}", b3, out, k)
    return n.concat(f"{p}/concat", [b0, b1, b2, b3])


def reduction_b(n, x, p):
    b0 = n.conv(f"{p}/3x3_s2", n.conv(f"{p}/3x3_reduce", x, 192, 1), 192, 3, 2, valid=True)
    b1 = n.conv(f"{p}/1x7_reduce", x, 256, 1)
    b1 = n.conv(f"{p}/7x1", n.conv(f"{p}/1x7", b1, 256, (1, 7)), 320, (7, 1))
    b1 = n.conv(f"{p}/3x3_s2_2", b1, 320, 3, 2, valid=True)
    return n.concat(f"{p}/concat", [b0, b1, n.pool(f"{p}/pool_3x3_s2", x, "MAX", 3, 2)])


def inception_c(n, x, p):
    b0 = n.conv(f"{p}/pool_1x1", n.pool(f"{p}/pool", x, "AVE", 3, 1, 1), 256, 1)
    b1 = n.conv(f"{p}/1x1", x, 256, 1)
    b2 = n.conv(f"{p}/1x1_2", x, 384, 1)
    b2 = [n.conv(f"{p}/1x3", b2, 256, (1, 3)), n.conv(f"{p}/3x1", b2, 256, (3, 1))]
    b3 = n.conv(f"{p}/1x1_3", x, 384, 1)
    b3 = n.conv(f"{p}/1x3_3", n.conv(f"{p}/3x1_3", b3, 448, (3, 1)), 512, (1, 3))
    b3 = [n.conv(f"{p}/1x3_4", b3, 256, (1, 3)), n.conv(f"{p}/3x1_4", b3, 256, (3, 1))]
    return n.concat(f"{p}/concat", [b0, b1, *b2, *b3])


def generate(batch=DEFAULT_BATCH, image_size=DEFAULT_SIZE, command=None) -> str:
    n = Net()
    n.layer("data", "Input", [], ["data", "label"],
            input_param={"shape": [{"dim": [batch, 3, image_size, image_size]}, {"dim": [batch]}]})
    n.size["data"] = (image_size, image_size)
    x = stem(n, "data")
    for i in range(4):
        x = inception_a(n, x, f"inception_a{i + 1}")
    x = reduction_a(n, x, "reduction_a")
    for i in range(7):
        x = inception_b(n, x, f"inception_b{i + 1}")
    x = reduction_b(n, x, "reduction_b")
    for i in range(3):
        x = inception_c(n, x, f"inception_c{i + 1}")
    grids = [n.size[f"inception_{c}1/concat"][0] for c in "abc"]
    x = n.layer("pool_8x8", "Pooling", x, "pool_8x8", pooling_param={"pool": Enum("AVE"), "global_pooling": True})
    n.layer("pool_8x8/drop", "Dropout", x, x, dropout_param={"dropout_ratio": 0.2})
    x = n.layer("classifier", "InnerProduct", x, "classifier", inner_product_param={
        "num_output": 1000, "weight_filler": {"type": "xavier"}, "bias_filler": {"type": "constant", "value": 0}})
    n.layer("loss", "SoftmaxWithLoss", [x, "label"], "loss")
    n.layer("accuracy", "Accuracy", [x, "label"], "accuracy", include={"phase": Enum("TEST")})
    header = [
        f"# Inception-v4 (Szegedy et al., 2016, Figure 9): {n.convs} convolutions + fc, "
        f"{image_size}x{image_size} input, grids {grids[0]}/{grids[1]}/{grids[2]} in the A/B/C blocks.",
        "# Generated by: " + (command or "python tools/gen_inception_v4.py"),
        "# Do not edit: change tools/gen_inception_v4.py and rerun the command.",
        "# Every convolution: no bias, then BatchNorm (batch statistics in TRAIN), Scale with bias, ReLU.",
    ]
    return "\n".join(header) + '\nname: "Inception-v4"\n\n' + "\n\n".join(n.layers) + "\n"


def command_line(batch=DEFAULT_BATCH, image_size=DEFAULT_SIZE, output=None) -> str:
    args = [f"--batch {batch}"] + ([f"--image-size {image_size}"] if image_size != DEFAULT_SIZE else [])
    return "python tools/gen_inception_v4.py " + " ".join(args + ([f"-o {output}"] if output else []))


def committed_text() -> str:
    return generate(command=command_line(output=COMMITTED))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--image-size", type=int, default=DEFAULT_SIZE)
    ap.add_argument("-o", "--output", help="file to write (default: stdout)")
    ap.add_argument("--committed", action="store_true", help=f"rewrite {COMMITTED}")
    ap.add_argument("--check", action="store_true", help="with --committed: exit 1 if the file is stale")
    args = ap.parse_args(argv)
    if args.committed:
        path, text = ROOT / COMMITTED, committed_text()
        if not args.check:
            path.write_text(text)
            return 0
        if path.is_file() and path.read_text() == text:
            return 0
        print(f"{COMMITTED} is stale: run python tools/gen_inception_v4.py --committed", file=sys.stderr)
        return 1
    def make():
        return generate(args.batch, args.image_size, command_line(args.batch, args.image_size, args.output))
    return emit(ap, args.output, make)


if __name__ == "__main__":
    sys.exit(main())
