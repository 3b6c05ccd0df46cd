"""Property-based fuzzing of everything a user hands sncaffe.

Mutated prototxt text, binary NetParameter/.caffemodel, .solverstate, BlobProto mean files and
Datum records must each end in a valid result or an error sncaffe raises on purpose (a class of
its own, or a ValueError/RuntimeError raised in sncaffe's code, which the CLI prints as one
line), within a bounded time: never another exception (UnicodeDecodeError, ZeroDivisionError,
IndexError, protobuf's own), never a hang.

The default run is short. A long run:
    SNCAFFE_FUZZ_EXAMPLES=2000 SNCAFFE_FUZZ_REPORT=fuzz.json python -m pytest -q tests/test_fuzz.py
runs that many cases per target (six targets) and writes the outcome counts to the JSON file.
"""
import collections
import json
import os
import signal
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import sncaffe
from sncaffe import blobproto
from sncaffe.data import datum as datums
from sncaffe.data.transform import read_mean
from sncaffe.graph import build_graph
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import prepare_net, read_text

EXAMPLES = int(os.environ.get("SNCAFFE_FUZZ_EXAMPLES", "60"))
CASE_SECONDS = 10                       # a case running longer is a hang
PACKAGE = str(Path(sncaffe.__file__).parent)
COUNTS = collections.defaultdict(collections.Counter)

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100, database=None,
                suppress_health_check=list(HealthCheck))

NET = """name: "fuzz"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 12 dim: 12 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 stride: 1 pad: 1 group: 1
                            weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "lrn" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 } }
layer { name: "slice" type: "Slice" bottom: "norm1" top: "s1" top: "s2" slice_param { axis: 1 slice_point: 2 } }
layer { name: "cat" type: "Concat" bottom: "s1" bottom: "s2" top: "cat" concat_param { axis: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "cat" bottom: "norm1" top: "sum" }
layer { name: "flat" type: "Reshape" bottom: "sum" top: "flat" reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "flat" top: "ip1" inner_product_param { num_output: 10 } }
layer { name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip1" bottom: "label" top: "acc" include { phase: TEST } }
"""

TOKENS = [b"{", b"}", b":", b'"', b"#", b"layer", b"layer {", b"dim: ", b"-", b"0", b"-4", b"2147483648",
          b"99999999999999999999", b"1e400", b"nan", b"inf", b"\n" * 200, b" " * 50, b"\x91", b"\xff\xfe",
          b"\x00", b"\\", b"'", b"top: ", b"bottom: ", b'name: "x"', b"type: \"Input\"", b"num_output: ",
          b"kernel_size: ", b"stride: ", b"pad: ", b"group: ", b"axis: ", b"slice_point: ", b"phase: TEST",
          b"include { phase: TRAIN }", b"loss_weight: ", b"propagate_down: ", b"param { lr_mult: 0 }",
          "é".encode(), b"\t", b"\r\n", b"layers {", b"input: \"z\"", b"input_dim: 0"]
NUMBERS = [0, -1, 1, 2, 3, -4, 7, 100, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 10**12]


def is_sncaffe_error(e: BaseException) -> bool:
    """Raised on purpose by sncaffe: its own class, or a plain ValueError/RuntimeError/OSError
    whose raise statement is in sncaffe's code (the CLI prints these as one line)."""
    if type(e).__module__.startswith("sncaffe"):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    here = tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE)
    return here and type(e) in (ValueError, RuntimeError, FileNotFoundError, MemoryError)


class Hang(BaseException):
    pass


@contextmanager
def bounded(seconds=CASE_SECONDS):
    def alarm(signum, frame):
        raise Hang(f"over {seconds} s")
    saved = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, saved)


