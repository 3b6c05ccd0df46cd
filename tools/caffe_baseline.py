"""Real Caffe against sncaffe on the same prototxt, where a `caffe` binary is on PATH (or $CAFFE_BIN).

    python tools/caffe_baseline.py prototxt/cifar10_resnet.prototxt [--batch 32] [--iterations 10]

Two checks, each run the same way through both command-line tools, one thread each
(OPENBLAS/OMP/MKL_NUM_THREADS=1 in their environment):

time     `caffe time -model NET -iterations N` and `sncaffe time NET -n N` on the TRAIN net
         (Input layers; data and label layers given in --input become Input layers):
         "Average Forward-Backward" of each, and images/s.
outputs  the net's initial weights (sncaffe's fillers) written to a .caffemodel, one
         batch of N(0, 1) data and labels written to an HDF5 file, and the TEST net with
         an HDF5Data layer in place of its Input layer: `caffe test -model NET -weights W
         -iterations 1` and `sncaffe test NET --weights W -n 1`; every output both print
         (loss, accuracy, ...) compared within a relative 1e-4.

Without a `caffe` binary everything is reported as skipped (exit status 0): CPU-only
builds of BVLC Caffe 1.0 (e.g. Debian's caffe-cpu package) provide one.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ONE_THREAD = {v: "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
RTOL = 1e-4
_FB = re.compile(r"Average Forward-Backward:\s*([0-9.eE+-]+)\s*ms")
_OUTPUT = re.compile(r"\]\s+(?!Batch )([^\s=]+) = ([-+0-9.eEnainf]+)(?:\s+\(\*|\s*$)")


def find_caffe():
    """The `caffe` executable: $CAFFE_BIN, else `caffe` on PATH; None where there is none."""
    exe = os.environ.get("CAFFE_BIN") or shutil.which("caffe")
    return Path(exe) if exe and Path(exe).is_file() and os.access(exe, os.X_OK) else None


def sncaffe_cmd():
    exe = Path(sys.executable).with_name("sncaffe")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "sncaffe.cli"]


def run(cmd, timeout=3600, env=None) -> str:
    """stdout + stderr of ``cmd`` (glog writes to stderr), one thread; an error names the command."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **ONE_THREAD, "GLOG_logtostderr": "1", **(env or {})})
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
    return r.stdout + r.stderr


def caffe_blas(exe) -> str:
    """The BLAS library the `caffe` binary (or its libcaffe) links, from ldd; '?' where unknown."""
    try:
        out = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, timeout=60).stdout
        libs = {line.split()[0] for line in out.splitlines() if line.strip()}
        caffe_libs = [line.split("=>")[1].split()[0] for line in out.splitlines() if "libcaffe" in line and "=>" in line]
        for lib in caffe_libs:
            libs |= {line.split()[0] for line in subprocess.run(["ldd", lib], capture_output=True, text=True,
                                                                 timeout=60).stdout.splitlines() if line.strip()}
    except (OSError, subprocess.SubprocessError):
        return "?"
    for name in ("openblas", "mkl", "atlas", "blis", "libblas"):
        if any(name in lib for lib in libs):
            return name
    return "?"


def forward_backward_ms(log: str) -> float:
    """'Average Forward-Backward: X ms' of `caffe time` (and `sncaffe time`)."""
    m = _FB.findall(log)
    if not m:
        raise ValueError("no 'Average Forward-Backward' line in the output")
    return float(m[-1])


def test_outputs(log: str) -> dict:
    """The averaged outputs `caffe test` (and `sncaffe test`) print last: name -> value."""
    out = {}
    for line in log.splitlines():
        m = _OUTPUT.search(line)
        if m:
            out[m.group(1)] = float(m.group(2))       # later lines (the averages) win
    return out


def batch_of(param) -> int:
    return next(int(s.dim[0]) for lp in param.layer if lp.type == "Input" for s in lp.input_param.shape)


def hdf5_net(param, source):
    """``param`` with its Input layer read from an HDF5 file list instead (batch kept)."""
    from sncaffe.proto import sncaffe_pb2 as pb
    out = pb.NetParameter()
    out.CopyFrom(param)
    for lp in out.layer:
        if lp.type == "Input":
            batch = int(lp.input_param.shape[0].dim[0])
            lp.ClearField("input_param")
            lp.type = "HDF5Data"
            lp.hdf5_data_param.source = str(source)
            lp.hdf5_data_param.batch_size = batch
    return out


def write_inputs(param, path, seed=0):
    """One batch for the Input layer's tops: data N(0, 1), labels below the class count.

    The returned net has run one TRAIN forward pass on that batch, so its BatchNorm layers hold
    that batch's statistics: a fresh net's global statistics are zero, and the TEST net would
    divide by sqrt(eps) at every BatchNorm until the loss overflows to NaN."""
    import h5py
    from sncaffe import Net
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.data.synthetic import SyntheticInputs
    net = Net(param, "TRAIN", device=CPUDevice())
    SyntheticInputs(seed)(net)
    net.forward()
    with h5py.File(path, "w") as f:
        for name in net.inputs:
            f[name] = np.asarray(net.blobs[name].data, np.float32)
    return net


