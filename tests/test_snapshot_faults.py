"""Snapshots under faults: a pair is written as one unit, a failed write names
its path and keeps the previous pair, leftovers are removed at the next start, SIGTERM snapshots."""
import os
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from sncaffe import blobproto
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.solvers import Solver
from sncaffe.solvers.snapshot_files import SnapshotWriteError, clean, latest, pairs

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))

NET = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 512 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: {outputs} weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def solver_param(prefix, outputs=4, max_iter=4, snapshot=0):
    p = text_format.Parse(f'base_lr: 0.01 lr_policy: "fixed" random_seed: 1 max_iter: {max_iter} '
                          f'snapshot: {snapshot} snapshot_prefix: "{prefix}"', pb.SolverParameter())
    text_format.Parse(NET.replace("{outputs}", str(outputs)), p.net_param)
    return p


def temps(folder):
    return sorted(p.name for p in Path(folder).iterdir() if ".tmp" in p.name)


def loadable(prefix):
    """The newest pair restores into a fresh solver."""
    model, state = latest(str(prefix))
    s = Solver(solver_param(prefix, outputs=_outputs(model)))
    s.restore(state)
    return s.iter


def _outputs(model):
    return len(blobproto.read_caffemodel(model).layer[1].blobs[1].data)


def test_a_write_that_fails_names_the_path_and_keeps_the_previous_pair(tmp_path):
    prefix = tmp_path / "snap" / "t"
    prefix.parent.mkdir()
    s = Solver(solver_param(prefix))
    s.feed = lambda net, i: None
    s.step(1)
    s.snapshot()
    s.step(1)
    saved = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a write past the limit fails with EFBIG
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limit[1]))
    try:
        with pytest.raises(SnapshotWriteError) as e:
            s.snapshot()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, saved)
    assert str(e.value).startswith(f"cannot write snapshot {prefix}_iter_2.caffemodel: File too large")
    assert f"the last good snapshot is {prefix}_iter_1.solverstate" in str(e.value)
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["t_iter_1.caffemodel", "t_iter_1.solverstate"]
    assert loadable(prefix) == 1


def test_a_snapshot_folder_that_went_away_is_named(tmp_path):
    prefix = tmp_path / "gone" / "t"
    prefix.parent.mkdir()
    s = Solver(solver_param(prefix))
    prefix.parent.rmdir()
    with pytest.raises(SnapshotWriteError, match=f"cannot write snapshot {prefix}_iter_0.caffemodel: "
                                                 "No such file or directory; no snapshot was written"):
        s.snapshot()


def test_temporary_files_of_killed_snapshots_are_removed_at_start_and_nothing_else(tmp_path):
    prefix = tmp_path / "t"
    s = Solver(solver_param(prefix, max_iter=2))
    s.feed = lambda net, i: None
    s.snapshot()
    dead = 2**22 + 12345                                       # over pid_max's default: no such process
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    leftovers = [f"t_iter_5.caffemodel.tmp{dead}", f"t_iter_5.solverstate.tmp{dead}"]
    live = f"t_iter_9.caffemodel.tmp{os.getppid()}"             # another process, still writing
    kept = ["t_iter_7.caffemodel",                              # killed between the two renames, or a user's
            "t_iter_0.notes", f"t_iter_0.notes.tmp{dead}"]      # not a snapshot's name
    for name in leftovers + [live] + kept:
        (tmp_path / name).write_bytes(b"partial")
    s.solve()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not set(leftovers) & set(names) and {live, *kept} <= set(names)
    assert (tmp_path / "t_iter_7.caffemodel").read_bytes() == b"partial"
    assert [n for n, _, _ in pairs(str(prefix))] == [0, 2]


def _user_models(folder):
    """Two .caffemodel files of the user's under the snapshot prefix, with no .solverstate."""
    s = Solver(solver_param(folder / "lenet", max_iter=0))
    s.feed = lambda net, i: None
    for n in (10, 20):
        s.iter = n
        s.snapshot()
        os.remove(folder / f"lenet_iter_{n}.solverstate")
    return {n: (folder / f"lenet_iter_{n}.caffemodel").read_bytes() for n in (10, 20)}


