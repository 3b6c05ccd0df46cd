"""Fuzz the files a user hands sncaffe besides prototxt: .caffemodel, .solverstate, .caffemodel.h5,
LMDB databases (their data.mdb), Datum records and image files.

Each case mutates a valid seed file (bytes replaced, spans cut, duplicated or overwritten, numbers
spliced in, the file truncated) and hands it to what reads it. A case ends in one of:
  ok       the input was read (or refused) without an exception;
  clean    an error sncaffe raises on purpose, naming the file or record (the CLI prints it as a line);
  foreign  any other exception (a library's own, or one that names nothing);
  hang     no answer within --timeout seconds (the worker is killed);
  crash    the worker process died (a signal, glibc abort, interpreter exit).
Cases run in worker processes, a few hundred per process, so a crash or hang costs one case.

    nice python tools/fuzz_inputs.py                 # 10,000 cases over every kind, 2 workers
    python tools/fuzz_inputs.py -n 500 --kinds h5,image --show 5
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("caffemodel", "solverstate", "h5", "lmdb", "datum", "image")
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               2**63 - 1, 2**64 - 1, 4096, 2**31 // 4]

NET = """name: "fuzz"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


# -- seeds -------------------------------------------------------------------------------

def make_seeds(folder: Path) -> None:
    """The valid files every case starts from."""
    import numpy as np
    from google.protobuf import text_format

    from sncaffe import hdf5_weights
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.data import datum as datums
    from sncaffe.data import image
    from sncaffe.data.db import LMDBWriter
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.solvers import Solver
    (folder / "net.prototxt").write_text(NET)
    p = text_format.Parse(f'base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 1 random_seed: 1 '
                          f'snapshot_prefix: "{folder}/seed"', pb.SolverParameter())
    text_format.Parse(NET, p.net_param)
    s = Solver(p, device=CPUDevice(16 << 20))
    s.feed = lambda net, i: None
    s.step(1)
    s.snapshot()
    hdf5_weights.save(s.net, folder / "seed.caffemodel.h5")
    rng = np.random.default_rng(0)
    pictures = {"png": rng.integers(0, 256, (3, 7, 5), dtype=np.uint8),
                "jpg": rng.integers(0, 256, (3, 9, 8), dtype=np.uint8),
                "bmp": rng.integers(0, 256, (1, 4, 6), dtype=np.uint8),
                "gif": rng.integers(0, 256, (1, 5, 5), dtype=np.uint8)}
    for fmt, a in pictures.items():
        (folder / f"seed.{fmt}").write_bytes(image.encode(a, fmt))
    records = [datums.from_array(rng.integers(0, 256, (3, 6, 6), dtype=np.uint8), 1),
               datums.from_array(rng.standard_normal((3, 6, 6)).astype(np.float32), 2),
               datums.encoded((folder / "seed.png").read_bytes(), 0)]
    for i, d in enumerate(records):
        (folder / f"seed{i}.datum").write_bytes(d.SerializeToString())
    with LMDBWriter(folder / "seed_lmdb") as db:
        for i in range(40):
            db.put(f"{i:05d}", records[i % 2].SerializeToString())


# -- mutation ----------------------------------------------------------------------------

