"""The thread policy (backend/threads.py): its budget from the flag, the environment or the
free cores, and the thread counts threadpoolctl then reads from the loaded runtimes, in fresh
processes (a process decides once)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sncaffe.backend import blas, threads


ROOT = Path(__file__).resolve().parents[2]
VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "SNCAFFE_BLAS", "KMP_BLOCKTIME",
        "OPENBLAS_THREAD_TIMEOUT")
HAS_MKL = blas._mkl_path() is not None

# Decide, then read the runtimes' counts: at once, after a tiny GEMM, after a big one.
CHILD = """
import json, sys
import numpy as np
from threadpoolctl import threadpool_info
from sncaffe.backend import blas, threads
from sncaffe.backend import runtimes
flag = json.loads(sys.argv[1])
d = runtimes.configure(flag)
def counts():
    return {i["internal_api"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
import os
out = {"decision": d.__dict__, "blas": blas.BLAS.name, "at_once": counts(), "blocktime": os.environ.get("KMP_BLOCKTIME")}
for name, n in (("tiny", 8), ("big", 512)):
    a = np.ones((n, n), np.float32)
    blas.gemm(a, a, np.empty_like(a))
    out[name] = counts()
print(json.dumps(out))
"""


def _child(flag=None, **env):
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(flag)], capture_output=True, text=True,
                         env={**base, **env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _gemm_lib(out):
    return "openblas" if out["blas"] == "openblas" else "mkl"


# What OPENBLAS_THREAD_TIMEOUT was when the sncaffe command imported NumPy (and with it OpenBLAS,
# which reads it once). Importing sncaffe as a library sets nothing in the environment.
SPY = """
import json, os, sys
seen = {}
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not seen:
            seen["timeout"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
sys.meta_path.insert(0, Spy())
import contextlib, io
from sncaffe import entry
with contextlib.redirect_stdout(io.StringIO()):
    try:
        entry.main(["--help"])      # the sncaffe command
    except SystemExit:
        pass
print(json.dumps(seen))
"""


@pytest.mark.parametrize("given, want", [(None, "4"), ("10", "10")])
def test_the_command_has_openblas_threads_sleep_at_once_unless_the_user_says(given, want):
    """Set by the command before NumPy loads OpenBLAS (its threads spin after each GEMM beside
    oneDNN's team: tools/bench_threads.py); the user's value is kept."""
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    env = {**base, "PYTHONPATH": str(ROOT), **({"OPENBLAS_THREAD_TIMEOUT": given} if given else {})}
    run = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"timeout": want}


def test_one_thread_from_the_environment_holds_every_blas():
    out = _child(OPENBLAS_NUM_THREADS="1")
    assert out["decision"]["threads"] == 1 and out["decision"]["source"] == "OPENBLAS_NUM_THREADS=1"
    for key in ("at_once", "tiny", "big"):
        assert set(out[key].values()) == {1}, out


@pytest.mark.parametrize("lib", ["openblas"] + ["mkl"] * HAS_MKL)
def test_two_threads_go_to_big_gemms_only(lib):
    """A budget of two (--threads, overriding the environment's one): the GEMM library reads
    two, one after a tiny GEMM and two again after a big one; NumPy's OpenBLAS stays at one
    where MKL runs the GEMMs."""
    out = _child(2, SNCAFFE_BLAS=lib, OPENBLAS_NUM_THREADS="1")
    assert out["blas"] == lib and out["decision"]["source"] == "--threads"
    assert (out["at_once"][lib], out["tiny"][lib], out["big"][lib]) == (2, 1, 2)
    if lib == "mkl":
        assert out["at_once"]["openblas"] == out["big"]["openblas"] == 1
        assert out["blocktime"] == str(threads.KMP_BLOCKTIME_MS)     # Intel's threads sleep soon
        assert _child(2, SNCAFFE_BLAS=lib, KMP_BLOCKTIME="50")["blocktime"] == "50"     # the user's wins


def test_the_gemm_librarys_own_variable_comes_first():
    out = _child(SNCAFFE_BLAS="openblas", OMP_NUM_THREADS="2", MKL_NUM_THREADS="1")
    assert out["decision"]["source"] == "OMP_NUM_THREADS=2" and out["at_once"]["openblas"] == 2
    if HAS_MKL:
        out = _child(OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="2")
        assert out["decision"]["source"] == "MKL_NUM_THREADS=2" and out["big"]["mkl"] == 2


def test_default_is_the_free_cores():
    """Nothing set: the usable cores less those other processes keep busy, sampled in the child."""
    out = _child()
    d = out["decision"]
    assert d["source"] == "cores" and d["cores"] == threads.usable_cores()
    assert 0 <= d["busy"] <= d["cores"] + 0.01
    assert d["threads"] == threads.free_cores(d["cores"], d["busy"])
    assert out["at_once"][_gemm_lib(out)] == out["big"][_gemm_lib(out)] == d["threads"]
    assert out["tiny"][_gemm_lib(out)] == 1


def test_decide_rules():
    d = threads.decide(env={}, cores=8, busy=2.7)
    assert (d.threads, d.source, d.busy) == (5, "cores", 2.7)
    assert "8 usable cores, 2.7 of them busy with other processes now" in d.describe()
    assert threads.decide(env={}, cores=8, busy=0.4).threads == 8      # a brief burst takes no core
    assert threads.decide(env={}, cores=2, busy=0.6).threads == 1      # a core half taken is taken
    assert threads.decide(env={}, cores=2, busy=7.0).threads == 1
    assert threads.decide(env={}, cores=8, busy=0.0, share=3).threads == 2
    assert threads.decide(3, env={"OMP_NUM_THREADS": "1"}, cores=2).threads == 3     # the flag first
    assert threads.decide(env={"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "1"},
                          blas_name="mkl", cores=2).source == "OMP_NUM_THREADS=4"
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two'"):
        threads.decide(env={"OMP_NUM_THREADS": "two"})
    with pytest.raises(ValueError, match="--threads 0"):
        threads.decide(0)


def test_busy_cores_come_from_proc_stat(monkeypatch):
    """Busy is the non-idle share of each cpu between two reads of /proc/stat, whatever the
    load average says (a previous run of the user's own stays in that for a minute)."""
    reads = iter([{0: (100, 200), 1: (50, 100)}, {0: (190, 300), 1: (60, 200)}])
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(reads))
    monkeypatch.setattr(threads, "_busy", None)
    monkeypatch.setattr(threads, "SAMPLE_SECONDS", 0)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert threads.busy_cores() == pytest.approx(0.1 + 0.9)         # cpu0 90% idle, cpu1 10% idle
    assert threads.busy_cores() == pytest.approx(1.0)               # measured once per process


def test_cpu_times_read_this_machine():
    times = threads._cpu_times(os.sched_getaffinity(0))
    assert times and all(0 <= idle <= total for idle, total in times.values())


def test_gemm_threads_are_sized_to_the_work(monkeypatch):
    monkeypatch.setattr(threads, "_decision", threads.Decision(4, 4, "--threads"))
    step = threads.FLOPS_PER_THREAD
    assert [threads.gemm_threads(f) for f in (0, step - 1, 2 * step, 3.5 * step, 100 * step)] == [1, 1, 2, 3, 4]


def test_a_held_budget_reaches_the_gemms_and_onednn_and_is_given_back(monkeypatch):
    """threads.held (the benchmarks' one thread and two by turns): inside, the GEMMs are sized to
    the held budget and oneDNN's OpenMP count on this thread follows it; never above the
    process's budget; the decision is restored after, an exception included."""
    from sncaffe.backend import onednn
    monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
    big = 100 * threads.FLOPS_PER_THREAD
    with threads.held(1) as d:
        assert d.threads == 1 and threads.gemm_threads(big) == 1
        if onednn.version() is not None:
            assert onednn._set_threads() == 1 and onednn._omp_max() == 1
    assert threads.current().threads == 2 and threads.gemm_threads(big) == 2
    if onednn.version() is not None:
        assert onednn._set_threads() == 2 and onednn._omp_max() == 2
    with threads.held(8):
        assert threads.current().threads == 2
    with pytest.raises(RuntimeError), threads.held(1):
        raise RuntimeError("a failing iteration")
    assert threads.current().threads == 2


def test_cli_reports_a_bad_setting_without_a_traceback(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 } } }')
    env = {**{k: v for k, v in os.environ.items() if k not in VARS}, "MKL_NUM_THREADS": "-1",
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "sncaffe.cli", "time", str(net)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "MKL_NUM_THREADS='-1': give a positive number of threads" in run.stderr


# Two replicas built and closed in a process where nobody chose the threads.
REPLICAS = """
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "parallel"))
from test_replicas import LOCATIONS, make_solver, net_param
from sncaffe.backend import threads
from sncaffe.backend import runtimes
from sncaffe.parallel.replicas import Replicas, replicate
solver = make_solver(replicate(net_param(), LOCATIONS))
before = threads.current().__dict__
reps = Replicas(solver)
during = threads.current().__dict__
solver.step(1)
reps.close()
print(json.dumps({"before": before, "during": during, "after": threads.current().__dict__}))
"""


def test_replicas_share_the_cores_unless_the_user_chose_the_threads():
    """A replica's worker computes while the other does: where the budget is the cores' (no flag,
    no variable), the replicas take a share each, as ranks do, and give the budget back when
    closed; a budget the user chose stays."""
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    for env, shared in (({}, True), ({"OMP_NUM_THREADS": "2"}, False)):
        run = subprocess.run([sys.executable, "-c", REPLICAS, str(ROOT)], capture_output=True, text=True,
                             env={**base, **env, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.strip().splitlines()[-1])
        before, during, after = out["before"], out["during"], out["after"]
        assert before["share"] == 1 and after == before
        if shared:
            assert (during["share"], during["shared_by"], during["source"]) == (2, "replicas", "cores")
            assert during["threads"] == max(1, threads.free_cores(during["cores"], during["busy"], 2))
        else:
            assert during == before and during["threads"] == 2


def test_the_cli_gives_each_replica_its_share_before_the_blas_loads(tmp_path):
    """``sncaffe train --replicas cpu:0,cpu:1`` decides before anything loads the BLAS, for two
    replicas: one thread each on two cores (and MKL's sequential layer, as ``--threads 1``)."""
    net = tmp_path / "net.prototxt"
    net.write_text('name: "t"\nlayer { name: "in" type: "Input" top: "data" top: "label" input_param { '
                   'shape { dim: 4 dim: 3 } shape { dim: 4 } } }\nlayer { name: "ip" type: "InnerProduct" '
                   'bottom: "data" top: "ip" inner_product_param { num_output: 2 } }\nlayer { name: "loss" '
                   'type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    code = ("import sys, json; from sncaffe import cli; from sncaffe.backend import blas, threads; "
            "rc = cli.main(sys.argv[1:]); print(json.dumps({'rc': rc, 'decision': threads.current().__dict__, "
            "'blas': blas.BLAS.name, 'sequential': blas.BLAS.sequential}))")
    run = subprocess.run([sys.executable, "-c", code, "train", str(net), "--replicas", "cpu:0,cpu:1", "--max-iter",
                          "1", "--snapshot-prefix", str(tmp_path) + "/"], capture_output=True, text=True,
                         env={**base, "PYTHONPATH": str(ROOT)}, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    d = out["decision"]
    assert out["rc"] == 0 and (d["share"], d["shared_by"]) == (2, "replicas")
    assert "2 replicas on them" in run.stdout + run.stderr
    if out["blas"] == "mkl":
        assert out["sequential"] == (d["threads"] == 1)


@pytest.mark.parametrize("argv, says", [(["--turns", "--nets", "lenet"], "unknown net 'lenet'"),
                                        (["--threads", "1,x"], "'1,x' is not a comma-separated list")])
def test_bench_threads_refuses_a_net_or_thread_count_it_does_not_have(argv, says):
    """An unknown net or thread count is a usage error naming it, before any child runs (it was a
    child's KeyError traceback)."""
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "bench_threads.py"), *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr


def test_importing_sncaffe_sets_nothing_in_the_environment():
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    code = "import os, json; before = dict(os.environ); import sncaffe, sncaffe.net; print(json.dumps(dict(os.environ) == before))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**base, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) is True
