"""The deepest ResNet [3, 4, k, 3] that trains in a memory limit, sncaffe and PyTorch measured alike.

    python tools/compare.py depth --limit 3GiB          # everything, into benchmarks/results/07_depth.json
    python tools/compare.py depth --limit 3GiB --side sncaffe        # sncaffe again, PyTorch's rows kept
    python tools/compare.py depth --side pytorch --configs checkpoint:tuned --start checkpoint=92,100

Every point is a real training run in a fresh process inside a memory cgroup of ``--limit``, as a
container runs it (tools/in_memory_cgroup.py; needs root), one at a time. It fits when it exits 0
(the kernel kills what the cgroup cannot hold) and its peak resident set is within the limit too
(VmHWM, read by the process itself: ru_maxrss would include the parent's; the cgroup leaves out
library pages that were already in the page cache). Each run also records its wall and CPU time.
The search: a line through the deepest runs guesses where the limit is crossed, with bisection,
until the first depth that does not fit is at most ``--resolution`` above the deepest that does.

PyTorch   tools/torch_memory.py: torchvision's Bottleneck ResNet, SGD with momentum, the
          default ``zero_grad()``, two steps (the second holds the momentum), batch 16,
          224x224, float32; eager, ``checkpoint`` around every block, and
          ``checkpoint_sequential`` at the segment count that kept least at ``--probe-k``
          (``--configs`` VARIANT:MALLOC), each under glibc malloc's default and under
          TUNED_MALLOC (the environment variables below).
sncaffe   ``sncaffe train NET --max-iter 1`` with no memory flag, the net from tools/gen_resnet.py;
          once with no usable disk (the temporary directory a 1 MiB tmpfs) and once with the
          disk tier in the temporary directory on the local disk (``--sncaffe``).

The device view (a second table) counts what a GPU would have to hold: sncaffe's planned device
pool per memory mode (a plan, which the runtime meets to the byte) against the tensors PyTorch's
allocator holds in use at its peak (malloc's in-use bytes in the same runs, fragmentation left out).
Both frameworks run on ``--threads`` threads (OMP/OPENBLAS/MKL_NUM_THREADS).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(ROOT))
from sncaffe.sizes import parse_bytes  # noqa: E402
GiB = 1 << 30
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Large tensors from mmap, returned to the kernel when freed: glibc's default threshold grows
# with every freed mmapped chunk (up to 32 MiB), after which such tensors come from the arenas.
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
MALLOC_VARS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def depth(k: int) -> int:
    """gen_resnet's depth of [3, 4, k, 3]."""
    return 3 * (k + 10) + 2


def malloc_words(env: dict) -> str:
    return " ".join(f"{v}={env[v]}" for v in MALLOC_VARS if v in env) or "glibc default"


# -- the search ------------------------------------------------------------------------------------
def deepest(peak, budget, k_max, log=None, start=(1, 2), resolution=1) -> tuple:
    """(lo, hi): lo the largest k <= k_max measured with peak(k) <= budget (0: none), hi the least
    measured k that does not fit (k_max + 1: none), hi - lo <= ``resolution`` (peak nondecreasing
    in k; math.inf where a run did not fit at all).

    The first guesses are ``start``; then each guess is where the line through the two deepest
    measured finite peaks meets the budget (a ResNet's peak grows by about the same per block),
    every third a bisection, so a curve that is not a line still closes in."""
    lo, hi = 0, k_max + 1
    seen = {}
    queue = [k for k in start if 1 <= k <= k_max]
    step = 0
    while True:
        k = queue.pop(0) if queue else None
        if k is None:
            finite = sorted((kk, p) for kk, p in seen.items() if p != math.inf)
            (ka, pa), (kb, pb) = finite[-2:] if len(finite) > 1 else ((0, 0), (0, 0))
            slope = (pb - pa) / (kb - ka) if kb > ka else 0
            step += 1
            guess = kb + math.floor((budget - pb) / slope) if slope > 0 else None
            if guess is not None and step % 3 and (guess < hi - 1 or hi > k_max):
                k = guess
            elif hi <= k_max:
                k = (lo + hi) // 2
            else:
                k = k_max if slope <= 0 and len(finite) > 1 else max(2 * lo, lo + 1)    # flat: the cap
        k = min(max(k, lo + 1), hi - 1)
        seen[k] = peak(k)
        if log:
            log(k, seen[k])
        if seen[k] <= budget:
            lo = k
        else:
            hi = k
        if hi - lo <= resolution:
            return lo, hi