def mutate(data: bytes, rng: random.Random, page=0) -> bytes:
    """A few random edits of ``data``; ``page``: also overwrite whole pages of that size."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(len(data) + 1)
        kind = rng.choice(["byte", "byte", "bytes", "cut", "dup", "int", "int", "truncate"] + ["page"] * bool(page))
        if kind == "byte" and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif kind == "bytes":
            n = rng.randint(1, 64)
            data[at:at + n] = bytes(rng.randrange(256) for _ in range(n))
        elif kind == "cut":
            del data[at:at + rng.randint(1, 256)]
        elif kind == "dup":
            n = rng.randint(1, 256)
            data[at:at] = data[at:at + n]
        elif kind == "int":
            width = rng.choice([1, 2, 4, 8])
            value = rng.choice(INTERESTING) % (1 << 8 * width)
            data[at:at + width] = value.to_bytes(width, rng.choice(["little", "big"]))
        elif kind == "truncate" and rng.random() < 0.3:
            del data[at:]
        elif kind == "page" and len(data) >= page:
            start = rng.randrange(len(data) // page) * page
            fill = rng.choice([b"\0", b"\xff", None])
            data[start:start + page] = fill * page if fill else bytes(rng.randrange(256) for _ in range(page))
    return bytes(data)


# -- what reads each kind ----------------------------------------------------------------

class Reader:
    """The objects a worker keeps across cases (a net, a solver), made on first use."""

    def __init__(self, seeds: Path, work: Path):
        self.seeds, self.work = seeds, work
        self._net = self._solver = None

    def net(self):
        if self._net is None:
            from sncaffe.backend.cpu import CPUDevice
            from sncaffe.net import Net
            self._net = Net(str(self.seeds / "net.prototxt"), device=CPUDevice(16 << 20))
        return self._net

    def solver(self):
        if self._solver is None:
            from google.protobuf import text_format

            from sncaffe.backend.cpu import CPUDevice
            from sncaffe.proto import sncaffe_pb2 as pb
            from sncaffe.solvers import Solver
            p = text_format.Parse('base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 1 '
                                  f'snapshot_prefix: "{self.work}/s"', pb.SolverParameter())
            text_format.Parse(NET, p.net_param)
            self._solver = Solver(p, device=CPUDevice(16 << 20))
        return self._solver

    def case(self, kind: str, seed: int):
        """Write case ``seed`` of ``kind`` and read it; ``self.named``: what an error must name."""
        self.read(kind, random.Random(f"{kind}:{seed}"))

    def read(self, kind: str, rng):
        """A case of ``kind`` whose edits ``rng`` draws (a random.Random, or hypothesis's)."""
        self.named = ""
        getattr(self, "_" + kind)(rng)

    def _file(self, name, data) -> Path:
        path = self.work / name
        path.write_bytes(data)
        return path

    def _caffemodel(self, rng):
        path = self._file("w.caffemodel", mutate((self.seeds / "seed_iter_1.caffemodel").read_bytes(), rng))
        self.named = str(path)
        self.net().copy_from(str(path))

    def _solverstate(self, rng):
        model = self.work / "seed_iter_1.caffemodel"
        if rng.random() < 0.3:      # the model it names, mutated too
            model.write_bytes(mutate((self.seeds / "seed_iter_1.caffemodel").read_bytes(), rng))
        else:
            shutil.copyfile(self.seeds / "seed_iter_1.caffemodel", model)
        from sncaffe.proto import sncaffe_pb2 as pb
        state = pb.SolverState.FromString((self.seeds / "seed_iter_1.solverstate").read_bytes())
        state.learned_net = str(model)
        data = state.SerializeToString()
        path = self._file("s.solverstate", mutate(data, rng))
        self.named = str(self.work)
        self.solver().restore(str(path))

    def _h5(self, rng):
        path = self._file("w.caffemodel.h5", mutate((self.seeds / "seed.caffemodel.h5").read_bytes(), rng, 512))
        self.named = str(path)
        self.net().copy_from(str(path))

    def _lmdb(self, rng):
        from sncaffe.net import Net
        from sncaffe.backend.cpu import CPUDevice
        from sncaffe.prototxt import parse_text
        from sncaffe.proto import sncaffe_pb2 as pb
        db = self.work / f"db{rng.randrange(1 << 30)}"
        db.mkdir()
        for f in (self.seeds / "seed_lmdb").iterdir():
            data = f.read_bytes()
            (db / f.name).write_bytes(mutate(data, rng, 4096) if f.name == "data.mdb" else data)
        self.named = str(db)
        text = (f'name: "d" layer {{ name: "src" type: "Data" top: "data" top: "label" '
                f'data_param {{ source: "{db}" batch_size: 8 backend: LMDB }} }}')
        try:
            net = Net(parse_text(text, pb.NetParameter()), device=CPUDevice(16 << 20))
            try:
                for _ in range(6):
                    net.forward()
            finally:
                net.layers[0].close()
        finally:
            shutil.rmtree(db, ignore_errors=True)

    def _datum(self, rng):
        import numpy as np

        from sncaffe.data import datum as datums
        from sncaffe.data.transform import DataTransformer
        from sncaffe.proto import sncaffe_pb2 as pb
        self.named = "record 7"
        data = mutate((self.seeds / f"seed{rng.randrange(3)}.datum").read_bytes(), rng)
        d = datums.parse(data, "record 7")
        x = datums.to_array(d, None, "record 7")
        t = DataTransformer(pb.TransformationParameter(scale=0.5), 0)
        shape = t.infer_shape(x.shape, "record 7")
        t(x, np.empty(shape[-3:], np.float32), np.random.default_rng(0))

    def _image(self, rng):
        from sncaffe.data import image
        fmt = rng.choice(["png", "jpg", "bmp", "gif"])
        path = self._file(f"im.{fmt}", mutate((self.seeds / f"seed.{fmt}").read_bytes(), rng))
        self.named = str(path)
        decoder = rng.choice(["opencv", "pillow"])
        os.environ["SNCAFFE_IMAGES"] = "pillow" if decoder == "pillow" else ""
        image.load(path, *rng.choice([(0, 0), (5, 4)]), color=rng.random() < 0.5)
        image.decode(path.read_bytes(), rng.choice([None, True, False]), str(path))


def classify(e: BaseException, named: str) -> tuple[str, str]:
    """('clean', type) for an error sncaffe raised on purpose naming ``named``, else ('foreign', detail)."""
    package = str(ROOT / "sncaffe")
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    ours = type(e).__module__.startswith("sncaffe") or (
        tb is not None and tb.tb_frame.f_code.co_filename.startswith(package)
        and type(e) in (ValueError, RuntimeError, OSError, FileNotFoundError, MemoryError))
    if ours and named in str(e):
        return "clean", type(e).__name__
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" at {last[0].filename.replace(str(ROOT) + '/', '')}:{last[0].lineno}" if last else ""
    unnamed = f" (names no {named})" if ours else ""
    return "foreign", f"{type(e).__name__}{where}{unnamed}: {str(e)[:300]}"


def worker(seeds: str) -> None:
    """Read "kind seed" lines on stdin; answer each with a JSON line."""
    import logging
    import warnings
    logging.getLogger("sncaffe").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    work = Path(tempfile.mkdtemp(prefix="fuzz-case-"))
    reader = Reader(Path(seeds), work)
    out = sys.stdout
    sys.stdout = sys.stderr          # anything a library prints stays off the answers
    for line in sys.stdin:
        kind, seed = line.split()
        reader.named = ""
        try:
            reader.case(kind, int(seed))
            answer = ("ok", "")
        except Exception as e:  # noqa: BLE001 - the point: classify every exception
            answer = classify(e, reader.named)
        out.write(json.dumps([kind, int(seed), *answer]) + "\n")
        out.flush()
    shutil.rmtree(work, ignore_errors=True)


# -- the driver --------------------------------------------------------------------------

class Worker:
    def __init__(self, seeds, env):
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(seeds)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                                     bufsize=1)
        self.case, self.since = None, None

    def send(self, case):
        self.case, self.since = case, time.monotonic()
        self.proc.stdin.write(f"{case[0]} {case[1]}\n")
        self.proc.stdin.flush()

    def kill(self):
        self.proc.kill()
        self.proc.wait()


