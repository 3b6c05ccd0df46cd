"""Where a net's layers run, as the command line spells it: ``--place conv3=cpu:1,fc6=cpu:2``
(model parallelism: each named layer and the layers after it at a location) and
``--replicas cpu:0,cpu:1`` (data parallelism in one process), applied to a net or to every
net of a solver; and how many workers of this machine share its cores."""
from __future__ import annotations

import os

from ..proto import sncaffe_pb2 as pb
from ..prototxt import place, read_text, set_batch
from ..upgrade import upgrade_net
from ..validate import PrototxtError
from .replicas import replicate


def placement(spec, param) -> dict:
    """``conv3=cpu:1,fc6=cpu:2`` as {layer: location} for every layer from each named one on
    (in file order, up to the next named one)."""
    marks = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        layer, sep, loc = item.partition("=")
        if not sep or not loc:
            raise ValueError(f"--place: expected LAYER=LOCATION, got {item!r}")
        marks[layer] = loc
    names = [layer.name for layer in param.layer]
    unknown = sorted(set(marks) - set(names))
    if unknown:
        raise PrototxtError(f'--place names unknown layer "{unknown[0]}"')
    out, current = {}, None
    for name in names:
        current = marks.get(name, current)
        if current is not None:
            out[name] = current
    return out


def placed(param, spec=None, batch=None):
    """``param`` upgraded (a V0/V1 net: placement and drawing see its layers), with every batch
    size set to ``batch`` and the placement ``spec`` applied."""
    param = upgrade_net(set_batch(param, batch) if batch else param)
    return place(param, placement(spec, param)) if spec else param


def locations(spec) -> list:
    """``cpu:0,cpu:1`` as a list of locations (empty for None)."""
    return [x.strip() for x in (spec or "").split(",") if x.strip()]


def place_solver_nets(p, batch=None, spec=None, replicas=None) -> None:
    """A solver's net files read into its *_param fields, each net with ``batch``, ``spec``
    and ``replicas`` applied (nothing is read when none is given)."""
    if not (batch or spec or replicas):
        return
    if spec and replicas:
        raise ValueError("--replicas places the layers itself: give --place or --replicas, not both")
    for field in ("net", "train_net"):
        if p.HasField(field):
            getattr(p, field + "_param").CopyFrom(read_text(getattr(p, field), pb.NetParameter()))
            p.ClearField(field)
    for f in p.test_net:
        p.test_net_param.add().CopyFrom(read_text(f, pb.NetParameter()))
    del p.test_net[:]
    nets = [getattr(p, f) for f in ("net_param", "train_net_param") if p.HasField(f)] + list(p.test_net_param)
    for q in nets:
        q.CopyFrom(placed(q, spec, batch))
        if replicas:
            q.CopyFrom(replicate(q, locations(replicas)))


def sharing(replicas=None) -> tuple:
    """(share, by): how many replicas of this process, or ranks of this machine's job (from the
    launcher's environment: MPICH's, Open MPI's), compute at once on its cores."""
    if replicas:
        return len(locations(replicas)), "replicas"
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var])), "ranks"
    return 1, "ranks"