# -- one run in a cgroup ---------------------------------------------------------------------------
@contextlib.contextmanager
def no_disk():
    """A temporary directory on a 1 MiB tmpfs: no room for a spill file."""
    path = tempfile.mkdtemp(prefix="sncaffe-nodisk-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path], capture_output=True, text=True)
    if r.returncode:
        os.rmdir(path)
        raise SystemExit(f"compare depth: cannot mount a 1 MiB tmpfs at {path}: {r.stderr.strip()} (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=False)
        os.rmdir(path)


def run_limited(cmd, limit, env, report=None, timeout=3600) -> dict:
    """``cmd`` in a fresh memory cgroup of ``limit`` bytes: exit status, whether the kernel killed
    it, wall and CPU seconds, the cgroup's peak, and the peak RSS the process wrote to ``report``
    (a JSON file with "rss"), or the last JSON line of its stdout."""
    sys.path.insert(0, str(TOOLS))
    from in_memory_cgroup import make_group
    group, peak_file = make_group(limit)
    import resource
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    child = None
    try:
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
        wall = time.perf_counter() - t0
        rc = child.returncode
        peak = (group / peak_file).read_text().strip()
    finally:
        if child is not None and child.poll() is None:      # stopped from outside: the run goes too
            child.kill()
            child.wait()
        with contextlib.suppress(OSError):
            group.rmdir()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)           # one child at a time: its CPU time
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    result = {"rc": rc, "fits": rc == 0, "killed": rc == -9, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "cgroup_peak": int(peak) if peak.isdigit() else None}
    data = None
    if report and os.path.exists(report):
        data = json.loads(Path(report).read_text())
    elif rc == 0:
        data = next((json.loads(line) for line in reversed(out.strip().splitlines()) if line.startswith("{")), None)
    if data:
        result.update({k: v for k, v in data.items() if k not in result})
    if rc:
        result["error"] = (err or out).strip()[-300:]
    return result


def thread_env(threads, extra=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARS}
    env.update({v: str(threads) for v in THREAD_VARS})
    env.update(extra or {})
    return env


# -- the two sides ---------------------------------------------------------------------------------
def torch_run(k, variant, limit, threads, malloc=None, segments=None, args=None) -> dict:
    import torch_memory
    cmd = torch_memory.child_command((3, 4, k, 3), args.batch, args.image_size, variant, segments)
    env = thread_env(threads, malloc)
    r = run_limited(cmd, limit, env)
    r.update(k=k, depth=depth(k), malloc=malloc_words(env))
    return r


def sncaffe_run(k, limit, threads, disk, args) -> dict:
    import gen_resnet
    with tempfile.TemporaryDirectory(prefix="sncaffe-depth-") as work, \
            (no_disk() if not disk else contextlib.nullcontext(args.spill_dir or work)) as tmp:
        net = Path(work) / f"resnet{depth(k)}.prototxt"
        net.write_text(gen_resnet.generate((3, 4, k, 3), batch=args.batch, image_size=args.image_size))
        report = Path(work) / "peak.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--sncaffe-child", str(report), "--",
               "train", str(net), "--max-iter", "1", "--snapshot-prefix", str(Path(work) / "snap")]
        env = thread_env(threads, {"TMPDIR": tmp})
        r = run_limited(cmd, limit, env, report=str(report))
    r.update(k=k, depth=depth(k), disk=disk, malloc=malloc_words(env))
    return r


