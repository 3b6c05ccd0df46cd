"""Convert a list of images to an LMDB (or LevelDB) of Datum records, as Caffe's convert_imageset.

    python tools/convert_imageset.py ROOT/ LISTFILE OUT_LMDB [--resize_height H --resize_width W]
        [--gray] [--shuffle] [--encoded [--encode_type png|jpg]] [--check_size]

Each LISTFILE line is "path label" (split at the last space); images are read
from ROOT + path (a plain concatenation, as Caffe: end ROOT with a slash).
Raw datums hold the pixels as C x H x W uint8 in OpenCV's BGR order;
--encoded stores the image file itself when nothing about it changes (same
format, no resize, same colour), else the image re-encoded. Keys are
"%08d_path" in list order (after --shuffle).
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from sncaffe.data import datum, image  # noqa: E402
from sncaffe.data.leveldb import writer  # noqa: E402


def read_list(path):
    lines = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            name, _, label = line.rstrip().rpartition(" ")
            try:
                lines.append((name, int(label)))
            except ValueError:
                raise SystemExit(f'{path} line {n}: expected "path label", got {line!r}') from None
    return lines


def make_datum(path, label, args):
    x = image.load(path, args.resize_height, args.resize_width, not args.gray)   # a bad file fails here
    if not args.encoded:
        return datum.from_array(x, label)
    ext = Path(path).suffix.lstrip(".").lower()
    enc = args.encode_type or ext
    resized = args.resize_height > 0 and args.resize_width > 0
    if not resized and (ext == enc or (enc == "jpg" and ext == "jpeg")):
        return datum.encoded(Path(path).read_bytes(), label)     # the file itself (Caffe's ReadFileToDatum)
    return datum.encoded(image.encode(x, enc), label)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="folder prefix of the listed paths (end it with /)")
    ap.add_argument("listfile")
    ap.add_argument("out", help="the database to create (must not exist)")
    ap.add_argument("--gray", action="store_true", help="read images as greyscale")
    ap.add_argument("--shuffle", action="store_true", help="shuffle the list order")
    ap.add_argument("--seed", type=int, default=0, help="seed of --shuffle")
    ap.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"],
                    help="database to write (default: %(default)s; leveldb needs plyvel)")
    ap.add_argument("--resize_height", type=int, default=0)
    ap.add_argument("--resize_width", type=int, default=0)
    ap.add_argument("--check_size", action="store_true", help="check that all datums have the same size")
    ap.add_argument("--encoded", action="store_true", help="store encoded images in the datums")
    ap.add_argument("--encode_type", default="", type=str.lower,
                    help="png, jpg, ...: re-encode in this format (default: each file's own)")
    args = ap.parse_args(argv)
    lines = read_list(args.listfile)
    if args.shuffle:
        random.Random(args.seed).shuffle(lines)
    print(f"A total of {len(lines)} images.")
    shape, count = None, 0
    try:
        with writer(args.out, args.backend) as db:
            for i, (name, label) in enumerate(lines):
                try:
                    d = make_datum(args.root + name, label, args)
                except ValueError as e:
                    print(f"Could not open or find file {args.root + name}: {e}", file=sys.stderr)
                    continue
                if args.check_size and not d.encoded:
                    s = (d.channels, d.height, d.width)
                    if shape is not None and s != shape:
                        raise SystemExit(f"{args.root + name}: shape {s}, the first image {shape} (--check_size)")
                    shape = s
                db.put(f"{i:08d}_{name}", d.SerializeToString())
                count += 1
    except (FileExistsError, ImportError) as e:
        raise SystemExit(str(e))
    print(f"Processed {count} files into {args.out}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
