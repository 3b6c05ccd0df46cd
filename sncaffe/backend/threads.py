"""How many threads sncaffe's CPU kernels run on: one decision per process, made here.

BLAS libraries start a thread per core and split even small GEMMs over all of them. Where
the GEMMs are small (LeNet's) or other processes keep the cores busy, the threads wait on
each other more than they work: on the shared 2-core machine LeNet's 300 iterations took
19.2 CPU-seconds with OpenBLAS's default threads against 6.7 with one (docs/benchmarks.md,
"CPU threads and depthwise convolution"). So sncaffe sizes threads itself:

- the budget: ``--threads N``, else the GEMM library's own variable (``MKL_NUM_THREADS`` or
  ``OPENBLAS_NUM_THREADS``), else ``OMP_NUM_THREADS``, else the other BLAS's variable; unset,
  the usable cores (affinity and cgroup quota) less those other processes keep busy now
  (``/proc/stat`` sampled over ``SAMPLE_SECONDS``: the 1-minute load average it replaces still
  counted the user's own previous run, so a second run at once got one thread of two), shared
  among the data-parallel ranks on the machine, at least one;
- every BLAS loaded is held to the budget (threadpoolctl; MKL's OpenMP threads follow MKL's
  count, and another library's OpenMP pool, torch's, is left alone); NumPy's own
  OpenBLAS to one thread where MKL runs the GEMMs (sncaffe's GEMMs all go through
  ``backend.blas.gemm``);
- each GEMM runs on ``gemm_threads(flops)``: one thread per ``FLOPS_PER_THREAD`` of work,
  at most the budget;
- the element-wise and per-channel kernels (``backend/workers.py``) run on the calling
  thread (measured faster here); with ``SNCAFFE_KERNEL_THREADS=N`` on up to N threads of the
  same budget: they and the GEMMs take turns, never overlap, so together they never oversubscribe.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

# A thread pays for waking and joining (tens of microseconds, more on a busy machine) when
# it gets ~100 us of GEMM: 8 MFLOP at the ~90 GFLOP/s one core runs these GEMMs at.
FLOPS_PER_THREAD = 8e6
# How long MKL's (Intel OpenMP) threads spin after a GEMM before they sleep, unless
# KMP_BLOCKTIME is set (backend/blas.py).
KMP_BLOCKTIME_MS = 1
# Long enough for a few scheduler ticks on each core, short beside a run.
SAMPLE_SECONDS = 0.15
# A core counts as busy once other processes take this much of it: a thread sharing a core
# runs at half speed, and the kernels' threads wait for their slowest.
BUSY_FRACTION = 0.5
VARS = {"mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"),
        "openblas": ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


@dataclass(frozen=True)
class Decision:
    """The thread budget and where it came from."""
    threads: int            # the most threads one kernel runs on
    cores: int              # usable cores
    source: str             # "--threads", an environment variable, or "cores"
    busy: float | None = None   # cores other processes kept busy while sampled (a default budget)
    share: int = 1              # ranks or replicas sharing the cores, each with this budget
    shared_by: str = "ranks"    # what shares them: "ranks" (processes) or "replicas" (one process's workers)

    def describe(self) -> str:
        if self.source == "cores":
            why = f"{self.cores} usable cores, {self.busy:.1f} of them busy with other processes now"
            why += f", {self.share} {self.shared_by} on them" if self.share > 1 else ""
            how = "--threads N or OMP/OPENBLAS/MKL_NUM_THREADS to choose"
        else:
            why, how = f"{self.source}; {self.cores} usable cores", "set by the user"
        return (f"{self.threads} thread{'s' * (self.threads != 1)} ({why}); a GEMM gets one thread "
                f"per {FLOPS_PER_THREAD / 1e6:g} MFLOP; {how}")


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def _requested(env, blas_name):
    """(threads, variable) of the first thread variable set in ``env``, or None."""
    for var in VARS.get(blas_name, VARS["openblas"]):
        value = env.get(var, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{var}={value!r}: give a positive number of threads")
            return int(value), var
    return None


def _cpu_times(cpus):
    """{cpu: (idle, total)} jiffies of the given cpus from /proc/stat (empty where unreadable)."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    v = [int(x) for x in fields[:8]]        # user nice system idle iowait irq softirq steal
                    out[int(name[3:])] = (v[3] + v[4], sum(v))
    except (OSError, ValueError):
        return {}
    return out


