"""Caffe's tools/extra/parse_log.py for sncaffe's (and Caffe's) training logs, and ``sncaffe plot``.

    parse_log LOGFILE OUTPUT_DIR [--delimiter ,] [--verbose]

writes OUTPUT_DIR/LOGFILE.train and .test as Caffe's script does: one row per
display (train) or test, columns NumIters, Seconds, LearningRate and one per
net output (train: loss; LeNet's test: accuracy, loss). Seconds count from the
"Solving" line. Lines carry glog's prefix (``I1201 14:37:17.123456 ...``, what
``sncaffe train`` writes to a pipe or file) or the terminal's ``14:37:17``.
A last row still open at the end of the log is kept (Caffe's script drops it).
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import logging
import math
import os
import re
import sys
from collections import OrderedDict
from contextlib import contextmanager

ITERATION = re.compile(r"Iteration (\d+)")
TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+|nan|inf|-inf)")
TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+|nan|inf|-inf)")
LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)\s")
SHORT = re.compile(r"^(\d\d):(\d\d):(\d\d) ")


def line_time(line, year):
    """The timestamp of a log line (glog's, or the terminal's HH:MM:SS), or None."""
    m = GLOG.match(line)
    if m:
        month, day, h, mi, s = (int(x) for x in m.groups()[:5])
        return dt.datetime(year, month, day, h, mi, s, int(m.group(6)[:6].ljust(6, "0")))
    m = SHORT.match(line)
    if m:
        h, mi, s = (int(x) for x in m.groups())
        return dt.datetime(year, 1, 1, h, mi, s)
    return None


class LogParser:
    """Caffe's parse_log, fed a line at a time: ``rows["train"]``/``rows["test"]`` and ``on_row(phase, row)``
    as each row is complete."""

    def __init__(self, on_row=None):
        self.on_row = on_row
        self.iteration = -1
        self.learning_rate = float("nan")
        self.start = None
        self.rows = {"train": [], "test": []}
        self.open = {"train": None, "test": None}

    def feed(self, line, seconds_since_epoch):
        """One line, at ``seconds_since_epoch`` (a float) or a datetime."""
        t = seconds_since_epoch
        if isinstance(t, dt.datetime):
            t = t.timestamp()
        if self.start is None and "Solving" in line:
            self.start = t
        m = ITERATION.search(line)
        if m:
            self.iteration = float(m.group(1))
        if self.iteration == -1:
            return              # Caffe parses only from the first iteration on
        seconds = t - (self.start if self.start is not None else t)
        m = LEARNING_RATE.search(line)
        if m:
            self.learning_rate = float(m.group(1))
        self._output("train", TRAIN_OUTPUT, line, seconds)
        self._output("test", TEST_OUTPUT, line, seconds)

    def _push(self, phase, row):
        rows = self.rows[phase]
        rows.append(row)
        if len(rows) == 2 and math.isnan(rows[0]["LearningRate"]):
            rows[0]["LearningRate"] = rows[1]["LearningRate"]     # Caffe's fix_initial_nan_learning_rate
        if self.on_row is not None:
            self.on_row(phase, dict(row))

    def _output(self, phase, regex, line, seconds):
        row, rows = self.open[phase], self.rows[phase]
        m = regex.search(line)
        if m:
            if not row or row["NumIters"] != self.iteration:
                if row:
                    self._push(phase, row)
                row = OrderedDict([("NumIters", self.iteration), ("Seconds", seconds),
                                   ("LearningRate", self.learning_rate)])
            row[m.group(2)] = float(m.group(3))
        if row and rows and len(row) == len(rows[0]):
            self._push(phase, row)          # full: as many columns as the first row
            row = None
        self.open[phase] = row

    def finish(self):
        for phase, row in self.open.items():
            if row:
                self._push(phase, row)
            self.open[phase] = None
        return self.rows


class MetricsHandler(logging.Handler):
    """Turns the solver's display and test lines into JSON lines, as parse_log reads them."""

    def __init__(self, path):
        super().__init__(logging.INFO)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.file = open(path, "w")
        self.parser = LogParser(on_row=self.write)

    def write(self, phase, row):
        row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
        self.file.write(json.dumps({"phase": phase, **row}) + "\n")
        self.file.flush()

    def emit(self, record):
        self.parser.feed(record.getMessage(), record.created)

    def close(self):
        self.parser.finish()
        self.file.close()
        super().close()


