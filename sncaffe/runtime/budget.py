"""Memory budgets from the machine, and what the process holds.

On the CPU device the "device" pool and the host pool are the same physical RAM, so
their peaks together, plus what the process holds outside them (the graph, Python,
NumPy's temporaries), must stay under the RAM that is *available* (MemAvailable: free
memory and the page cache the kernel can drop), not half of physical RAM as before.
A margin of a tenth of physical RAM is left for the process's own growth and for
the other programs on the machine.
"""
from __future__ import annotations

import os

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


def physical_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def available_ram() -> int:
    """MemAvailable, else half of physical RAM where the kernel does not say."""
    return meminfo().get("MemAvailable", physical_ram() // 2)


def margin() -> int:
    return max(MIN_MARGIN, int(physical_ram() * MARGIN_FRACTION))


def ram_budget() -> int:
    """What the pools may hold together on this machine now: available RAM less the margin, and
    at least a sixteenth of physical RAM (another program's passing peak should not make a
    small net's plan fail; a kernel that reports almost nothing available is usually reclaiming)."""
    return max(available_ram() - margin(), physical_ram() // 16)


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
