"""Write Caffe prototxt for bottleneck ResNets, in the layout of Kaiming He's ResNet-50 deploy file.

    python tools/gen_resnet.py --depth 50                  # training net on stdout
    python tools/gen_resnet.py --blocks 3,4,6,3 --deploy -o resnet50-deploy.prototxt
    python tools/gen_resnet.py --committed                 # rewrite prototxt/resnet{50,101,152,2500}.prototxt
    python tools/gen_resnet.py --committed --check         # exit 1 if a committed file is stale

The net is the original Caffe ResNet (He et al., 2015, deploy files of
KaimingHe/deep-residual-networks): 7x7/2 conv1 (with a bias), 3x3/2 max pool,
four stages of bottleneck blocks with 256, 512, 1024, 2048 outputs, the stride 2
on the first 1x1 convolution (branch2a) and on the projection shortcut (branch1)
of stages res3..res5, Eltwise SUM, global average pool, fc1000.

Block counts: ``--depth`` 50, 101, 152 are the paper's [3,4,6,3], [3,4,23,3],
[3,8,36,3]; 2500 is SuperNeurons' ResNet-2500, [6,32,788,6] (its true depth is
3*832+2 = 2498). Any other depth D (D = 3*sum(blocks)+2) grows the third stage
(res4) as the paper's deep nets do: [3, 4, (D-2)/3 - 10, 3].

Block names follow Kaiming's files: a stage with at most 6 blocks uses letters
(res4a..res4f), a longer one res4a, res4b1, res4b2, ... (res4b22 in ResNet-101,
res3b7 and res4b35 in ResNet-152), so his caffemodels load by layer name.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 2500: (6, 32, 788, 6)}
COMMITTED = {f"prototxt/resnet{d}.prototxt": d for d in (50, 101, 152, 2500)}
WIDTHS = (64, 128, 256, 512)          # bottleneck widths of res2..res5; outputs are 4x


def blocks_for_depth(depth: int) -> tuple:
    if depth in PRESETS:
        return PRESETS[depth]
    n = (depth - 2) // 3 - 10
    if (depth - 2) % 3 or n < 1:
        raise ValueError(f"depth {depth}: need 3*sum(blocks)+2 with blocks [3,4,n,3], n >= 1 "
                         f"(depth 35, 38, 41, ...) or one of {sorted(PRESETS)}")
    return (3, 4, n, 3)


def depth_of(blocks: tuple):
    """The --depth that gives ``blocks``, or None."""
    preset = next((d for d, b in PRESETS.items() if b == blocks), None)
    if preset is not None:
        return preset
    depth = 3 * sum(blocks) + 2
    return depth if blocks == (3, 4, depth // 3 - 10, 3) else None


def block_names(n: int) -> list:
    if n <= 6:
        return [chr(ord("a") + i) for i in range(n)]
    return ["a"] + [f"b{i}" for i in range(1, n)]


class Enum(str):
    """A protobuf enum value, written unquoted."""


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Enum):
        return str(v)
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def _fields(items, depth) -> list:
    tab = "\t" * depth
    lines = []
    for key, v in items:
        if isinstance(v, dict):
            lines += [f"{tab}{key} {{", *_fields(v.items(), depth + 1), f"{tab}}}"]
        elif isinstance(v, list):            # a repeated field
            lines += _fields([(key, x) for x in v], depth)
        else:
            lines.append(f"{tab}{key}: {_value(v)}")
    return lines


class Writer:
    def __init__(self):
        self.layers = []

    def layer(self, name, type, bottom, top, **params):
        bottom = [bottom] if isinstance(bottom, str) else bottom
        top = [top] if isinstance(top, str) else top
        items = [("bottom", bottom), ("top", top), ("name", name), ("type", type), *params.items()]
        self.layers.append("\n".join(["layer {", *_fields(items, 1), "}"]))
        return top[0]

    def conv(self, name, bottom, num_output, kernel, stride, bias=False):
        p = {"num_output": num_output, "kernel_size": kernel, "pad": (kernel - 1) // 2, "stride": stride}
        if not bias:
            p["bias_term"] = False
        p["weight_filler"] = {"type": "msra"}
        if bias:
            p["bias_filler"] = {"type": "constant", "value": 0}
        return self.layer(name, "Convolution", bottom, name, convolution_param=p)

    def bn_scale(self, blob, suffix):
        # use_global_stats unset: batch statistics in TRAIN, the running averages in TEST
        self.layer(f"bn{suffix}", "BatchNorm", blob, blob)
        self.layer(f"scale{suffix}", "Scale", blob, blob, scale_param={"bias_term": True})

    def relu(self, blob):
        return self.layer(f"{blob}_relu", "ReLU", blob, blob)


def _pool_out(size, kernel, stride, pad=0):
    return -(-(size + 2 * pad - kernel) // stride) + 1      # Caffe rounds pooling up


def _conv_out(size, kernel, stride, pad=0):
    return (size + 2 * pad - kernel) // stride + 1


def generate(blocks, data="input", batch=16, image_size=224, deploy=False, command=None) -> str:
    """The prototxt text of a bottleneck ResNet with ``blocks`` per stage res2..res5."""
    blocks = tuple(int(b) for b in blocks)
    if len(blocks) != 4 or min(blocks) < 1:
        raise ValueError(f"blocks must be four counts >= 1, got {blocks}")
    depth = 3 * sum(blocks) + 2
    label = depth_of(blocks) or depth
    w = Writer()
    if deploy:
        w.layer("data", "Input", [], "data",
                input_param={"shape": {"dim": [batch, 3, image_size, image_size]}})
    elif data == "input":
        w.layer("data", "Input", [], ["data", "label"],
                input_param={"shape": [{"dim": [batch, 3, image_size, image_size]}, {"dim": [batch]}]})
    elif data == "dummy":
        w.layer("data", "DummyData", [], ["data", "label"], dummy_data_param={
            "data_filler": [{"type": "gaussian", "std": 1.0}, {"type": "constant", "value": 0}],
            "shape": [{"dim": [batch, 3, image_size, image_size]}, {"dim": [batch]}]})
    else:
        raise ValueError(f"data must be input or dummy, not {data!r}")

    x = w.conv("conv1", "data", 64, 7, 2, bias=True)
    w.bn_scale(x, "_conv1")
    w.relu(x)
    x = w.layer("pool1", "Pooling", x, "pool1",
                pooling_param={"kernel_size": 3, "stride": 2, "pool": Enum("MAX")})
    size = _pool_out(_conv_out(image_size, 7, 2, 3), 3, 2)
    for s, (n, width) in enumerate(zip(blocks, WIDTHS)):
        stage = s + 2
        for i, b in enumerate(block_names(n)):
            res = f"res{stage}{b}"
            stride = 2 if i == 0 and stage > 2 else 1
            if i == 0:                       # projection shortcut
                shortcut = w.conv(f"{res}_branch1", x, 4 * width, 1, stride)
                w.bn_scale(shortcut, f"{stage}{b}_branch1")
            else:
                shortcut = x
            y = x
            for br, (out, k, st) in zip("abc", ((width, 1, stride), (width, 3, 1), (4 * width, 1, 1))):
                y = w.conv(f"{res}_branch2{br}", y, out, k, st)
                w.bn_scale(y, f"{stage}{b}_branch2{br}")
                if br != "c":
                    w.relu(y)
            x = w.layer(res, "Eltwise", [shortcut, y], res)
            w.relu(x)
        if stage > 2:
            size = _conv_out(size, 1, 2)
    x = w.layer("pool5", "Pooling", x, "pool5",
                pooling_param={"kernel_size": size, "stride": 1, "pool": Enum("AVE")})
    x = w.layer("fc1000", "InnerProduct", x, "fc1000", inner_product_param={
        "num_output": 1000,
        "weight_filler": {"type": "gaussian", "std": 0.01},
        "bias_filler": {"type": "constant", "value": 0}})
    if deploy:
        w.layer("prob", "Softmax", x, "prob")
    else:
        w.layer("loss", "SoftmaxWithLoss", [x, "label"], "loss")
        w.layer("accuracy", "Accuracy", [x, "label"], "accuracy", include={"phase": Enum("TEST")})

    header = [
        f"# ResNet-{label}: bottleneck blocks {list(blocks)} in res2..res5, "
        f"{sum(blocks) * 3 + 2} weighted layers, {image_size}x{image_size} input.",
        "# Generated by: " + (command or "python tools/gen_resnet.py"),
        "# Do not edit: change tools/gen_resnet.py and rerun the command.",
        "# Layer names and settings follow Kaiming He's ResNet deploy files, except that BatchNorm",
        "# leaves use_global_stats unset (batch statistics in TRAIN, running averages in TEST),",
        "# where his deploy files set use_global_stats: true, and fillers are given for training.",
    ]
    return "\n".join(header) + f'\nname: "ResNet-{label}"\n\n' + "\n\n".join(w.layers) + "\n"


def command_line(blocks, data="input", batch=16, image_size=224, deploy=False, output=None) -> str:
    """The canonical command that generates this net (written in its header)."""
    blocks = tuple(blocks)
    depth = depth_of(blocks)
    args = [f"--depth {depth}" if depth else "--blocks " + ",".join(map(str, blocks))]
    args.append("--deploy" if deploy else f"--data {data}")
    args.append(f"--batch {batch}")
    if image_size != 224:
        args.append(f"--image-size {image_size}")
    if output:
        args.append(f"-o {output}")
    return "python tools/gen_resnet.py " + " ".join(args)


def committed_text(depth: int) -> str:
    rel = next(r for r, d in COMMITTED.items() if d == depth)
    return generate(PRESETS[depth], command=command_line(PRESETS[depth], output=rel))


def emit(ap, output, make) -> int:
    """Write the text ``make()`` returns to ``output`` (stdout without one); its ValueError is a
    usage error of ``ap``. The generators' common last step."""
    try:
        text = make()
    except ValueError as e:
        ap.error(str(e))
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--depth", type=int, help=f"one of {sorted(PRESETS)} or 3*(10+n)+2 for [3,4,n,3]")
    which.add_argument("--blocks", help="blocks per stage res2..res5, e.g. 3,4,6,3")
    which.add_argument("--committed", action="store_true", help="rewrite the nets in prototxt/")
    ap.add_argument("--data", choices=["input", "dummy"], default="input",
                    help="Input layer (filled by the caller) or DummyData (gaussian data, label 0)")
    ap.add_argument("--deploy", action="store_true", help="data Input only, ending with Softmax prob")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("-o", "--output", help="file to write (default: stdout)")
    ap.add_argument("--check", action="store_true", help="with --committed: exit 1 if a file is stale")
    args = ap.parse_args(argv)

    if args.committed:
        stale = []
        for rel, depth in COMMITTED.items():
            path, text = ROOT / rel, committed_text(depth)
            if args.check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(rel)
            else:
                path.write_text(text)
        for rel in stale:
            print(f"{rel} is stale: run python tools/gen_resnet.py --committed", file=sys.stderr)
        return 1 if stale else 0

    def make():
        blocks = (blocks_for_depth(args.depth) if args.depth
                  else tuple(int(b) for b in args.blocks.split(",")))
        kw = dict(data=args.data, batch=args.batch, image_size=args.image_size, deploy=args.deploy)
        return generate(blocks, command=command_line(blocks, output=args.output, **kw), **kw)
    return emit(ap, args.output, make)


if __name__ == "__main__":
    sys.exit(main())