@contextmanager
def metrics_log(path):
    """While the block runs, the "sncaffe" logger's display and test lines go to ``path`` as JSON lines."""
    handler = MetricsHandler(path)
    logger = logging.getLogger("sncaffe")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        handler.close()


def parse_log(path):
    """(train rows, test rows) of a log file, as Caffe's parse_log.parse_log returns them."""
    year = dt.datetime.fromtimestamp(os.path.getmtime(path)).year
    parser = LogParser()
    last = None
    with open(path, errors="replace") as f:
        for line in f:
            t = line_time(line, year)
            if t is None:
                continue        # Caffe's script skips lines without a timestamp
            if last is not None and t.month < last.month:
                year += 1       # the log ran into a new year
                t = line_time(line, year)
            elif last is not None and t < last and GLOG.match(line) is None:
                t += dt.timedelta(days=(last - t).days + 1)      # HH:MM:SS past midnight
            last = t
            parser.feed(line, t)
    rows = parser.finish()
    return rows["train"], rows["test"]


def write_csv(path, rows, delimiter=",", verbose=False):
    if not rows:
        if verbose:
            print(f"Not writing {path}; no lines to write")
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()), delimiter=delimiter, lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
    if verbose:
        print(f"Wrote {path}")


def save_csv_files(log_path, output_dir, train, test, delimiter=",", verbose=False):
    base = os.path.basename(log_path)
    write_csv(os.path.join(output_dir, base + ".train"), train, delimiter, verbose)
    write_csv(os.path.join(output_dir, base + ".test"), test, delimiter, verbose)


def plot(log_path, out_png):
    """Training curves of a log: losses, accuracies and the learning rate against iterations."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train, test = parse_log(log_path)
    if not train and not test:
        raise ValueError(f"{log_path}: no display or test lines (Train/Test net output) to plot")
    fixed = ("NumIters", "Seconds", "LearningRate")
    fig, (loss_ax, acc_ax, lr_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for phase, rows in (("train", train), ("test", test)):
        for name in [k for k in (rows[0] if rows else {}) if k not in fixed]:
            ax = acc_ax if "acc" in name.lower() else loss_ax
            ax.plot([r["NumIters"] for r in rows if name in r], [r[name] for r in rows if name in r],
                    label=f"{phase} {name}", marker="." if phase == "test" else None)
    rows = train or test
    lr_ax.plot([r["NumIters"] for r in rows], [r["LearningRate"] for r in rows], label="learning rate")
    for ax, title in ((loss_ax, "loss"), (acc_ax, "accuracy"), (lr_ax, "learning rate")):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
    lr_ax.set_xlabel("iteration")
    loss_ax.set_title(os.path.basename(log_path))
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    try:
        fig.savefig(out_png, dpi=80)
    except ValueError as e:             # matplotlib's "Format 'xyz' is not supported ...": name the file
        raise ValueError(f"{out_png}: {e}") from None
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Parse a Caffe/sncaffe training log into train and test CSV files")
    ap.add_argument("logfile_path", help="Path to log file")
    ap.add_argument("output_dir", help="Directory in which to place output CSV files")
    ap.add_argument("--verbose", action="store_true", help="Print some extra info (e.g., output filenames)")
    ap.add_argument("--delimiter", default=",", help="Column delimiter in output files (default: '%(default)s')")
    args = ap.parse_args(argv)
    try:
        train, test = parse_log(args.logfile_path)
        save_csv_files(args.logfile_path, args.output_dir, train, test, args.delimiter, args.verbose)
    except OSError as e:
        print(f"parse_log: error: {e.filename or args.logfile_path}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
