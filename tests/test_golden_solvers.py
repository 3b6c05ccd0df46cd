"""The eight solver cases trained by real Caffe (tests/data/shared/golden/solvers), reproduced by Solver.

Each case is trained from its solver.prototxt in a copy of its folder, from
nets/lenet/weights.caffemodel as ``caffe train -weights`` does, and compared
with Caffe's log (loss and lr per iteration, printed to 6 digits) and with
Caffe's iteration-3 and iteration-6 snapshots; then resumed from Caffe's own
lenet_iter_3.solverstate up to Caffe's iteration 6.

Tolerance: rtol 1e-5 plus an atol of 1e-5 times the blob's largest value. The
adaptive solvers divide by the root of a tiny history where a ReLU unit sits
at zero, so float32 rounding there is amplified: for AdaGrad, RMSProp and Adam
a few elements (measured: 1 to 4 of 57k) may be off by up to 2e-4 of the blob's
scale; everything else must meet 1e-5.
"""
import math
import shutil

import numpy as np
import pytest

from conftest import SHARED, needs_shared
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.solver import Solver

pytestmark = needs_shared

GOLDEN = SHARED / "golden" if SHARED else None
CASES = ["sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam", "sgd_inv_itersize2_clip", "sgd_l1"]
ADAPTIVE = {"adagrad", "rmsprop", "adam"}
TOL = 1e-5


def case_dir(case):
    return GOLDEN / "solvers" / case


def run_case(case, folder, monkeypatch, resume=False):
    """Train in a copy of the case folder; returns [(loss, lr) per iteration] and the final forward's loss."""
    for f in ("solver.prototxt", "net.prototxt", "train.h5", "train.txt"):
        shutil.copy(case_dir(case) / f, folder)
    if resume:
        for f in ("lenet_iter_3.caffemodel", "lenet_iter_3.solverstate"):
            shutil.copy(case_dir(case) / f, folder)
    monkeypatch.chdir(folder)
    solver = Solver("solver.prototxt", weights=None if resume else str(GOLDEN / "nets/lenet/weights.caffemodel"))
    seen = []
    solver.callbacks.append(lambda it, loss, lr: seen.append((loss, lr)))
    solver.solve("lenet_iter_3.solverstate" if resume else None)
    return seen, solver.smoothed_loss


def printed(path):
    """Caffe's `<iter> <value>` lines."""
    return {int(i): float(v) for i, v in (line.split() for line in path.read_text().splitlines())}


def same_printed(mine, caffe):
    """``caffe`` is a 6-digit print of Caffe's value: allow its rounding plus rtol 1e-5."""
    half_digit = 0.5 * 10 ** (math.floor(math.log10(abs(caffe))) - 5)
    return abs(mine - caffe) <= TOL * abs(caffe) + half_digit


def blobs(path, message):
    m = message.FromString(path.read_bytes())
    items = m.history if message is pb.SolverState else [b for layer in m.layer for b in layer.blobs]
    return [np.asarray(b.data, np.float32).reshape(tuple(b.shape.dim)) for b in items]


def compare(case, mine_path, caffe_path, message):
    """Max error relative to each blob's scale; asserts the tolerance described above."""
    mine, caffe = blobs(mine_path, message), blobs(caffe_path, message)
    assert [a.shape for a in mine] == [b.shape for b in caffe], mine_path.name
    worst, loose = 0.0, 0
    for a, b in zip(mine, caffe):
        scale = max(float(np.abs(b).max()), 1e-30)
        err = np.abs(a.astype(np.float64) - b)
        worst = max(worst, float(err.max()) / scale)
        loose += int(np.count_nonzero(err > TOL * np.abs(b) + TOL * scale))
    if case in ADAPTIVE:
        assert loose <= 10 and worst <= 2e-4, (case, mine_path.name, loose, worst)
    else:
        assert loose == 0, (case, mine_path.name, loose, worst)
    return worst


@pytest.mark.parametrize("case", CASES)
def test_training_reproduces_caffe(case, tmp_path, monkeypatch):
    seen, final_loss = run_case(case, tmp_path, monkeypatch)
    losses, lrs = printed(case_dir(case) / "loss.txt"), printed(case_dir(case) / "lr.txt")
    assert len(seen) == 6
    for it, (loss, lr) in enumerate(seen):
        assert same_printed(loss, losses[it]), (case, it, loss, losses[it])
        assert same_printed(lr, lrs[it]), (case, it, lr, lrs[it])
    assert same_printed(final_loss, losses[6])     # Solve's extra forward pass, on the next batch
    for it in (3, 6):
        compare(case, tmp_path / f"lenet_iter_{it}.caffemodel", case_dir(case) / f"lenet_iter_{it}.caffemodel",
                pb.NetParameter)
        compare(case, tmp_path / f"lenet_iter_{it}.solverstate", case_dir(case) / f"lenet_iter_{it}.solverstate",
                pb.SolverState)
        state = pb.SolverState.FromString((tmp_path / f"lenet_iter_{it}.solverstate").read_bytes())
        caffe = pb.SolverState.FromString((case_dir(case) / f"lenet_iter_{it}.solverstate").read_bytes())
        assert (state.iter, state.learned_net, state.current_step) == \
               (caffe.iter, caffe.learned_net, caffe.current_step)


@pytest.mark.parametrize("case", CASES)
def test_resuming_from_caffes_solverstate_reaches_caffes_iteration_6(case, tmp_path, monkeypatch):
    seen, final_loss = run_case(case, tmp_path, monkeypatch, resume=True)
    losses = printed(case_dir(case) / "loss.txt")
    assert len(seen) == 3
    for it, (loss, _) in enumerate(seen, start=3):
        assert same_printed(loss, losses[it]), (case, it, loss, losses[it])
    assert same_printed(final_loss, losses[6])
    compare(case, tmp_path / "lenet_iter_6.caffemodel", case_dir(case) / "lenet_iter_6.caffemodel", pb.NetParameter)
    compare(case, tmp_path / "lenet_iter_6.solverstate", case_dir(case) / "lenet_iter_6.solverstate", pb.SolverState)