def sncaffe_child(report, argv) -> int:
    """`sncaffe` with ``argv`` in this process, then its peak RSS written to ``report``."""
    from sncaffe.entry import main
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    Path(report).write_text(json.dumps({"rss": hwm}))
    return rc or 0


def search(name, run, limit, k_max, say, start, resolution) -> dict:
    """The deepest k whose run fits ``limit``, every run on the way kept."""
    runs = {}

    def peak(k):
        t0 = time.perf_counter()
        runs[k] = r = run(k)
        r["within"] = r["fits"] and r.get("rss", math.inf) <= limit
        say(f"  {name} k={k} (ResNet-{depth(k)}): "
            + (f"ran, peak RSS {r.get('rss', 0) / GiB:.3f} GiB{'' if r['within'] else ', over the limit'}"
               if r["fits"] else f"killed or failed (exit {r['rc']})") + f", {time.perf_counter() - t0:.0f} s")
        return r.get("rss", math.inf) if r["fits"] else math.inf
    lo, hi = deepest(peak, limit, k_max, start=start, resolution=resolution)
    return {"deepest_k": lo, "k_max": k_max, "first_failing_k": hi if hi <= k_max else None, "runs": [runs[k] for k in sorted(runs)]}


def torch_side(args, say, out, save) -> dict:
    """The PyTorch configurations of ``--configs`` (VARIANT:MALLOC), in that order, into ``out``
    (kept from an earlier run where not measured again). checkpoint_sequential's segments: the
    count that kept least at ``--probe-k`` among a few around sqrt(modules) (``--segments-rule``
    gives the rule instead of probing)."""
    mallocs = {"default": None, "tuned": TUNED_MALLOC}
    out.setdefault("configs", {})
    wanted = [c.split(":") for c in args.configs]
    probe = args.probe_segments or any(v == "checkpoint_sequential" for v, _ in wanted) and "segments_probe" not in out
    if probe:
        n = modules(args.probe_k)
        if args.segments_rule:
            out["segments_probe"] = {"k": None, "ratio": args.segments_rule,
                                     "rule": f"round(sqrt({args.segments_rule:g} x modules)), not probed"}
        else:
            cands = sorted({max(2, round(math.sqrt(c * n))) for c in (1, 3, 8)})
            done = {r.get("segments"): r for f in out["configs"].values() for r in f["runs"]
                    if f["variant"] == "checkpoint_sequential" and r["k"] == args.probe_k
                    and r.get("malloc") == malloc_words(TUNED_MALLOC)}          # measured already
            probes = {s: done.get(s) or torch_run(args.probe_k, "checkpoint_sequential", 4 * args.limit,
                                                  args.threads, TUNED_MALLOC, segments=s, args=args) for s in cands}
            for s, r in probes.items():
                say(f"  checkpoint_sequential at k={args.probe_k}, {s} segments: peak RSS "
                    f"{r.get('rss', math.inf) / GiB:.3f} GiB")
            best = min(probes, key=lambda s: probes[s].get("rss", math.inf))
            out["segments_probe"] = {"k": args.probe_k, "modules": n, "runs": {str(s): r for s, r in probes.items()},
                                     "best": best, "ratio": best * best / n,
                                     "rule": f"round(sqrt({best * best / n:.2f} x modules))"}
        save()
    ratio = out.get("segments_probe", {}).get("ratio", 1)

    def segments_at(k):
        return max(2, round(math.sqrt(ratio * modules(k))))
    for variant, mname in wanted:
        key = f"{variant} ({mname} malloc)"
        found = out["configs"][key] = search(
            f"pytorch {key}", lambda k, v=variant, m=mallocs[mname]: torch_run(
                k, v, args.limit, args.threads, m, segments_at(k) if v == "checkpoint_sequential" else None, args),
            args.limit, args.k_max, say, args.start.get(variant, (20, 40)), args.resolution)
        found.update(variant=variant, malloc=malloc_words(mallocs[mname] or {}))
        save()
    return out