def outcome(target, fn, *args):
    """Run one case; count its outcome; fail on anything but a result or a sncaffe error."""
    try:
        with bounded():
            fn(*args)
    except Hang:
        COUNTS[target]["hang"] += 1
        raise AssertionError(f"{target}: a case ran over {CASE_SECONDS} s")
    except Exception as e:  # noqa: BLE001 - the point: classify every exception
        if is_sncaffe_error(e) and target in NAMED and NAMED[target] not in str(e):
            COUNTS[target]["unnamed " + type(e).__name__] += 1
            raise AssertionError(f"{target}: the error does not name the {NAMED[target]}: {e}")
        if not is_sncaffe_error(e):
            COUNTS[target]["crash " + type(e).__name__] += 1
            raise AssertionError(f"{target}: {type(e).__name__} escaped: {e}\n"
                                 + "".join(traceback.format_exception(e)[-6:])) from None
        COUNTS[target]["error " + type(e).__name__] += 1
        return
    COUNTS[target]["accepted"] += 1


# What an error about each input must name (the datum: the record, as a Data layer says it).
NAMED = {"caffemodel": "w.caffemodel", "solverstate": "seed_iter_0", "mean file": "mean.binaryproto",
         "datum": "record 7", "prototxt": "net.prototxt", "prototxt numbers": "renumbered.prototxt"}


