"""The dispatcher's own time per operator (not a test): a net's forward and backward schedules run
with every layer's work replaced by nothing, so what is left is issuing, dependency tracking,
allocation and binding.

    python tools/bench_dispatch.py [--net prototxt/resnet50.prototxt] [--batch 2] [--passes 20]

Prints the median of ``--passes`` forward + backward pairs and that time per operator run. The
memory mode is ``none`` (the plan `sncaffe train` takes where the net fits). The net is built as
it is: a Data layer needs its database (LeNet's: the README's first command makes it).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(net_path, batch, passes) -> tuple[float, int]:
    """(seconds of one forward + backward pair with the layers' work removed, operators run)."""
    sys.path.insert(0, str(ROOT))
    from sncaffe import Net
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import read_text, set_batch
    net = Net(set_batch(read_text(Path(net_path), pb.NetParameter()), batch), "TRAIN", memory="none")
    ex, schedule = net.executor, net.plan.schedule
    ex.run_op = lambda *a, **k: None
    runs = sum(1 for ins in schedule.forward + schedule.backward if ins.kind == "run")
    times = []
    for _ in range(passes + 1):
        t0 = time.perf_counter()
        ex.execute(schedule.forward)
        ex.execute(schedule.backward)
        ex.reset()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default=str(ROOT / "prototxt/resnet50.prototxt"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from sncaffe.graph import GraphError
    from sncaffe.prototxt import PrototxtError
    try:
        seconds, runs = measure(args.net, args.batch, args.passes)
    except (GraphError, PrototxtError, OSError) as e:
        raise SystemExit(f"bench_dispatch: {e}") from None
    print(f"{Path(args.net).name} batch {args.batch}: {runs} operators, {seconds * 1e3:.2f} ms a forward + "
          f"backward with no layer work, {seconds / runs * 1e6:.1f} us an operator (median of {args.passes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