def test_train_keeps_the_users_caffemodels_under_its_snapshot_prefix(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    before = _user_models(out)
    p = solver_param("out/lenet", max_iter=2)
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(p))
    argv = [sys.executable, "-m", "sncaffe.cli", "train", "solver.prototxt",
            "--weights", "out/lenet_iter_20.caffemodel"]
    run = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for n, data in before.items():
        assert (out / f"lenet_iter_{n}.caffemodel").read_bytes() == data
    assert "interrupted snapshot" not in run.stdout + run.stderr
    assert [n for n, _, _ in pairs(str(out / "lenet"))] == [2]


def test_models_whose_solverstates_were_deleted_are_kept_and_not_resumed_from(tmp_path):
    before = _user_models(tmp_path)
    s = Solver(solver_param(tmp_path / "lenet", max_iter=2))
    s.feed = lambda net, i: None
    s.solve()
    assert s.iter == 2 and latest(str(tmp_path / "lenet"))[1].endswith("lenet_iter_2.solverstate")
    for n, data in before.items():
        assert (tmp_path / f"lenet_iter_{n}.caffemodel").read_bytes() == data


def _train(folder, resume=None):
    argv = [sys.executable, "-m", "sncaffe.cli", "train", "solver.prototxt"]
    if resume:
        argv += ["--snapshot", resume]
    return subprocess.Popen(argv, cwd=folder, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_9_during_snapshots_always_leaves_a_loadable_newest_pair(tmp_path):
    # A bigger layer (2 MB of parameters) so the kill often lands inside a write.
    p = solver_param("snap/t", outputs=1000, max_iter=10**6, snapshot=1)
    p.display = 1
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(p))
    (tmp_path / "snap").mkdir()
    rng = random.Random(0)
    resume = None
    for k in range(5):
        job = _train(tmp_path, resume)
        try:
            seen, want = 0, rng.randint(1, 3)
            for line in job.stdout:
                seen += "Snapshotting to binary proto file" in line
                if seen == want:
                    break
            assert seen == want, "training ended before its snapshots"
            if k % 2:
                os.kill(job.pid, signal.SIGKILL)               # inside the write
            else:
                import time
                time.sleep(rng.random() * 0.05)                # near it
                os.kill(job.pid, signal.SIGKILL)
            job.wait(30)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait(30)
        assert latest(str(tmp_path / "snap/t")) is not None
        resume = latest(str(tmp_path / "snap/t"))[1]
        state = blobproto.read_binary(tmp_path / resume, pb.SolverState())
        assert state.iter > 0 and len(state.history) == 2
    # The next start removes what the kills left, and resumes from the newest pair.
    s = Solver(solver_param(tmp_path / "snap" / "t", outputs=1000, max_iter=0))
    s.solve(str(tmp_path / resume))
    assert temps(tmp_path / "snap") == []
    assert s.iter == blobproto.read_binary(tmp_path / resume, pb.SolverState()).iter
    model = [n for _, n, st in pairs(str(tmp_path / "snap" / "t")) if st.endswith(Path(resume).name)][0]
    assert np.array_equal(s.net.params["ip"][0].data,
                          blobproto.to_array(blobproto.read_caffemodel(model).layer[1].blobs[0]))


def test_sigterm_snapshots_and_stops_like_sigint(tmp_path):
    p = solver_param("snap/t", max_iter=10**6)
    p.display = 1
    (tmp_path / "solver.prototxt").write_text(text_format.MessageToString(p))
    job = _train(tmp_path)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if "Iteration 3 (" in line:
            job.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    assert "SIGTERM: snapshotting and stopping" in out and "Optimization stopped early." in out
    assert latest(str(tmp_path / "snap" / "t")) is not None