_busy: float | None = None


def busy_cores() -> float:
    """Cores other processes keep busy now: the non-idle share of this process's cpus over
    ``SAMPLE_SECONDS``, while this process sleeps (measured once per process). Where /proc/stat
    cannot be read, the 1-minute load average stands in."""
    global _busy
    if _busy is None:
        import time
        try:
            cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            cpus = set(range(os.cpu_count() or 1))
        before = _cpu_times(cpus)
        time.sleep(SAMPLE_SECONDS)
        after = _cpu_times(cpus)
        spans = [(after[c][0] - before[c][0], after[c][1] - before[c][1]) for c in before if c in after]
        if spans and sum(t for _, t in spans) > 0:
            _busy = sum(1 - i / t for i, t in spans if t > 0)
        else:
            _busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return _busy


def free_cores(cores: int, busy: float, share: int = 1) -> int:
    """Threads for one of ``share`` processes on ``cores`` usable cores when others keep
    ``busy`` cores busy: the cores less those taken at least ``BUSY_FRACTION``, at least one."""
    taken = int(busy + 1 - BUSY_FRACTION)      # 0.4 busy: none taken; 0.5-1.49: one; ...
    return max(1, min(cores, cores - taken) // share)


def decide(threads=None, env=None, blas_name="mkl", cores=None, busy=None, share=1, shared_by="ranks") -> Decision:
    """The budget for ``--threads`` (None: unset) under ``env`` (default os.environ), for one
    of ``share`` processes (or replicas' workers: ``shared_by``) on the machine; ``busy``: the
    cores other processes keep busy (default measured, ``busy_cores``)."""
    cores = usable_cores() if cores is None else cores
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: give a positive number of threads")
        return Decision(threads, cores, "--threads")
    asked = _requested(os.environ if env is None else env, blas_name)
    if asked:
        return Decision(asked[0], cores, f"{asked[1]}={asked[0]}")
    busy = busy_cores() if busy is None else busy
    return Decision(free_cores(cores, busy, share), cores, "cores", busy, share, shared_by)


_flag: int | None = None             # --threads, once the CLI has set it
_share: int = 1                      # ranks or replicas sharing the cores, once the CLI has said
_decision: Decision | None = None


def request(threads=None, share=1) -> None:
    """Record the --threads flag and the processes or replicas sharing the cores, for the
    decisions made next (the BLAS's as it loads, then backend/runtimes.configure's)."""
    global _flag, _share
    _flag, _share = threads, share


def settle(decision: Decision) -> Decision:
    """Make ``decision`` this process's (backend/runtimes.configure holds the runtimes to it)."""
    global _decision
    _decision = decision
    return decision


def requested():
    """(the --threads flag, the processes or replicas sharing the cores) as last configured."""
    return _flag, _share


def current() -> Decision:
    """This process's decision: the one configured (backend/runtimes.py, when the CLI starts or
    a device is made), else the one the environment gives, without holding any runtime to it."""
    global _decision
    if _decision is None:
        _decision = decide(_flag, share=_share)
    return _decision


@contextlib.contextmanager
def held(threads: int):
    """Run the enclosed code on a budget of ``threads`` (at most the process's): the GEMMs, oneDNN's
    team and the compiled kernels read the budget at each call. For benchmarks that time one and
    two threads by turns in one process, where a shared machine's load moves within seconds."""
    global _decision
    before = current()
    _decision = Decision(max(1, min(threads, before.threads)), before.cores, f"held at {threads}")
    try:
        yield _decision
    finally:
        _decision = before


def gemm_threads(flops: float) -> int:
    """Threads for one GEMM of ``flops``: sized to the work, at most the budget."""
    budget = (_decision or current()).threads
    return max(1, min(budget, int(flops // FLOPS_PER_THREAD)))
