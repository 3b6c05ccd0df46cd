"""Memory budgets from the machine, and what the process holds.

On the CPU device the "device" pool and the host pool are the same physical RAM, so
their peaks together, plus what the process holds outside them (the graph, Python,
NumPy's temporaries), must stay under the RAM that is *available* (MemAvailable: free
memory and the page cache the kernel can drop). Inside a memory cgroup (a container,
cgroup v1 or v2) the RAM is the cgroup's limit, less what the cgroup holds that the kernel
cannot drop. A margin of a tenth of that RAM is left for the process's own growth and for
the other programs beside it.
"""
from __future__ import annotations

import os
from pathlib import Path

MARGIN_FRACTION = 0.10
MIN_MARGIN = 256 << 20


def meminfo() -> dict:
    """/proc/meminfo in bytes ({} where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path):
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path) -> dict:
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def cgroup_memory(proc="/proc/self/cgroup", root="/sys/fs/cgroup"):
    """(limit, usage) in bytes of this process's memory cgroup, v2 or v1; (None, 0) where
    there is no limit. The usage leaves out the inactive file cache the kernel can drop."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None, 0
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if "memory" in controllers.split(","):               # v1
            for base in (Path(root, "memory", path), Path(root, "memory")):
                limit = _read_int(base / "memory.limit_in_bytes")
                if limit is not None:
                    usage = (_read_int(base / "memory.usage_in_bytes") or 0) \
                        - _stat(base / "memory.stat").get("total_inactive_file", 0)
                    return (limit if limit < 1 << 60 else None), max(0, usage)
        if controllers == "":                                   # v2
            for base in (Path(root, path), Path(root)):
                if (base / "memory.max").exists():
                    limit = _read_int(base / "memory.max")      # "max": none
                    usage = (_read_int(base / "memory.current") or 0) \
                        - _stat(base / "memory.stat").get("inactive_file", 0)
                    return limit, max(0, usage)
    return None, 0


def physical_ram() -> int:
    """The machine's RAM, or the memory cgroup's limit where that is lower."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    limit, _ = cgroup_memory()
    return ram if limit is None else min(ram, limit)


def available_ram() -> int:
    """MemAvailable (else half of physical RAM where the kernel does not say), and within a
    memory cgroup no more than its limit less what it holds."""
    info = meminfo()
    avail = info["MemAvailable"] if "MemAvailable" in info else physical_ram() // 2
    limit, usage = cgroup_memory()
    return avail if limit is None else max(0, min(avail, limit - usage))


def margin(ram=None) -> int:
    """What is left for the process's own growth and the programs beside it (of ``ram``, default
    physical_ram())."""
    return max(MIN_MARGIN, int((physical_ram() if ram is None else ram) * MARGIN_FRACTION))


def address_space_room():
    """Bytes this process may still map under its address-space limit (ulimit -v), or None."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    size = 0
    try:
        with open("/proc/self/status") as f:
            size = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    except OSError:
        pass
    return max(0, soft - size)


def ram_budget() -> int:
    """What the pools may hold together on this machine now: available RAM less the margin, and
    at least a sixteenth of physical RAM (another program's passing peak should not make a
    small net's plan fail; a kernel that reports almost nothing available is usually reclaiming)."""
    ram = physical_ram()
    budget = max(available_ram() - margin(ram), ram // 16)
    room = address_space_room()
    # Under ulimit -v both arenas must be mappable (each is virtual until touched), with the
    # libraries still to load beside them.
    return budget if room is None else max(MIN_MARGIN, min(budget, (room - margin(ram)) // 2))


def process_memory() -> dict:
    """This process's resident memory now (rss) and at its highest (hwm), in bytes."""
    out = {"rss": 0, "hwm": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out["rss" if line.startswith("VmRSS") else "hwm"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def give_back_freed() -> None:
    """Return to the kernel what planning freed: the walks of a net of thousands of layers make
    millions of small objects, and glibc keeps the heap they leave (the pools' arenas are mapped
    apart from it, so they could never reuse it); in a container that heap counts as used."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):        # not glibc: nothing to trim
        pass
