"""A snapshot is a pair, <prefix>_iter_N.caffemodel and .solverstate, written as one unit.

Both files are written in full to temporary names (``.tmp<PID>``) and synced, then renamed:
the model first, the state last, so a .solverstate on disk always has its complete
.caffemodel, and a resume (which starts from a .solverstate) never sees half a pair. The next
start removes only the temporary files of processes no longer running. A model without its
state (a kill between the two renames, or a user's own file) is never removed: it is no pair,
so nothing resumes from it, and a snapshot that takes its name moves it aside first.
"""
from __future__ import annotations

import glob
import logging
import os
import re

log = logging.getLogger("sncaffe")

_TMP = re.compile(r"\.tmp(\d+)$")


class SnapshotWriteError(RuntimeError):
    """A snapshot that could not be written (disk full, no permission); the previous pair is kept."""


def _write(path, chunks) -> None:
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path) -> None:
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_pair(model, model_chunks, state, state_chunks, kept="") -> None:
    """Write both files or neither; an OSError becomes a SnapshotWriteError naming the path."""
    tmps = [f"{model}.tmp{os.getpid()}", f"{state}.tmp{os.getpid()}"]
    target = tmps[0]
    try:
        _write(tmps[0], model_chunks)
        target = tmps[1]
        _write(tmps[1], state_chunks)
        target = model
        _keep_lone_model(model, state)
        os.replace(tmps[0], model)
        target = state
        os.replace(tmps[1], state)           # the commit: from here the pair exists
        _sync_dir(state)
    except BaseException as e:
        for t in tmps:
            try:
                os.remove(t)
            except OSError:
                pass
        if isinstance(e, OSError):
            what = e.strerror or str(e)
            raise SnapshotWriteError(f"cannot write snapshot {_final(target)}: {what}{kept}") from None
        raise


def _keep_lone_model(model, state) -> None:
    """A .caffemodel at the name a snapshot is about to take, with no .solverstate beside it, is no
    snapshot of a run (the user's weights, or a pair whose state was deleted): move it aside, never
    replace it."""
    if not os.path.exists(model) or os.path.exists(state):
        return
    stem = model[:-len(".caffemodel")]
    aside, n = f"{stem}.kept.caffemodel", 1
    while os.path.exists(aside):
        aside, n = f"{stem}.kept{n}.caffemodel", n + 1
    os.rename(model, aside)
    log.warning("%s was there without a .solverstate: kept as %s, as the snapshot takes its name", model, aside)


def _final(path: str) -> str:
    return _TMP.sub("", path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _iteration(path: str, ext: str) -> int | None:
    m = re.search(r"_iter_(\d+)" + re.escape(ext) + "$", path)
    return int(m.group(1)) if m else None


def pairs(prefix) -> list:
    """(iteration, caffemodel, solverstate) of the complete pairs under ``prefix``, oldest first."""
    out = []
    for state in glob.glob(glob.escape(prefix) + "_iter_*.solverstate"):
        n = _iteration(state, ".solverstate")
        model = state[:-len(".solverstate")] + ".caffemodel"
        if n is not None and os.path.isfile(model):
            out.append((n, model, state))
    return sorted(out)


def latest(prefix):
    """The newest complete (caffemodel, solverstate) pair under ``prefix``, or None."""
    found = pairs(prefix)
    return found[-1][1:] if found else None


def clean(prefix) -> list:
    """Remove the temporary files that snapshots of processes no longer running left under
    ``prefix``; returns them. Finished files are the user's and are kept, pair or not."""
    removed = []
    for tmp in glob.glob(glob.escape(prefix) + "_iter_*.tmp*"):
        m = _TMP.search(tmp)
        ours = any(_iteration(_final(tmp), ext) is not None for ext in (".caffemodel", ".solverstate"))
        if m and ours and not _alive(int(m.group(1))):
            removed.append(tmp)
    for path in removed:
        try:
            os.remove(path)
        except OSError:
            continue
        log.info("Removed %s, left by an interrupted snapshot", path)
    newest = max((n for n, _, _ in pairs(prefix)), default=-1)
    lone = sorted(m for m in glob.glob(glob.escape(prefix) + "_iter_*.caffemodel")
                  if (_iteration(m, ".caffemodel") or -1) > newest
                  and not os.path.exists(m[:-len(".caffemodel")] + ".solverstate"))
    if lone:
        log.info("Kept %d .caffemodel file(s) without a .solverstate (e.g. %s): not a snapshot pair, "
                 "so never resumed from", len(lone), lone[-1])
    return removed
