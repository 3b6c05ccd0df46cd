"""Run a command inside a memory cgroup, as a container with that much memory runs it (cgroup
v1 or v2; needs root). Prints the cgroup's peak usage when the command ends.

    sudo python tools/in_memory_cgroup.py 12GiB -- sncaffe train prototxt/resnet2500.prototxt --max-iter 1
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sncaffe.sizes import fmt_bytes, parse_bytes  # noqa: E402


def make_group(limit: int) -> tuple[Path, str]:
    """(the cgroup's folder, the file its peak usage is read from)."""
    v1 = Path("/sys/fs/cgroup/memory")
    name = f"sncaffe-{uuid.uuid4().hex[:8]}"
    if v1.is_dir():
        group = v1 / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        return group, "memory.max_usage_in_bytes"
    group = Path("/sys/fs/cgroup") / name
    group.mkdir()
    (group / "memory.max").write_text(str(limit))
    return group, "memory.peak"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    limit, command = parse_bytes(argv[0]), argv[2:]
    try:
        group, peak_file = make_group(limit)
    except OSError as e:
        print(f"in_memory_cgroup: cannot make a memory cgroup ({e.strerror}): run as root on cgroupfs", file=sys.stderr)
        return 2
    try:
        child = subprocess.Popen(command, preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        rc = child.wait()
        peak = (group / peak_file).read_text().strip() if (group / peak_file).exists() else "?"
        print(f"in_memory_cgroup: limit {fmt_bytes(limit)}, exit status {rc}, cgroup peak "
              f"{fmt_bytes(int(peak)) if peak.isdigit() else peak} (page cache included)", file=sys.stderr)
        return rc
    finally:
        group.rmdir()


if __name__ == "__main__":
    sys.exit(main())
