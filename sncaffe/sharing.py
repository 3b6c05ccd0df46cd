"""Parameters shared by ParamSpec ``name``, as Caffe's Net::AppendParam.

The first layer that names a parameter owns it; a later layer naming it shares the owner's data
and diff (one tensor in the memory plan: the sharer's tensors are views of the owner's, and its
gradient adds into the owner's diff). The solver sees owners only (Caffe's learnable_params),
with Caffe's multiplier rules: a sharer's lr_mult/decay_mult fills in what the owner left unset
and must equal what it set. Shapes must match exactly, or only in count with share_mode
PERMISSIVE.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .proto import sncaffe_pb2 as pb

log = logging.getLogger("sncaffe")


@dataclass(eq=False)
class LearnableParam:
    """One of Caffe's learnable_params: the owner's blob, its multipliers and who shares it."""
    layer: str                      # the owner layer's name
    index: int                      # the owner's param index
    data: object                    # graph.Tensor
    diff: object
    lr_mult: float = 1.0
    decay_mult: float = 1.0
    has_lr: bool = False
    has_decay: bool = False
    name: str = ""                  # ParamSpec name ("": anonymous)
    sharers: list = field(default_factory=list)     # [(layer name, index)]


def append_params(node, dtype, learnable: list, owners: dict, make_tensor, error) -> None:
    """Tensors for ``node``'s parameters (owned or shared); fills ``node.param_owner``.

    ``owners``: ParamSpec name -> LearnableParam; ``make_tensor(name, shape, kind, base)``
    builds a graph Tensor; ``error(msg)`` builds the exception to raise."""
    lp, layer = node.layer.param, node.layer
    node.param_owner = []
    for i, shape in enumerate(layer.param_shapes):
        shape = tuple(shape)
        spec = lp.param[i] if i < len(lp.param) else pb.ParamSpec()
        owner = owners.get(spec.name) if spec.name else None
        if owner is None:
            data = make_tensor(f"{lp.name}[{i}]", shape, "param", None)
            diff = make_tensor(f"{lp.name}[{i}].diff", shape, "param_diff", None)
            q = LearnableParam(lp.name, i, data, diff, spec.lr_mult, spec.decay_mult,
                               spec.HasField("lr_mult"), spec.HasField("decay_mult"), spec.name)
            learnable.append(q)
            if spec.name:
                owners[spec.name] = q
            node.param_owner.append(None)
        else:
            log.info("Sharing parameters '%s' owned by layer '%s', param index %d", spec.name, owner.layer,
                     owner.index)
            _check_shape(lp, spec, shape, owner, error)
            _merge_mult(lp, spec, owner, "lr_mult", "has_lr", error)
            _merge_mult(lp, spec, owner, "decay_mult", "has_decay", error)
            # views of the owner's tensors (PERMISSIVE may give them another shape)
            data = make_tensor(f"{lp.name}[{i}]", shape, "param", owner.data)
            diff = make_tensor(f"{lp.name}[{i}].diff", shape, "param_diff", owner.diff)
            owner.sharers.append((lp.name, i))
            node.param_owner.append((owner.layer, owner.index))
        node.params.append((data, diff))
        # Caffe's param_propagate_down: the layer's own spec decides, not the owner's
        node.param_need_backward.append(layer.learnable and spec.lr_mult != 0)


def _check_shape(lp, spec, shape, owner, error):
    theirs = tuple(owner.data.shape)
    if spec.share_mode == pb.ParamSpec.PERMISSIVE:
        if math.prod(shape) != math.prod(theirs):
            raise error(f'layer "{lp.name}": '
                        f"cannot share param '{spec.name}' owned by layer '{owner.layer}' with layer "
                        f"'{lp.name}'; count mismatch. Owner layer param shape is {theirs}; sharing layer "
                        f"shape is {shape}")
    elif shape != theirs:
        raise error(f'layer "{lp.name}": '
                    f"cannot share param '{spec.name}' owned by layer '{owner.layer}' with layer "
                    f"'{lp.name}'; shape mismatch. Owner layer param shape is {theirs}; sharing layer "
                    f"expects shape {shape} (share_mode PERMISSIVE checks only the count)")


def _merge_mult(lp, spec, owner, what, has, error):
    if not spec.HasField(what):
        return
    mine = getattr(spec, what)
    if getattr(owner, has):
        if mine != getattr(owner, what):
            raise error(f'layer "{lp.name}": shared param \'{spec.name}\' has mismatched {what} '
                        f'({mine:g} vs. {getattr(owner, what):g} in its owner, layer "{owner.layer}")')
    else:
        setattr(owner, has, True)
        setattr(owner, what, mine)


def frozen_shared(nodes) -> None:
    """``node.frozen_diffs``: {param index: workspace key} for parameters this layer does not learn
    (lr_mult 0) while a sharer does. Backward writes their gradient into that workspace, which is
    dropped, so the shared diff holds only the learners' sum (Caffe skips such gradients)."""
    learned = {id(d.root) for n in nodes for (_, d), need in zip(n.params, n.param_need_backward) if need}
    for node in nodes:
        node.frozen_diffs = {i: f"frozen_param{i}_diff" for i, ((_, d), need)
                             in enumerate(zip(node.params, node.param_need_backward))
                             if not need and id(d.root) in learned}
