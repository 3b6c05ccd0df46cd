"""``sncaffe export``: a net as ONNX or as PyTorch source, checked against sncaffe."""
from __future__ import annotations

import argparse

import numpy as np

from . import ExportError
from .check import DEFAULT_RTOL

DESCRIPTION = """\
Write a net as an ONNX graph (--onnx, opset 18, run by onnxruntime) or as a PyTorch module
(--torch out.py: readable source, the weights beside it in out.pt as a state_dict).

What is exported, the net's deploy part for --phase (default TEST) and --stage:
  - data layers (Input, Data, ImageData, HDF5Data, MemoryData, WindowData, DenseImageData,
    AnnotatedData) become inputs, for the tops a kept layer reads; a data layer's shape comes
    from its source, or from --input;
  - loss layers (every *Loss type), Accuracy, DetectionEvaluate and Silence are dropped;
  - the outputs are the blobs no kept layer reads (a loss's scores become an output).
Layer types mapped: Convolution (group, dilation, 1-3 spatial axes), Deconvolution,
ConvolutionDepthwise, Pooling (MAX, AVE, global; Caffe's ceil rounding and padding), LRN (across
and within channels), InnerProduct (axis, transpose), ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal, BNLL,
Power, Exp, Log, Clip, Swish, Threshold, Dropout, BatchNorm, Scale, Bias, MVN, Eltwise (SUM with
coefficients, PROD, MAX), Concat, Slice, Split, Flatten, Reshape, Crop, Softmax, ArgMax, Reduction,
Tile, Parameter; the forks' Interp, ShuffleChannel, Axpy, Permute, Normalize, PriorBox (a
constant), BN (its stored-statistics modes), ROIPooling, Upsample with its Pooling mask.
Any other type (recurrent, Python, Embed, SPP, DetectionOutput, PSROIPooling, ...) is
refused by name, as are settings without an exact mapping (STOCHASTIC pooling, BN by the
batch's statistics, ONNX with batch statistics or TRAIN-phase dropout); nothing is exported
approximately.

The check: one random N(0,1) batch runs through sncaffe and through onnxruntime (or the module);
the largest difference of every output, relative to the output's largest value, is printed, and
the export fails (exit 1, nothing written) where one is over --rtol. Without WEIGHTS the
parameters are the fillers' values (BatchNorm layers without statistics are checked
with mean 0 and variance 1 and written as they are). Shapes are static: the batch is the net's (or --batch).
"""


def add_parser(sub):
    e = sub.add_parser("export", help="write a net as ONNX or as PyTorch source, with a numeric check",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("net", help="net prototxt")
    e.add_argument("weights", nargs="?", help=".caffemodel (or Caffe HDF5 weights) to export")
    out = e.add_mutually_exclusive_group(required=True)
    out.add_argument("--onnx", metavar="OUT.onnx", help="write an ONNX model")
    out.add_argument("--torch", metavar="OUT.py", help="write a PyTorch module (and its weights as OUT.pt)")
    e.add_argument("--phase", default="TEST", choices=["TRAIN", "TEST"],
                   help="the phase whose layers are exported (default: %(default)s)")
    e.add_argument("--stage", action="append", default=[], help="a net stage (NetState.stage); repeat for more")
    e.add_argument("--level", type=int, help="the net level (NetState.level)")
    e.add_argument("--batch", type=int, help="the batch size of the inputs (default: the net's)")
    e.add_argument("--input", action="append", default=[], metavar="BLOB=N,C,H,W",
                   help="the shape of a data layer's top (needed where its data source is absent)")
    e.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help="the largest relative difference allowed (default: %(default)g)")
    e.set_defaults(func=main)
    # each option string and whether it takes a value (caffe_cli.translate reads it)
    e.options = {"-h": False, "--help": False, **dict.fromkeys(
        ("--onnx", "--torch", "--phase", "--stage", "--level", "--batch", "--input", "--rtol"), True)}
    return e


def parse_inputs(specs) -> dict:
    shapes = {}
    for spec in specs:
        name, eq, dims = spec.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not (name and eq and shape) or min(shape) < 1:
            raise ExportError(f"--input {spec}: give BLOB=N,C,H,W (positive integers)")
        shapes[name] = shape
    return shapes


def main(args) -> int:
    from .deploy import load
    if args.rtol is None or not args.rtol >= 0:
        raise ExportError(f"--rtol {args.rtol}: give a number >= 0")
    what = "ONNX" if args.onnx else "PyTorch"
    import importlib
    try:
        for package in ("onnx", "onnxruntime") if args.onnx else ("torch",):    # the check runs them
            importlib.import_module(package)
    except ImportError as e:
        extra = "onnx" if args.onnx else "torch"
        raise ExportError(f"{what} export needs {e.name}: pip install 'sncaffe[{extra}]'") from None
    if args.onnx:
        from . import onnx as exporter
    else:
        from . import pytorch as exporter
    net = load(args.net, args.phase, args.stage, args.level, args.weights, parse_inputs(args.input), args.batch)
    out = args.onnx or args.torch
    unset = [] if args.weights else unset_statistics(net)
    if unset:           # checked with stand-in statistics, written with the net's own
        saved = [[np.array(b.data) for b in node.layer.blobs] for node in unset]
        for node in unset:
            node.layer.blobs[1].data[...] = 1
            node.layer.blobs[2].data[...] = 1
        diffs = exporter.export(net, None, args.rtol)[-1]
        for node, arrays in zip(unset, saved):
            for b, a in zip(node.layer.blobs, arrays):
                b.data[...] = a
        exporter.export(net, out, None)
    else:
        diffs = exporter.export(net, out, args.rtol)[-1]
    print(f"sncaffe export: {args.net} ({net.name or 'net'}), phase {args.phase}, "
          f"{len(net.graph.layers)} layers -> {out}")
    print(f"inputs: {', '.join(f'{n} {tuple(net.blobs[n].data.shape)}' for n in net.inputs)}")
    print(f"{what} against sncaffe on a random batch (tolerance {args.rtol:g}):")
    for d in diffs:
        print(d)
    if unset:
        print(f"({len(unset)} BatchNorm layers hold no statistics (moving-average factor 0): checked with mean 0 "
              "and variance 1, written as they are)")
    return 0


def unset_statistics(net) -> list:
    """BatchNorm layers whose statistics were never accumulated: an untrained net's, which at
    TEST divide by sqrt(eps) and overflow a deep net's outputs."""
    return [n for n in net.graph.layers if n.type == "BatchNorm" and n.layer.use_global_stats
            and not np.any(n.layer.blobs[2].data)]
