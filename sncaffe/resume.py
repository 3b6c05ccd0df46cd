"""Where every layer's data and random streams stand, for a bit-exact resume.

A snapshot records, per layer of the train and test nets, the NumPy random stream (Dropout's
masks, random fillers) and, for data layers, their cursor (``resume_state()``: the LMDB key,
HDF5 file and row, image-list position, with the shuffle and transform stream they draw from).
It is stored in the .solverstate's ``layer_state`` (a field of sncaffe's own, which Caffe
skips); a .solverstate without it resumes as Caffe does, with the readers at their start.
"""
from __future__ import annotations

import json

import numpy as np

from .proto import sncaffe_pb2 as pb


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    raise TypeError(f"{type(x).__name__} in a layer's resume state")


def layer_states(nets: dict) -> list:
    """LayerState messages for ``nets`` ({"train": net, "test#0": net, ...})."""
    out = []
    for label, net in nets.items():
        for node in net.graph.layers:
            layer = node.layer
            state = pb.LayerState(net=label, layer=node.name)
            if hasattr(layer, "resume_state"):       # its cursor holds its random stream too
                cursor = layer.resume_state()
                if cursor is None:                   # a reader without a cursor starts over
                    continue
                state.cursor = json.dumps(cursor, default=_plain)
            else:
                state.rng = json.dumps(layer.rng.bit_generator.state)
            out.append(state)
    return out


def restore_layer_states(nets: dict, states, where: str) -> int:
    """Put each recorded state back into the layer of that net and name; returns how many."""
    layers = {(label, node.name): node.layer for label, net in nets.items() for node in net.graph.layers}
    done = 0
    for s in states:
        if any(isinstance(v, bytes) for v in (s.net, s.layer, s.rng, s.cursor)):   # not UTF-8 text
            raise ValueError(f"{where}: a layer_state field is not text")
        layer = layers.get((s.net, s.layer))
        if layer is None:
            continue
        try:
            if s.cursor and hasattr(layer, "restore_state"):
                layer.restore_state(json.loads(s.cursor))
            elif s.rng:
                layer.rng.bit_generator.state = json.loads(s.rng)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f'{where}: the resume state of layer "{s.layer}" ({s.net} net) does not fit it: '
                             f"{e}") from None
        done += 1
    return done
