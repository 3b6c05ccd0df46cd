"""The plain-text table the benchmark scripts print (first column left-aligned, the rest right).

With ``SNCAFFE_BENCH_RESULTS=FILE.json`` set, every table a run prints is also written to FILE
as data at exit, with the command, the machine and the thread settings, in the form
``tools/render_benchmarks.py`` renders: put the file in ``benchmarks/results/`` (adding a
``question``) to make it a table of docs/benchmarks.md.
"""
import atexit
import json
import os
import platform
import sys

RESULTS_ENV = "SNCAFFE_BENCH_RESULTS"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_printed = []


def table(rows, head):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print(flush=True)
    _printed.append({"columns": [str(h) for h in head], "rows": [[str(x) for x in r] for r in rows]})


def _first(path, key):
    try:
        with open(path) as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(key)), None)
    except OSError:
        return None


def machine():
    """The CPU model, its usable cores and the RAM, in words."""
    model = _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    ram = _first("/proc/meminfo", "MemTotal")
    gib = f", {int(ram.split()[0]) / 2 ** 20:.1f} GiB RAM" if ram else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores}-core {model}{gib}"


def threads():
    given = [f"{v}={os.environ[v]}" for v in THREAD_VARS if v in os.environ]
    return ", ".join(given) or "the thread policy's choice"


def results():
    """What the run printed, as one result file's data."""
    name = os.path.basename(sys.argv[0]) or "benchmark"
    return {"title": name, "command": " ".join(["python", f"tools/{name}", *sys.argv[1:]]),
            "machine": machine(), "threads": threads(), "tables": list(_printed)}


@atexit.register
def _save():
    path = os.environ.get(RESULTS_ENV)
    if path and _printed:
        with open(path, "w") as f:
            json.dump(results(), f, indent=1)
            f.write("\n")
