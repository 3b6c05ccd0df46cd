"""SSD's ``AnnotatedDatum`` record <-> an image and its boxes.

A box row is [label, instance_id, xmin, ymin, xmax, ymax, difficult], the coordinates normalised
to the image's width and height, as SSD's create_annoset stores them: one AnnotationGroup per
label, its annotations numbered by instance_id in the order the boxes come.
"""
from __future__ import annotations

import numpy as np

from ..proto import sncaffe_pb2 as pb
from .datum import parse as parse_record


def parse(value: bytes, what="record") -> "pb.AnnotatedDatum":
    record = parse_record(value, what, pb.AnnotatedDatum())
    if not record.HasField("datum"):
        raise ValueError(f"{what}: an AnnotatedDatum without its datum (is this a plain Datum database? "
                         'read it with type "Data")')
    return record


def boxes(record) -> np.ndarray:
    """The record's boxes as rows (n, 7): label, instance_id, xmin, ymin, xmax, ymax, difficult."""
    rows = [(g.group_label, a.instance_id, a.bbox.xmin, a.bbox.ymin, a.bbox.xmax, a.bbox.ymax, a.bbox.difficult)
            for g in record.annotation_group for a in g.annotation]
    return np.asarray(rows, np.float64).reshape(-1, 7)


def count(record) -> int:
    return sum(len(g.annotation) for g in record.annotation_group)


def make(datum, rows) -> "pb.AnnotatedDatum":
    """An AnnotatedDatum of BBOX type from a Datum and box rows [label, xmin, ymin, xmax, ymax
    (, difficult)] in normalised coordinates, grouped by label in the order labels first appear."""
    record = pb.AnnotatedDatum(type=pb.AnnotatedDatum.BBOX)
    record.datum.CopyFrom(datum)
    groups = {}
    for row in rows:
        label, box = int(row[0]), [float(v) for v in row[1:5]]
        difficult = bool(row[5]) if len(row) > 5 else False
        if label not in groups:
            groups[label] = record.annotation_group.add(group_label=label)
        group = groups[label]
        a = group.annotation.add(instance_id=len(group.annotation))
        a.bbox.xmin, a.bbox.ymin, a.bbox.xmax, a.bbox.ymax = box
        a.bbox.difficult = difficult
    return record