def modules(k) -> int:
    """What checkpoint_sequential cuts in [3, 4, k, 3]: the stem, every block and the head."""
    return 1 + 3 + 4 + k + 3 + 1


def torch_device_view(configs, limit, k_max=822) -> dict:
    """Per variant, where its device-side bytes (measured in every run) reach ``limit``: the line
    through its two deepest runs, under the tuned malloc where it has them (the bytes in use
    hardly depend on malloc's settings; they grow by the same per block)."""
    out = {}
    for found in sorted(configs.values(), key=lambda f: f["malloc"] != malloc_words(TUNED_MALLOC)):
        pts = sorted({r["k"]: r["device"] for r in found["runs"] if r.get("fits") and r.get("device")}.items())
        if found["variant"] in out or len(pts) < 2:
            continue
        (ka, da), (kb, db) = pts[-2:]
        per_block = (db - da) / (kb - ka)
        k = min(kb + math.floor((limit - db) / per_block), k_max) if per_block > 0 else kb
        out[found["variant"]] = {"deepest_k": k, "device": db + (k - kb) * per_block, "from": [[ka, da], [kb, db]]}
    return out


def sncaffe_side(args, say, out, save) -> dict:
    """sncaffe train with no usable disk, then with the disk tier (``--sncaffe``), into ``out``."""
    for disk in [d == "disk" for d in args.sncaffe]:
        key = "with the disk tier" if disk else "no disk"
        out[key] = search(f"sncaffe {key}", lambda k, d=disk: sncaffe_run(k, args.limit, args.threads, d, args),
                          args.limit, args.k_max, say, args.start.get("sncaffe disk" if disk else "sncaffe", (20, 40)),
                          args.resolution)
        save()
    return out


def sncaffe_device_view(args, say) -> dict:
    """The deepest k whose planned device pool fits ``--limit``, per memory mode, parameters (with
    their gradients and SGD history) on the device and on the host: a plan, no run."""
    import compare
    out = {}
    for mode in ("none", "liveness", "recompute", "offload", "all"):
        for host in (False, True):
            name = f"{mode}, parameters on the {'host' if host else 'device'}"

            def peak(k, mode=mode, host=host):
                graph = compare.graph_of(compare.resnet((3, 4, k, 3), args.batch, args.image_size))
                free = compare.make_plan(graph, mode, None, 0 if host else compare.history_bytes(graph, 1),
                                         host_params=host)
                bound = compare.make_plan(graph, mode, args.limit, 0 if host else compare.history_bytes(graph, 1),
                                          host_params=host)
                return min(free.peak, bound.peak) if bound.fits else max(free.peak, args.limit + 1)
            seen = {}
            lo, hi = deepest(lambda k: seen.setdefault(k, peak(k)), args.limit, args.k_max, start=(20, 40))
            out[name] = {"mode": mode, "host_params": host, "deepest_k": lo, "device": seen.get(lo),
                         "first_failing_k": hi if hi <= args.k_max else None}
            say(f"  sncaffe {name}: deepest k = {lo} (ResNet-{depth(lo)}), planned device pool "
                f"{(seen.get(lo) or 0) / GiB:.2f} GiB")
    return out


# -- the tables ------------------------------------------------------------------------------------
TORCH_LABELS = {"eager": "PyTorch eager", "checkpoint": "PyTorch, checkpoint around every block",
                "checkpoint_sequential": "PyTorch, checkpoint_sequential"}


def _gib(n):
    return f"{n / GiB:.2f} GiB" if n and n != math.inf else "-"


def _resnet(k):
    return f"ResNet-{depth(k)} (k = {k})" if k else "none"


def _times(r):
    return f"{r['wall_s']:.0f} ({r['cpu_s']:.0f})" if "cpu_s" in r else f"{r.get('wall_s', 0):.0f}"


