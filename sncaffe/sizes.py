"""Byte sizes: the pool's alignment, and sizes read from and written for people."""
from __future__ import annotations

ALIGNMENT = 256


def align(n: int, a: int = ALIGNMENT) -> int:
    return max(a, (n + a - 1) // a * a)


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def parse_bytes(text) -> int:
    """'12GiB', '512MB', '1.5G', '4096' -> bytes (binary units for both spellings)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().upper().replace(" ", "")
    for suffix, mult in (("TIB", 2**40), ("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10),
                         ("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10),
                         ("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10), ("B", 1)):
        if s.endswith(suffix):
            return int(float(s[:-len(suffix)]) * mult)
    return int(float(s))
