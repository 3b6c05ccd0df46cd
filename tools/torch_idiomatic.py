"""The comparison's nets written the way PyTorch users write them.

    model = resnet(blocks=(3, 4, 6, 3))          # ResNet-50, torchvision's block layout
    model.load_caffe(net)                        # parameters and BN statistics of an sncaffe Net
    loss = F.cross_entropy(model(x), y)

tools/torch_net.py's twin replays a Caffe graph layer by layer (separate BatchNorm and Scale
modules, every blob kept under its Caffe name), which costs PyTorch memory no PyTorch user pays.
These modules are torchvision's way instead: affine ``BatchNorm2d`` (Caffe's BatchNorm + Scale in
one), in-place ReLU, the residual added in place, no blob kept beyond what autograd saves. The
math is the Caffe file's (the stride of a bottleneck on its first 1x1 convolution, as in Kaiming
He's Caffe ResNets; Caffe's pooling rounds up), so the same weights give the same outputs
(tests/test_torch_idiomatic.py checks it against the twin and sncaffe).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_resnet import block_names  # noqa: E402


def conv(cin, cout, k, stride=1, bias=False):
    return nn.Conv2d(cin, cout, k, stride, k // 2, bias=bias)


def bn(c):
    # Caffe's moving_average_fraction 0.999 is PyTorch's momentum 0.001
    return nn.BatchNorm2d(c, momentum=0.001)


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.conv1, self.bn1 = conv(cin, width, 1, stride), bn(width)
        self.conv2, self.bn2 = conv(width, width, 3), bn(width)
        self.conv3, self.bn3 = conv(width, 4 * width, 1), bn(4 * width)
        self.relu = nn.ReLU(inplace=True)
        project = stride != 1 or cin != 4 * width
        self.downsample = nn.Sequential(conv(cin, 4 * width, 1, stride), bn(4 * width)) if project else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = conv(cin, cout, 3, stride), bn(cout)
        self.conv2, self.bn2 = conv(cout, cout, 3), bn(cout)
        self.relu = nn.ReLU(inplace=True)
        project = stride != 1 or cin != cout
        self.downsample = nn.Sequential(conv(cin, cout, 1, stride), bn(cout)) if project else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class CaffeLoadable(nn.Module):
    """``load_caffe(net)``: copy an sncaffe Net's parameters by the Caffe layer names of ``caffe_names``."""

    def caffe_names(self):
        """(module, Caffe conv/ip layer, Caffe BatchNorm layer, Caffe Scale layer) for each conv or fc."""
        raise NotImplementedError

    @torch.no_grad()
    def load_caffe(self, net):
        def t(blob, like):
            return torch.as_tensor(np.array(blob.data)).to(like.dtype).reshape(like.shape)
        for module, name, bn_name, scale_name in self.caffe_names():
            layer_conv, layer_bn = module
            blobs = net.params[name]
            layer_conv.weight.copy_(t(blobs[0], layer_conv.weight))
            if layer_conv.bias is not None:
                layer_conv.bias.copy_(t(blobs[1], layer_conv.bias))
            if layer_bn is None:
                continue
            mean, var, factor = (np.array(b.data) for b in net.params[bn_name])
            f = 0.0 if float(factor.reshape(-1)[0]) == 0 else 1.0 / float(factor.reshape(-1)[0])
            layer_bn.running_mean.copy_(torch.as_tensor(mean * f))
            layer_bn.running_var.copy_(torch.as_tensor(var * f))
            gamma, beta = net.params[scale_name]
            layer_bn.weight.copy_(t(gamma, layer_bn.weight))
            layer_bn.bias.copy_(t(beta, layer_bn.bias))
        return self


class ResNet(CaffeLoadable):
    """Kaiming He's Caffe ResNet (gen_resnet.py's layout) as torchvision writes a ResNet."""

    def __init__(self, blocks=(3, 4, 6, 3), num_classes=1000):
        super().__init__()
        self.blocks = tuple(blocks)
        self.conv1, self.bn1 = conv(3, 64, 7, 2, bias=True), bn(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, ceil_mode=True)
        cin, stages = 64, []
        for i, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            layers = [Bottleneck(cin if b == 0 else 4 * width, width, 2 if (b == 0 and i > 0) else 1)
                      for b in range(n)]
            stages.append(nn.Sequential(*layers))
            cin = 4 * width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def caffe_names(self):
        yield (self.conv1, self.bn1), "conv1", "bn_conv1", "scale_conv1"
        for s, stage in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), start=2):
            for letter, block in zip(block_names(len(stage)), stage):
                r = f"{s}{letter}"
                for module, branch in ((block.conv1, block.bn1), "2a"), ((block.conv2, block.bn2), "2b"), \
                                      ((block.conv3, block.bn3), "2c"):
                    yield module, f"res{r}_branch{branch}", f"bn{r}_branch{branch}", f"scale{r}_branch{branch}"
                if block.downsample is not None:
                    yield tuple(block.downsample), f"res{r}_branch1", f"bn{r}_branch1", f"scale{r}_branch1"
        yield (self.fc, None), "fc1000", None, None