def test_a_snapshot_taking_the_name_of_a_lone_caffemodel_moves_it_aside(tmp_path, caplog):
    before = _user_models(tmp_path)
    s = Solver(solver_param(tmp_path / "lenet", max_iter=10))
    s.feed = lambda net, i: None
    s.solve()                                               # its last snapshot: lenet_iter_10
    assert latest(str(tmp_path / "lenet"))[1].endswith("lenet_iter_10.solverstate")
    assert (tmp_path / "lenet_iter_10.kept.caffemodel").read_bytes() == before[10]
    assert (tmp_path / "lenet_iter_10.caffemodel").read_bytes() != before[10]
    assert "lenet_iter_10.caffemodel was there without a .solverstate: kept as" in caplog.text
    s.solve()                                               # again: a complete pair is replaced, as in Caffe
    assert sorted(p.name for p in tmp_path.glob("*.kept*")) == ["lenet_iter_10.kept.caffemodel"]


def test_signals_with_the_disk_tier_on_lose_no_file_and_leave_a_loadable_pair(tmp_path):
    """A sample of tools/fault_inject.py under glibc's heap checks (MALLOC_CHECK_=3): a SIGTERM in
    every phase (planning, binding, the first forward, training with offloads going to the spill
    file, a snapshot write), each run resuming from the pair the runs before it left, then a
    SIGKILL while training."""
    sys.path.insert(0, str(ROOT / "tools"))
    import fault_inject
    fault_inject.setup(tmp_path)
    env = dict(ENV, MALLOC_CHECK_="3")
    runs = {}
    plan = [("SIGTERM", phase) for phase in ("planning", "binding", "first forward", "snapshot", "training")]
    for sig, phase in plan + [("SIGKILL", "training")]:
        r = fault_inject.run_once(tmp_path, sig, phase, random.Random(3), env)
        assert r["entered"] and not r["stuck"] and not r["heap"], (sig, phase, r["out"][-3000:])
        assert not r["traceback"], (sig, phase, r["out"][-3000:])
        assert fault_inject.lost(tmp_path) == [], r["out"][-3000:]
        assert fault_inject.check_pair(tmp_path) == ""
        runs[sig, phase] = r
    first = runs["SIGTERM", "snapshot"]
    assert first["rc"] == 0 and "SIGTERM: snapshotting and stopping" in first["out"], first["out"][-3000:]
    assert "disk peak" in first["out"] and "Restoring previous solver status" in runs["SIGTERM", "training"]["out"]
    assert latest(str(tmp_path / "snap" / "t")) is not None


def test_a_database_damaged_while_training_stops_it_with_a_snapshot_of_what_was_trained(tmp_path):
    from sncaffe.data import datum as datums
    from sncaffe.data.db import LMDBWriter
    from sncaffe.layers.base import DataReadError
    rng = np.random.default_rng(0)
    with LMDBWriter(tmp_path / "db") as db:
        for i in range(300):
            record = datums.from_array(rng.integers(0, 256, (1, 28, 28), np.uint8), i % 4)
            db.put(f"{i:05d}", record.SerializeToString())
    p = text_format.Parse(f'base_lr: 0.01 lr_policy: "fixed" max_iter: 1000 snapshot_prefix: "{tmp_path}/t"',
                          pb.SolverParameter())
    text_format.Parse(f'name: "d" layer {{ name: "src" type: "Data" top: "data" top: "label" data_param {{ '
                      f'source: "{tmp_path}/db" batch_size: 10 backend: LMDB }} }}'
                      + NET[NET.index('layer { name: "ip"'):].replace("{outputs}", "4"), p.net_param)
    s = Solver(p)

    def damage(iteration, loss, rate):
        if iteration == 5:
            with open(tmp_path / "db" / "data.mdb", "r+b") as f:
                f.seek(int(f.seek(0, 2) * 0.3) // 4096 * 4096)
                f.write(np.random.default_rng(1).integers(0, 256, 4096, np.uint8).tobytes())
    s.callbacks.append(damage)
    with pytest.raises(DataReadError, match=r'layer "src" \(Data\): LMDB .*db cannot be read after key .*; training '
                                            r"up to iteration (\d+) is kept in the snapshot .*t_iter_\1.solverstate"):
        s.solve()
    model, state = latest(str(tmp_path / "t"))
    assert 5 <= s.iter < 1000 and blobproto.read_binary(state, pb.SolverState()).iter == s.iter
    assert np.array_equal(blobproto.to_array(blobproto.read_caffemodel(model).layer[1].blobs[0]),
                          s.net.params["ip"][0].data)