def _malloc(words):
    return "tuned" if words == malloc_words(TUNED_MALLOC) else words.replace("glibc default", "default")


def _first_failing(found):
    if found["first_failing_k"]:
        return _resnet(found["first_failing_k"])
    return f"not tried past k = {found['k_max']}" if found.get("k_max") == found["deepest_k"] else "-"


def _deepest_run(found):
    return next((r for r in found["runs"] if r["k"] == found["deepest_k"]), {})


def whole_process_rows(data) -> tuple:
    """(rows, PyTorch's deepest k, sncaffe's per disk setting)."""
    rows, best_torch, snc = [], 0, {}
    torch = data.get("pytorch", {})
    order = list(TORCH_LABELS)
    configs = sorted(torch.get("configs", {}).values(), key=lambda f: (
        order.index(f["variant"]) if f["variant"] in order else len(order), f["malloc"] != "glibc default"))
    for found in configs:
        r = _deepest_run(found)
        label = TORCH_LABELS.get(found["variant"], found["variant"])
        if found["variant"] == "checkpoint_sequential" and r.get("segments"):
            label += f" ({r['segments']} segments)"
        rows.append([label, _malloc(found["malloc"]), _resnet(found["deepest_k"]), _gib(r.get("rss")),
                     _first_failing(found),
                     _times(r)])
        best_torch = max(best_torch, found["deepest_k"])
    for key, found in data.get("sncaffe", {}).items():
        r = _deepest_run(found)
        rows.append([f"sncaffe train, {key}", _malloc(r.get("malloc", "glibc default")), _resnet(found["deepest_k"]),
                     _gib(r.get("rss")), _first_failing(found),
                     _times(r)])
        snc[key] = found["deepest_k"]
    return rows, best_torch, snc


def device_rows(data) -> list:
    rows = []
    for name, found in data.get("sncaffe_device", {}).items():
        capped = found["first_failing_k"] is None and found["deepest_k"]
        rows.append([f"sncaffe {name} (planned pool)", _resnet(found["deepest_k"]) + (", the cap" if capped else ""),
                     _gib(found["device"])])
    for variant, found in torch_device_view(data.get("pytorch", {}).get("configs", {}), data["limit"],
                                                  data.get("k_max", 822)).items():
        (ka, _), (kb, _) = found["from"]
        rows.append([f"{TORCH_LABELS.get(variant, variant)} (tensors in use at the peak; the line through "
                     f"k = {ka} and {kb})", _resnet(found["deepest_k"]), _gib(found["device"])])
    return rows


def _all_configs(data):
    for key, found in data.get("pytorch", {}).get("configs", {}).items():
        yield f"PyTorch {key}", found
    for key, found in data.get("sncaffe", {}).items():
        yield f"sncaffe {key}", found


def segments_words(torch) -> str:
    probe = torch.get("segments_probe")
    if not probe:
        return "-"
    if probe.get("k") is None:
        return probe["rule"]
    tried = ", ".join(f"{s} ({_gib(r.get('rss'))})" for s, r in probe["runs"].items())
    return f"{probe['rule']}, the count that kept least of {tried} at k = {probe['k']}"