def drive(n, kinds, jobs, timeout, show, first_seed=0):
    counts = {k: collections.Counter() for k in kinds}
    examples = collections.defaultdict(list)
    cases = [(kinds[i % len(kinds)], first_seed + i) for i in range(n)]
    seeds = Path(tempfile.mkdtemp(prefix="fuzz-seeds-"))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    try:
        make_seeds(seeds)
        pending = list(reversed(cases))
        workers = [Worker(seeds, env) for _ in range(jobs)]
        done, start = 0, time.monotonic()

        def record(case, outcome, detail):
            nonlocal done
            counts[case[0]][outcome] += 1
            done += 1
            if outcome != "ok" and outcome != "clean" and len(examples[(case[0], outcome)]) < show:
                examples[(case[0], outcome)].append(f"seed {case[1]}: {detail}")
            if done % 500 == 0:
                print(f"  {done}/{n} cases, {time.monotonic() - start:.0f} s", file=sys.stderr)

        while pending or any(w.case for w in workers):
            for w in workers:
                if w.case is None and pending:
                    w.send(pending.pop())
            ready, _, _ = select.select([w.proc.stdout for w in workers if w.case], [], [], 0.5)
            for i, w in enumerate(workers):
                if w.case is None:
                    continue
                if w.proc.stdout in ready:
                    line = w.proc.stdout.readline()
                    if line:
                        kind, seed, outcome, detail = json.loads(line)
                        case, w.case = w.case, None
                        record(case, outcome, detail)
                        continue
                    code = w.proc.wait()
                    record(w.case, "crash", f"worker exited with {code}")
                    workers[i] = Worker(seeds, env)
                elif time.monotonic() - w.since > timeout:
                    case = w.case
                    w.kill()
                    record(case, "hang", f"no answer in {timeout} s")
                    workers[i] = Worker(seeds, env)
        for w in workers:
            w.proc.stdin.close()
            w.proc.wait()
    finally:
        shutil.rmtree(seeds, ignore_errors=True)
    return counts, examples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=10000, help="cases in all, spread over the kinds (default 10000)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"a comma-separated subset of {', '.join(KINDS)}")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--timeout", type=float, default=30, help="seconds a case may take before it is a hang")
    ap.add_argument("--seed", type=int, default=0, help="the first case's number (cases are repeatable)")
    ap.add_argument("--show", type=int, default=3, help="examples shown per kind and outcome")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kind(s) {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
    t0 = time.monotonic()
    counts, examples = drive(args.n, kinds, args.jobs, args.timeout, args.show, args.seed)
    outcomes = ("ok", "clean", "foreign", "hang", "crash")
    print(f"{'kind':<12}" + "".join(f"{o:>9}" for o in outcomes))
    for k in kinds:
        print(f"{k:<12}" + "".join(f"{counts[k][o]:>9}" for o in outcomes))
    total = sum(counts.values(), collections.Counter())
    print(f"{'all':<12}" + "".join(f"{total[o]:>9}" for o in outcomes))
    print(f"{args.n} cases in {time.monotonic() - t0:.0f} s")
    for (k, o), lines in sorted(examples.items()):
        print(f"\n{k} {o}:")
        for line in lines:
            print("  " + line)
    return 1 if total["foreign"] + total["hang"] + total["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
