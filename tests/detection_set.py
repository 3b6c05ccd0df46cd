"""A synthetic detection set for the SSD tests: images of 32x32 to 64x64 with one or two filled
rectangles, red (label 1) or green (label 2), on a dark noisy background; written as PNG files with
create_annoset's txt annotations ("label xmin ymin xmax ymax" in pixels) and a list file."""
from pathlib import Path

import numpy as np

from sncaffe.data import image

COLOURS = {1: (40, 40, 220), 2: (40, 200, 40)}      # BGR, as OpenCV writes


def make_images(n, seed=0):
    """[(image (3, H, W) uint8 BGR, boxes [(label, xmin, ymin, xmax, ymax)] in pixels)]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h, w = (int(v) for v in rng.integers(32, 65, 2))
        x = rng.integers(0, 40, (3, h, w)).astype(np.uint8)
        boxes = []
        for _ in range(int(rng.integers(1, 3))):
            label = int(rng.integers(1, 3))
            bw, bh = int(rng.integers(w // 4, w // 2 + 1)), int(rng.integers(h // 4, h // 2 + 1))
            x0, y0 = int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1))
            x[:, y0:y0 + bh, x0:x0 + bw] = np.asarray(COLOURS[label], np.uint8)[:, None, None]
            boxes.append((label, x0, y0, x0 + bw, y0 + bh))
        out.append((x, boxes))
    return out


def write_set(folder: Path, n, seed=0):
    """Write the images and annotations under ``folder``; returns (list file, the made items)."""
    folder.mkdir(parents=True, exist_ok=True)
    items = make_images(n, seed)
    lines = []
    for i, (x, boxes) in enumerate(items):
        (folder / f"{i}.png").write_bytes(image.encode(x, "png"))
        (folder / f"{i}.txt").write_text("".join(f"{b[0]} {b[1]} {b[2]} {b[3]} {b[4]}\n" for b in boxes))
        lines.append(f"{i}.png {i}.txt\n")
    listfile = folder / "list.txt"
    listfile.write_text("".join(lines))
    return listfile, items
