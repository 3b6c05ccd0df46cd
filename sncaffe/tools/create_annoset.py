"""Write an LMDB (or LevelDB) of SSD's AnnotatedDatum records from a list of images and their boxes,
as SSD's create_annoset / convert_annoset.

    create_annoset ROOT/ LISTFILE OUT_LMDB [--label-type txt|xml] [--label-map-file labelmap.prototxt]
        [--resize_height H --resize_width W] [--gray] [--shuffle] [--encoded [--encode_type png|jpg]]

Each LISTFILE line is "image annotation", both paths under ROOT (a plain concatenation, as
Caffe: end ROOT with a slash). A txt annotation holds one box a line, "label xmin ymin xmax ymax"
in pixels of the original image; an xml one is a PASCAL VOC file (object name, difficult,
bndbox), its names turned into labels by the label map (a LabelMap prototxt). Boxes are stored
normalised by the original image's width and height, grouped by label; keys are "%08d_image"
in list order (after --shuffle).
"""
from __future__ import annotations

import argparse
import random
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from sncaffe.data import annotated, datum, image
from sncaffe.data.leveldb import writer


def read_list(path):
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            parts = line.split()
            if len(parts) != 2:
                raise SystemExit(f'{path} line {n}: expected "image annotation", got {line!r}')
            pairs.append(tuple(parts))
    return pairs


def read_label_map(path) -> dict:
    """name -> label from a LabelMap prototxt."""
    from google.protobuf import text_format
    from sncaffe.proto import sncaffe_pb2 as pb
    try:
        m = text_format.Parse(Path(path).read_text(), pb.LabelMap())
    except (OSError, text_format.ParseError) as e:
        raise SystemExit(f"label map {path}: {e}") from None
    return {item.name: item.label for item in m.item}


def txt_boxes(path, height, width):
    """Rows [label, xmin, ymin, xmax, ymax, 0] normalised, from "label xmin ymin xmax ymax" lines."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        v = line.split()
        try:
            label, box = int(v[0]), [float(x) for x in v[1:5]]
            if len(v) != 5:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f'{path} line {n}: expected "label xmin ymin xmax ymax", got {line!r}') from None
        rows.append([label, box[0] / width, box[1] / height, box[2] / width, box[3] / height, 0])
    return rows


def xml_boxes(path, height, width, labels):
    """Rows from a PASCAL VOC annotation; its size must be the image's."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise ValueError(f"{path}: {e}") from None
    size = root.find("size")
    if size is not None:
        w, h = int(float(size.findtext("width", "0"))), int(float(size.findtext("height", "0")))
        if (w, h) != (width, height):
            raise ValueError(f"{path}: size {w}x{h}, the image is {width}x{height}")
    rows = []
    for obj in root.iter("object"):
        name = obj.findtext("name", "").strip()
        if name not in labels:
            raise ValueError(f'{path}: object "{name}" is not in the label map')
        b = obj.find("bndbox")
        xmin, ymin, xmax, ymax = (float(b.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
        difficult = int(obj.findtext("difficult", "0").strip() or 0)
        rows.append([labels[name], xmin / width, ymin / height, xmax / width, ymax / height, difficult])
    return rows


def make_record(img_path, anno_path, args, labels):
    original = image.load(img_path, 0, 0, not args.gray)
    _, height, width = original.shape
    if args.label_type == "xml":
        rows = xml_boxes(anno_path, height, width, labels)
    else:
        rows = txt_boxes(anno_path, height, width)
    x = original
    if args.resize_height > 0 and args.resize_width > 0:
        x = image.load(img_path, args.resize_height, args.resize_width, not args.gray)
    if args.encoded:
        d = datum.encoded(image.encode(x, args.encode_type or Path(img_path).suffix.lstrip(".").lower() or "png"))
    else:
        d = datum.from_array(x)
    return annotated.make(d, rows), len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="folder prefix of the listed paths (end it with /)")
    ap.add_argument("listfile")
    ap.add_argument("out", help="the database to create (must not exist)")
    ap.add_argument("--label-type", "--label_type", dest="label_type", default="txt", choices=["txt", "xml"])
    ap.add_argument("--label-map-file", "--label_map_file", dest="label_map_file", default="",
                    help="LabelMap prototxt: object names of xml annotations -> labels")
    ap.add_argument("--gray", action="store_true", help="read images as greyscale")
    ap.add_argument("--shuffle", action="store_true", help="shuffle the list order")
    ap.add_argument("--seed", type=int, default=0, help="seed of --shuffle")
    ap.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"])
    ap.add_argument("--resize_height", "--resize-height", type=int, default=0)
    ap.add_argument("--resize_width", "--resize-width", type=int, default=0)
    ap.add_argument("--encoded", action="store_true", help="store encoded images in the datums")
    ap.add_argument("--encode_type", "--encode-type", default="", type=str.lower,
                    help="png, jpg, ...: the encoding (default: each file's own format)")
    args = ap.parse_args(argv)
    if args.label_type == "xml" and not args.label_map_file:
        raise SystemExit("--label-type xml needs --label-map-file (object names -> labels)")
    labels = read_label_map(args.label_map_file) if args.label_map_file else {}
    pairs = read_list(args.listfile)
    if args.shuffle:
        random.Random(args.seed).shuffle(pairs)
    print(f"A total of {len(pairs)} images.")
    count = boxes = 0
    try:
        with writer(args.out, args.backend) as db:
            for i, (img, anno) in enumerate(pairs):
                try:
                    record, n = make_record(args.root + img, args.root + anno, args, labels)
                except (ValueError, OSError) as e:
                    print(f"Could not read {args.root + img} / {args.root + anno}: {e}", file=sys.stderr)
                    continue
                db.put(f"{i:08d}_{img}", record.SerializeToString())
                count, boxes = count + 1, boxes + n
    except (FileExistsError, ImportError) as e:
        raise SystemExit(str(e))
    print(f"Processed {count} files ({boxes} boxes) into {args.out}.")
    return 0 if count else 1


if __name__ == "__main__":
    sys.exit(main())