@st.composite
def mutated(draw, seed: bytes, tokens=True):
    """``seed`` with a few random edits: bytes replaced, spans cut, tokens and numbers inserted,
    lines duplicated."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["byte", "cut", "token", "number", "number", "number", "dup"] if tokens
                                    else ["byte", "cut", "dup"]))
        if kind == "byte" and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:at + draw(st.integers(1, 40))]
        elif kind == "token":
            data[at:at] = draw(st.sampled_from(TOKENS))
        elif kind == "number":
            digits = bytes(c for c in data if 48 <= c <= 57)
            spans = [i for i in range(len(data)) if 48 <= data[i] <= 57 and (i == 0 or not 48 <= data[i - 1] <= 57)]
            if spans and digits:
                i = spans[at % len(spans)]
                j = i
                while j < len(data) and 48 <= data[j] <= 57:
                    j += 1
                data[i:j] = str(draw(st.sampled_from(NUMBERS))).encode()
        elif kind == "dup":
            lines = bytes(data).split(b"\n")
            k = at % max(len(lines), 1)
            lines.insert(k, lines[k] if lines else b"")
            data = bytearray(b"\n".join(lines))
    return bytes(data)


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    path = os.environ.get("SNCAFFE_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps({k: dict(v) for k, v in COUNTS.items()}, indent=1, sort_keys=True))


# -- prototxt ------------------------------------------------------------------------

RUN_BYTES = 16 << 20          # an accepted net this small is also run: forward and backward once


def build_net_file(path):
    from sncaffe.backend import make_device
    from sncaffe.net import Net
    for phase in ("TRAIN", "TEST"):
        graph = build_graph(prepare_net(read_text(path, pb.NetParameter()), phase), 0 if phase == "TRAIN" else 1)
    if sum(t.nbytes for t in graph.tensors()) <= RUN_BYTES:
        net = Net(path, "TRAIN", device=make_device("cpu", "64MiB"))
        for name in net.inputs:
            net.blobs[name].data[...] = 1
        net.forward()
        net.backward()
        net.release()


@FUZZ
@given(text=mutated(NET.encode()))
def test_mutated_prototxt_builds_or_fails_cleanly(folder, text):
    path = folder / "net.prototxt"
    path.write_bytes(text)
    outcome("prototxt", build_net_file, path)


def _numeric_fields(msg, out):
    """(message, field descriptor) of every number set in ``msg``, recursively."""
    for fd, value in msg.ListFields():
        if fd.message_type is not None:
            for m in (value if _repeated(fd) else [value]):
                _numeric_fields(m, out)
        elif fd.cpp_type in (fd.CPPTYPE_INT32, fd.CPPTYPE_INT64, fd.CPPTYPE_UINT32, fd.CPPTYPE_UINT64,
                             fd.CPPTYPE_FLOAT, fd.CPPTYPE_DOUBLE):
            out.append((msg, fd))
    return out


def _repeated(fd):
    r = getattr(fd, "is_repeated", None)
    return r if r is not None else fd.label == fd.LABEL_REPEATED


@st.composite
def renumbered(draw):
    """The seed net with a few of its numbers (dims, sizes, axes, ratios, weights) replaced."""
    net = text_format.Parse(NET, pb.NetParameter())
    fields = _numeric_fields(net, [])
    for _ in range(draw(st.integers(1, 3))):
        msg, fd = fields[draw(st.integers(0, len(fields) - 1))]
        value = draw(st.sampled_from(NUMBERS + [0.5, -0.5, 1e30, float("nan"), float("inf")]))
        if fd.cpp_type not in (fd.CPPTYPE_FLOAT, fd.CPPTYPE_DOUBLE):
            value = int(value) if np.isfinite(value) else 0
        try:
            if _repeated(fd):
                seq = getattr(msg, fd.name)
                seq[draw(st.integers(0, len(seq) - 1))] = value
            else:
                setattr(msg, fd.name, value)
        except (ValueError, TypeError):     # out of the field's range: the text parser refuses those
            pass
    return text_format.MessageToString(net).encode()


@FUZZ
@given(text=renumbered())
def test_renumbered_prototxt_builds_or_fails_cleanly(folder, text):
    path = folder / "renumbered.prototxt"
    path.write_bytes(text)
    outcome("prototxt numbers", build_net_file, path)


# -- binary files ------------------------------------------------------------------------

def _tiny_solver(folder):
    from sncaffe.solvers import Solver
    p = text_format.Parse('base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" random_seed: 1 max_iter: 1 '
                          f'snapshot_prefix: "{folder / "seed"}"', pb.SolverParameter())
    text_format.Parse(NET.replace("dim: 12 dim: 12", "dim: 6 dim: 6"), p.net_param)
    return Solver(p)


@pytest.fixture(scope="module")
def seeds(folder):
    s = _tiny_solver(folder)
    model, state = s.snapshot()
    mean = blobproto.from_array(np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)).SerializeToString()
    datum = datums.from_array(np.arange(12, dtype=np.uint8).reshape(3, 2, 2), 5).SerializeToString()
    return Seeds(solver=s, model=Path(model).read_bytes(), state=Path(state).read_bytes(), mean=mean, datum=datum)


class Seeds(dict):
    def __repr__(self):                 # hypothesis prints its arguments; the bytes are long
        return "<seed files>"


def _load_weights(s, path):
    s.net.copy_from(str(path))


def _restore(s, path):
    s.restore(str(path))


def _read_datum(raw):
    d = datums.parse(raw, "record 7")
    datums.to_array(d, None, "record 7")


@FUZZ
@given(case=st.data())
def test_mutated_caffemodel_loads_or_fails_cleanly(folder, seeds, case):
    data = case.draw(mutated(seeds["model"], tokens=False))
    path = folder / "w.caffemodel"
    path.write_bytes(data)
    outcome("caffemodel", _load_weights, seeds["solver"], path)


@FUZZ
@given(case=st.data())
def test_mutated_solverstate_restores_or_fails_cleanly(folder, seeds, case):
    data = case.draw(mutated(seeds["state"], tokens=False))
    path = folder / "seed_iter_0.solverstate"
    path.write_bytes(data)
    outcome("solverstate", _restore, seeds["solver"], path)


@FUZZ
@given(case=st.data())
def test_mutated_mean_file_reads_or_fails_cleanly(folder, seeds, case):
    data = case.draw(mutated(seeds["mean"], tokens=False))
    path = folder / "mean.binaryproto"
    path.write_bytes(data)
    outcome("mean file", read_mean, path)


@FUZZ
@given(case=st.data())
def test_mutated_datum_decodes_or_fails_cleanly(seeds, case):
    outcome("datum", _read_datum, case.draw(mutated(seeds["datum"], tokens=False)))