def result_file(data) -> dict:
    """The result file tools/render_benchmarks.py renders: both tables from ``data``."""
    limit = data["limit"]
    rows, best_torch, snc = whole_process_rows(data)
    notes = [f"Every row a real training run in a fresh process inside a {limit / GiB:g} GiB memory cgroup "
             "(tools/in_memory_cgroup.py, as a container sets it). It fits when it exits 0 and its peak RSS (the "
             "process's own VmHWM) is within the limit: the cgroup does not count library pages already in the "
             "page cache, the RSS does. Batch "
             f"{data['batch']}, {data['image_size']}x{data['image_size']}, float32, SGD with momentum.",
             "PyTorch as its users write it: torchvision's Bottleneck (tools/torch_idiomatic.py), the default "
             "zero_grad() (gradients set to None), no state made in advance, two steps (the second with the "
             "momentum buffers). checkpoint: torch.utils.checkpoint.checkpoint(use_reentrant=False) around every "
             f"block; checkpoint_sequential's segments: {segments_words(data.get('pytorch', {}))}.",
             f"glibc malloc: default, or tuned: {malloc_words(TUNED_MALLOC)} in the environment (large tensors "
             "from mmap, given back when freed); under the default, PyTorch's freed tensors stay in a fragmented "
             "heap. The headline takes PyTorch's best of both; sncaffe runs under the default.",
             "sncaffe: `sncaffe train NET --max-iter 1`, no memory flag, a snapshot written at the end; no disk: "
             "the temporary directory on a 1 MiB tmpfs, so the disk tier has no room.",
             f"Threads: {data['threads']} for both frameworks, on a machine shared with other work; wall s (CPU s): "
             "the deepest run's whole process, "
             "start-up and two steps (PyTorch) or planning, one iteration and a snapshot (sncaffe)."]
    for key, k in snc.items():
        if best_torch and k:
            notes.append(f"sncaffe {key}: {depth(k) / depth(best_torch):.2f}x the depth of PyTorch's best "
                         f"(ResNet-{depth(k)} against ResNet-{depth(best_torch)}).")
    over = [f"{name} ResNet-{depth(r['k'])} ({r['rss'] / GiB:.3f} GiB)" for name, found in _all_configs(data)
            for r in found["runs"] if r["fits"] and r.get("rss", 0) > limit]
    if over:
        notes.append("Ran inside the cgroup but over the limit by peak RSS (counted as not fitting): "
                     + ", ".join(over) + ".")
    if data.get("sncaffe_pending"):
        notes.append(data["sncaffe_pending"])
    tables = [{"caption": f"Whole process: peak resident memory within {limit / GiB:g} GiB (the headline)",
               "columns": ["configuration", "glibc malloc", "deepest [3,4,k,3] that trains",
                           "its peak RSS", "first that does not", "wall s (CPU s)"], "rows": rows}]
    dev = device_rows(data)
    if dev:
        tables.append({"caption": f"Device view: what a GPU of {limit / GiB:g} GiB would have to hold "
                                  "(no process, no fragmentation)",
                       "columns": ["configuration", f"deepest [3,4,k,3] within {limit / GiB:g} GiB",
                                   "device bytes at that depth"], "rows": dev})
        own = [f for f in data.get("sncaffe_device", {}).values() if not f["host_params"]]
        theirs = torch_device_view(data.get("pytorch", {}).get("configs", {}), limit, data.get("k_max", 822))
        if own and theirs:
            a = max(own, key=lambda f: f["deepest_k"])
            b = max(theirs.items(), key=lambda kv: kv[1]["deepest_k"])
            notes.append(f"Device view, parameters on the device: sncaffe {a['mode']} ResNet-{depth(a['deepest_k'])} "
                         f"against PyTorch {b[0]} ResNet-{depth(b[1]['deepest_k'])}, "
                         f"{depth(a['deepest_k']) / depth(b[1]['deepest_k']):.2f}x (offload keeps activations in host "
                         "memory, which none of these PyTorch rows does).")
        notes.append("Device view: sncaffe's device pool as planned (the runtime meets the plan to the byte), per "
                     "mode, parameters with their gradients and history on the device or on the host; PyTorch's "
                     "tensors in use at their peak (malloc's in-use bytes during the second step, less the "
                     "libraries' heap before the net), which a GPU's caching allocator would hold at least.")
    return {"title": f"Deepest ResNet in {limit / GiB:g} GiB for the whole process",
            "question": f"How deep a ResNet trains when the whole process may hold {limit / GiB:g} GiB, "
                        "measured alike for sncaffe and PyTorch?",
            "command": data["command"], "machine": data["machine"], "threads": str(data["threads"]),
            "tables": tables, "notes": notes, "data": data}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--sncaffe-child"]:
        return sncaffe_child(argv[1], argv[3:])
    ap = argparse.ArgumentParser(prog="compare.py depth", description=__doc__.splitlines()[0])
    ap.add_argument("--limit", default="3GiB", help="the memory cgroup's limit (default: %(default)s)")
    ap.add_argument("--side", choices=("both", "pytorch", "sncaffe"), default="both",
                    help="measure one side only and keep the other from --out")
    ap.add_argument("--threads", type=int, default=1, help="threads of each framework (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--k-max", type=int, default=822)
    ap.add_argument("--resolution", type=int, default=1, help="stop when the first k that does not fit is at "
                                                               "most this above the deepest that does")
    ap.add_argument("--probe-k", type=int, default=90, help="where checkpoint_sequential's segments are chosen")
    ap.add_argument("--start", action="append", default=[], metavar="CONFIG=K,K",
                    help="first depths to try, e.g. eager=20,30 sncaffe=40,50 'sncaffe disk'=100,150")
    ap.add_argument("--configs", default=",".join(f"{v}:{m}" for v in ("eager", "checkpoint", "checkpoint_sequential")
                                                  for m in ("default", "tuned")),
                    help="PyTorch's configurations, VARIANT:MALLOC (default: all six; others are kept from --out)")
    ap.add_argument("--probe-segments", action="store_true", help="choose checkpoint_sequential's segments "
                    "again at --probe-k (runs made there already count)")
    ap.add_argument("--segments-rule", type=float, help="checkpoint_sequential's segments: round(sqrt(R x "
                                                        "modules)) with this R, instead of probing")
    ap.add_argument("--sncaffe", default="nodisk,disk", help="sncaffe's runs: nodisk, disk or both (default)")
    ap.add_argument("--no-device-view", dest="device_view", action="store_false",
                    help="leave out the planned device pools of the device view")
    ap.add_argument("--spill-dir", help="the disk tier's directory (default: a temporary one on the local disk)")
    ap.add_argument("--out", default="benchmarks/results/07_depth.json")
    args = ap.parse_args(argv)
    argv_limit = args.limit
    import signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # finally clauses remove the cgroups
    args.limit = parse_bytes(args.limit)
    args.configs = [c for c in args.configs.split(",") if c]
    args.sncaffe = [x for x in args.sncaffe.split(",") if x]
    args.start = {s.split("=")[0]: tuple(int(k) for k in s.split("=")[1].split(",")) for s in args.start}
    sys.path.insert(0, str(TOOLS))
    say = (lambda s: print(s, flush=True))
    out = Path(args.out)
    old = json.loads(out.read_text()).get("data", {}) if out.exists() else {}
    import tables
    data = {**old, "limit": args.limit, "batch": args.batch, "image_size": args.image_size,
            "threads": args.threads, "machine": tables.machine(),
            "k_max": args.k_max, "command": f"python tools/compare.py depth --limit {argv_limit} --threads {args.threads}",
            "invocations": old.get("invocations", []) + [
                "python tools/compare.py depth " + " ".join(a if " " not in a else repr(a) for a in argv)]}
    data.pop("sncaffe_pending", None)

    def save():             # after every search: a long run stopped midway keeps what it measured
        out.write_text(json.dumps(result_file(data), indent=1) + "\n")
    if args.side in ("both", "pytorch"):
        t0 = time.perf_counter()
        torch_side(args, say, data.setdefault("pytorch", {}), save)
        data["pytorch"]["seconds"] = round(time.perf_counter() - t0)
    if args.side in ("both", "sncaffe"):
        t0 = time.perf_counter()
        sncaffe_side(args, say, data.setdefault("sncaffe", {}), save)
        if args.device_view:
            data["sncaffe_device"] = sncaffe_device_view(args, say)
        data["sncaffe_seconds"] = round(time.perf_counter() - t0)
    save()
    say(f"written: {out} (python tools/render_benchmarks.py renders it into docs/benchmarks.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
