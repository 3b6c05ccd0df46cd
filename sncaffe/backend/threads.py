"""How many threads sncaffe's CPU kernels run on: one decision per process, made here.

BLAS libraries start a thread per core and split even small GEMMs over all of them. Where
the GEMMs are small (LeNet's) or other processes keep the cores busy, the threads wait on
each other more than they work: on the shared 2-core machine LeNet's 300 iterations took
19.2 CPU-seconds with OpenBLAS's default threads against 6.7 with one (docs/benchmarks.md,
"CPU threads and depthwise convolution"). So sncaffe sizes threads itself:

- the budget: ``--threads N``, else the GEMM library's own variable (``MKL_NUM_THREADS`` or
  ``OPENBLAS_NUM_THREADS``), else ``OMP_NUM_THREADS``, else the other BLAS's variable; unset,
  the usable cores (affinity and cgroup quota) less those the 1-minute load average says
  other processes keep busy, shared among the data-parallel ranks on the machine, at least one;
- every BLAS loaded is held to the budget (threadpoolctl; MKL's OpenMP threads follow MKL's
  count, and another library's OpenMP pool, torch's, is left alone); NumPy's own
  OpenBLAS to one thread where MKL runs the GEMMs (sncaffe's GEMMs all go through
  ``backend.blas.gemm``);
- each GEMM runs on ``gemm_threads(flops)``: one thread per ``FLOPS_PER_THREAD`` of work,
  at most the budget.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# A thread pays for waking and joining (tens of microseconds, more on a busy machine) when
# it gets ~100 us of GEMM: 8 MFLOP at the ~90 GFLOP/s one core runs these GEMMs at.
FLOPS_PER_THREAD = 8e6
VARS = {"mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"),
        "openblas": ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


@dataclass(frozen=True)
class Decision:
    """The thread budget and where it came from."""
    threads: int            # the most threads one kernel runs on
    cores: int              # usable cores
    source: str             # "--threads", an environment variable, or "cores"
    load: float | None = None   # the load average that sized a default budget
    share: int = 1              # processes sharing the cores (data-parallel ranks)

    def describe(self) -> str:
        if self.source == "cores":
            why = f"{self.cores} usable cores, load average {self.load:.2f}"
            why += f", {self.share} ranks on them" if self.share > 1 else ""
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


def decide(threads=None, env=None, blas_name="mkl", cores=None, load=None, share=1) -> Decision:
    """The budget for ``--threads`` (None: unset) under ``env`` (default os.environ), for one
    of ``share`` processes on the machine."""
    cores = usable_cores() if cores is None else cores
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: give a positive number of threads")
        return Decision(threads, cores, "--threads")
    asked = _requested(os.environ if env is None else env, blas_name)
    if asked:
        return Decision(asked[0], cores, f"{asked[1]}={asked[0]}")
    load = os.getloadavg()[0] if load is None else load
    # processes that kept a core busy over the last minute: int(), so a brief burst takes none
    return Decision(max(1, min(cores, cores - int(load)) // share), cores, "cores", load, share)


_flag: int | None = None             # --threads, once the CLI has set it
_decision: Decision | None = None


def configure(threads=None, share=1) -> Decision:
    """Decide (``threads``: the ``--threads`` flag; ``share``: processes on these cores) and
    hold every loaded runtime to it. Called before the BLAS loads, the decision also picks
    MKL's threading layer."""
    global _flag, _decision
    _flag = threads
    from . import onednn
    onednn.preload()                     # before the BLAS: one OpenMP runtime for both
    from . import blas                   # loads the BLAS under this flag
    _decision = decide(threads, blas_name=blas.BLAS.name, share=share)
    from threadpoolctl import threadpool_limits
    threadpool_limits(_decision.threads, user_api="blas")     # another library's OpenMP pool is its own
    if blas.BLAS.name == "mkl":
        blas.set_openblas_threads(1)    # NumPy's own BLAS runs nothing of size here
    if blas.BLAS.name != "numpy":       # MKL loaded sequential (a budget of one) stays so
        blas.BLAS.threads = 1 if blas.BLAS.sequential else _decision.threads
    blas.BLAS.set_threads(_decision.threads)
    return _decision


def current() -> Decision:
    """This process's decision (made from the environment on first use)."""
    return _decision or configure(_flag)


def gemm_threads(flops: float) -> int:
    """Threads for one GEMM of ``flops``: sized to the work, at most the budget."""
    budget = (_decision or current()).threads
    return max(1, min(budget, int(flops // FLOPS_PER_THREAD)))