def compare(param, exe=None, iterations=10, workdir=None) -> dict:
    """Caffe and sncaffe on ``param`` (a TRAIN NetParameter with Input layers): times and outputs."""
    from google.protobuf import text_format
    exe = exe or find_caffe()
    if exe is None:
        return {"skipped": "no `caffe` binary on PATH (or $CAFFE_BIN)"}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(workdir or tmp)
        d.mkdir(parents=True, exist_ok=True)
        batch = batch_of(param)
        train = d / "train.prototxt"
        train.write_text(text_format.MessageToString(param))
        caffe_ms = forward_backward_ms(run([exe, "time", "-model", train, "-iterations", iterations]))
        sncaffe_ms = forward_backward_ms(run([*sncaffe_cmd(), "time", train, "-n", iterations]))
        # Caffe's CPU build runs on the system's OpenBLAS: sncaffe on OpenBLAS too, beside its default
        openblas_ms = forward_backward_ms(run([*sncaffe_cmd(), "time", train, "-n", iterations],
                                              env={"SNCAFFE_BLAS": "openblas"}))
        net = write_inputs(param, d / "inputs.h5")
        (d / "inputs.txt").write_text(str(d / "inputs.h5") + "\n")
        net.save(d / "weights.caffemodel")
        test = d / "test.prototxt"
        test.write_text(text_format.MessageToString(hdf5_net(param, d / "inputs.txt")))
        caffe_out = test_outputs(run([exe, "test", "-model", test, "-weights", d / "weights.caffemodel",
                                      "-iterations", 1]))
        ours = test_outputs(run([*sncaffe_cmd(), "test", test, "--weights", d / "weights.caffemodel", "-n", 1]))
    from sncaffe.backend import blas
    return {"caffe_ms": caffe_ms, "sncaffe_ms": sncaffe_ms, "images_per_s": batch * 1e3 / caffe_ms,
            "sncaffe_images_per_s": batch * 1e3 / sncaffe_ms, "sncaffe_blas": blas.BLAS.describe(),
            "sncaffe_openblas_ms": openblas_ms, "sncaffe_openblas_images_per_s": batch * 1e3 / openblas_ms,
            "caffe_blas": caffe_blas(exe), "caffe_outputs": caffe_out,
            "sncaffe_outputs": ours, "outputs": outputs_verdict(caffe_out, ours)}


def outputs_verdict(caffe_out: dict, ours: dict) -> str:
    """'agree' when both printed the same finite outputs within RTOL; else what is wrong.

    A NaN or infinite output fails even when both frameworks print it: timing a net whose loss is
    NaN is not timing a training step."""
    bad = {f"{who}:{k}": v for who, out in (("caffe", caffe_out), ("sncaffe", ours))
           for k, v in out.items() if not np.isfinite(v)}
    if bad:
        return f"NOT FINITE {bad}"
    if not caffe_out or set(caffe_out) != set(ours):
        return f"DIFFER (outputs caffe {sorted(caffe_out)}, sncaffe {sorted(ours)})"
    diffs = {k: abs(ours[k] - v) / max(abs(v), 1e-12) for k, v in caffe_out.items()}
    return "agree" if max(diffs.values()) <= RTOL else f"DIFFER (relative {diffs})"


def main(argv=None) -> int:
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import read_text, replace_data_layers, set_batch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("net", help="a TRAIN net prototxt")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--input", help="C,H,W of the data top when the net has a data layer (e.g. 1,28,28)")
    ap.add_argument("--iterations", type=int, default=10)
    args = ap.parse_args(argv)
    exe = find_caffe()
    if exe is None:
        print("real Caffe: skipped (no `caffe` binary on PATH or in $CAFFE_BIN)")
        return 0
    param = read_text(args.net, pb.NetParameter())
    if args.input:
        n = args.batch or 1
        param = replace_data_layers(param, {"data": (n, *map(int, args.input.split(","))), "label": (n,)})
    if args.batch:
        param = set_batch(param, args.batch)
    r = compare(param, exe, args.iterations)
    print(f"{exe}: {r['caffe_ms']:.1f} ms per forward-backward ({r['images_per_s']:.1f} images/s); "
          f"sncaffe {r['sncaffe_ms']:.1f} ms ({r['sncaffe_images_per_s']:.1f} images/s); "
          f"sncaffe / caffe throughput {r['caffe_ms'] / r['sncaffe_ms']:.2f} (Caffe on {r['caffe_blas']}, "
          f"sncaffe on {r['sncaffe_blas']}); both on OpenBLAS: sncaffe {r['sncaffe_openblas_ms']:.1f} ms, "
          f"ratio {r['caffe_ms'] / r['sncaffe_openblas_ms']:.2f}")
    print(f"outputs given the same .caffemodel: {r['outputs']}: caffe {r['caffe_outputs']}, "
          f"sncaffe {r['sncaffe_outputs']}")
    return 0 if r["outputs"] == "agree" else 1


if __name__ == "__main__":
    sys.exit(main())