class CifarResNet(CaffeLoadable):
    """prototxt/cifar10_resnet.prototxt (He et al.'s CIFAR ResNet, option B) with BasicBlocks."""

    def __init__(self, n=3, num_classes=10):
        super().__init__()
        self.conv1, self.bn1 = conv(3, 16, 3), bn(16)
        self.relu = nn.ReLU(inplace=True)
        cin, stages = 16, []
        for i, width in enumerate((16, 32, 64)):
            stages.append(nn.Sequential(*[BasicBlock(cin if b == 0 else width, width, 2 if (b == 0 and i) else 1)
                                          for b in range(n)]))
            cin = width
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def caffe_names(self):
        yield (self.conv1, self.bn1), "conv1", "conv1/bn", "conv1/scale"
        for s, stage in enumerate((self.layer1, self.layer2, self.layer3), start=1):
            for b, block in enumerate(stage, start=1):
                r = f"res{s}_{b}"
                yield (block.conv1, block.bn1), f"{r}/conv1", f"{r}/conv1/bn", f"{r}/conv1/scale"
                yield (block.conv2, block.bn2), f"{r}/conv2", f"{r}/conv2/bn", f"{r}/conv2/scale"
                if block.downsample is not None:
                    yield tuple(block.downsample), f"{r}/proj", f"{r}/proj/bn", f"{r}/proj/scale"
        yield (self.fc, None), "fc10", None, None


class LeNet(CaffeLoadable):
    """Caffe's MNIST LeNet (prototxt/lenet_train_test.prototxt) as a PyTorch user writes it."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 20, 5), nn.Conv2d(20, 50, 5)
        self.ip1, self.ip2 = nn.Linear(800, 500), nn.Linear(500, 10)
        self.pool1, self.pool2, self.relu = nn.MaxPool2d(2), nn.MaxPool2d(2), nn.ReLU(inplace=True)

    def forward(self, x):                   # the data layer's scale 1/256 comes before
        x = self.pool2(self.conv2(self.pool1(self.conv1(x))))
        return self.ip2(self.relu(self.ip1(torch.flatten(x, 1))))

    def caffe_names(self):
        for name in ("conv1", "conv2", "ip1", "ip2"):
            yield (getattr(self, name), None), name, None, None


def model_for(layer_names, num_classes=None):
    """The idiomatic module of a net by its Caffe layer names (gen_resnet's ResNets, the CIFAR
    ResNet, LeNet), or None where this file has no idiomatic form of it."""
    import re
    names = set(layer_names)
    stages = {}
    for n in names:
        m = re.fullmatch(r"res(\d)([a-z]\d*)_branch2a", n)
        if m:
            stages[int(m.group(1))] = stages.get(int(m.group(1)), 0) + 1
    if sorted(stages) == [2, 3, 4, 5] and "fc1000" in names:
        return ResNet(tuple(stages[s] for s in (2, 3, 4, 5)), num_classes or 1000)
    cifar = {}
    for m in filter(None, (re.fullmatch(r"res(\d)_(\d+)/conv1", n) for n in names)):
        cifar[int(m.group(1))] = max(cifar.get(int(m.group(1)), 0), int(m.group(2)))
    if sorted(cifar) == [1, 2, 3] and len(set(cifar.values())) == 1 and "fc10" in names:
        return CifarResNet(cifar[1], num_classes or 10)
    if {"conv1", "pool1", "conv2", "pool2", "ip1", "ip2"} <= names and not any(n.startswith("res") for n in names):
        return LeNet()
    return None


def resnet(blocks=(3, 4, 6, 3), num_classes=1000) -> ResNet:
    return ResNet(blocks, num_classes)


def sequential(model) -> nn.Sequential:
    """``model`` as one flat nn.Sequential (stem, each block, head): what checkpoint_sequential cuts."""
    if isinstance(model, LeNet):
        # one module per position: checkpoint_sequential walks children(), which skips repeats
        return nn.Sequential(model.conv1, model.pool1, model.conv2, model.pool2, nn.Flatten(1), model.ip1,
                             model.relu, model.ip2)
    if isinstance(model, ResNet):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        stages = (model.layer1, model.layer2, model.layer3, model.layer4)
    else:
        stem = nn.Sequential(model.conv1, model.bn1, model.relu)
        stages = (model.layer1, model.layer2, model.layer3)
    blocks = [b for stage in stages for b in stage]
    return nn.Sequential(stem, *blocks, nn.Sequential(model.avgpool, nn.Flatten(1), model.fc))


def step(model, x, y):
    """One training step's forward and backward, as a PyTorch training loop runs it."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss
