"""Caffe's update arithmetic: clip, normalize, regularize, then one rule per solver type.

Each rule's ``compute(diff, history, work, local_rate, iter)`` turns the
gradient in ``diff`` into the step that ``Net::Update`` subtracts from the
data, updating its history in place, with the operations of Caffe's CPU code
in the same order and in the params' dtype (float32 in a run), so results
match Caffe to rounding. ``history`` holds this param's history tensors (one,
or two for AdaDelta and Adam: Caffe's history_[i] and history_[n + i]);
``work`` holds two scratch arrays of the param's shape (Caffe's update_ and
temp_). Scalars are cast to the dtype first: a float64 scalar would make NumPy
compute in float64 and round differently from Caffe.
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import fused, onednn
from ..layers.base import array_module
from .lr_policy import SolverParamError


class Rule:
    type = None
    n_history = 1

    def __init__(self, param, dtype):
        self.dt = dtype.type
        self.momentum = self.dt(param.momentum)
        self.delta = self.dt(param.delta)
        self.configure(param)

    def configure(self, param):
        """Read this rule's own settings and check them, as Caffe's solver constructors do."""

    def compute(self, diff, history, work, local_rate, iter):
        raise NotImplementedError

    def step(self, data, diff, history, local_rate, local_decay, kind) -> bool:
        """``regularize``, ``compute`` and Net::Update's ``data -= diff`` at once where this rule
        can (the same bytes); False where the caller runs them."""
        return False


class SGD(Rule):
    """history = local_rate * diff + momentum * history; step = history."""
    type = "SGD"

    def compute(self, diff, history, work, local_rate, iter):
        (h,) = history
        h *= self.momentum
        diff *= local_rate
        h += diff
        diff[...] = h

    def step(self, data, diff, history, local_rate, local_decay, kind) -> bool:
        """Float32 parameters on the CPU where numba is installed: one compiled pass
        (``fused.sgd_step``: data, diff and history each read and written once), the bytes of
        NumPy's calls. Else large ones: three passes of oneDNN's binary kernel and a copy
        on all the threads (``onednn.flat``), each operation rounded as NumPy's calls above round
        it (so the same bytes), where NumPy takes six to eight passes on one: diff = ((data *
        decay) + diff) * rate; diff = (history * momentum) + diff; data = data - diff; history =
        diff (``onednn.copy_on_team``). In this order the new history is written where diff was
        just written, while it is still in cache, and the copy comes last."""
        if kind != "L2" and local_decay:
            return False
        (h,) = history
        if fused.usable(data, diff, h):         # one pass, compiled (backend/fused.py)
            fused.kernels().sgd_step(data, diff, h, local_decay, local_rate, self.momentum)
            return True
        view = onednn.flat(data.size)
        arrays = (data, diff, h)
        decayed = ((onednn.ADD, True), (onednn.MUL, False))
        first = onednn.binary_for(view, arrays, onednn.MUL, decayed if local_decay else ())
        then = onednn.binary_for(view, arrays, onednn.MUL, ((onednn.ADD, True),)) if first else None
        last = onednn.binary_for(view, arrays, onednn.SUB, full=True) if then else None
        if last is None:
            return False
        dt = self.dt
        if local_decay:
            first.run(data, np.array([local_decay], dt), diff, diff, np.array([local_rate], dt))
        else:
            first.run(diff, np.array([local_rate], dt), diff)
        then.run(h, np.array([self.momentum], dt), diff, diff)     # the new history, in diff
        last.run(data, diff, data)
        if not onednn.copy_on_team(diff, h):
            np.copyto(h, diff)
        return True


class Nesterov(Rule):
    """As SGD, then step back and over: step = (1 + momentum) * history - momentum * old history."""
    type = "Nesterov"

    def compute(self, diff, history, work, local_rate, iter):
        (h,), old = history, work[0]
        old[...] = h
        h *= self.momentum
        diff *= local_rate
        h += diff
        array_module(diff).multiply(h, self.dt(1) + self.momentum, out=diff)
        old *= -self.momentum
        diff += old


class AdaGrad(Rule):
    """history += diff^2; step = local_rate * diff / (sqrt(history) + delta)."""
    type = "AdaGrad"

    def configure(self, param):
        if param.momentum != 0:
            raise SolverParamError("momentum cannot be used with AdaGrad")

    def compute(self, diff, history, work, local_rate, iter):
        xp, (h,), u = array_module(diff), history, work[0]
        xp.multiply(diff, diff, out=u)
        h += u
        xp.sqrt(h, out=u)
        u += self.delta
        xp.divide(diff, u, out=u)
        xp.multiply(u, local_rate, out=diff)


class RMSProp(Rule):
    """history = (1 - rms_decay) * diff^2 + rms_decay * history; step as AdaGrad."""
    type = "RMSProp"

    def configure(self, param):
        if param.momentum != 0:
            raise SolverParamError("momentum cannot be used with RMSProp")
        if not 0 <= param.rms_decay <= 1:
            raise SolverParamError(f"rms_decay must be in [0, 1], got {param.rms_decay}")
        self.rms_decay = self.dt(param.rms_decay)

    def compute(self, diff, history, work, local_rate, iter):
        xp, (h,), u = array_module(diff), history, work[0]
        xp.multiply(diff, diff, out=u)
        u *= self.dt(1) - self.rms_decay
        h *= self.rms_decay
        h += u
        xp.sqrt(h, out=u)
        u += self.delta
        xp.divide(diff, u, out=u)
        xp.multiply(u, local_rate, out=diff)


class AdaDelta(Rule):
    """Zeiler's AdaDelta with Caffe's momentum as the decay and local_rate applied at the end."""
    type = "AdaDelta"
    n_history = 2

    def compute(self, diff, history, work, local_rate, iter):
        xp, (g2, s2), (u, t) = array_module(diff), history, work
        m, one_m = self.momentum, self.dt(1) - self.momentum
        xp.multiply(diff, diff, out=u)
        u *= one_m
        g2 *= m
        g2 += u                                  # E[g^2]
        xp.add(s2, self.delta, out=u)
        xp.add(g2, self.delta, out=t)
        xp.divide(u, t, out=u)
        xp.sqrt(u, out=u)
        diff *= u                                # the update, before the learning rate
        xp.multiply(diff, diff, out=u)
        u *= one_m
        s2 *= m
        s2 += u                                  # E[dx^2]
        diff *= local_rate


class Adam(Rule):
    """Kingma and Ba's Adam; Caffe folds the bias correction (t = iter + 1) into the rate."""
    type = "Adam"
    n_history = 2

    def configure(self, param):
        self.beta2 = self.dt(param.momentum2)

    def compute(self, diff, history, work, local_rate, iter):
        xp, (m, v), (t, _) = array_module(diff), history, work
        b1, b2 = self.momentum, self.beta2
        n = iter + 1
        correction = self.dt(math.sqrt(1.0 - float(b2) ** n) / (1.0 - float(b1) ** n))
        m *= b1
        xp.multiply(diff, self.dt(1) - b1, out=t)
        m += t
        xp.multiply(diff, diff, out=t)
        t *= self.dt(1) - b2
        v *= b2
        v += t
        xp.sqrt(v, out=t)
        t += self.delta
        xp.divide(m, t, out=t)
        xp.multiply(t, local_rate * correction, out=diff)


RULES = {cls.type: cls for cls in (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam)}
# The legacy solver_type enum (SolverParameter.SolverType), in its order.
LEGACY = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")


def make_rule(param, dtype) -> Rule:
    """The rule for ``type`` (or the legacy ``solver_type``), checked like Caffe's constructors."""
    name = param.type
    if param.HasField("solver_type"):
        legacy = LEGACY[param.solver_type]
        if param.HasField("type") and param.type != legacy:
            raise SolverParamError(f'solver_type {param.SolverType.Name(param.solver_type)} and type '
                                   f'"{param.type}" disagree; give only type')
        name = legacy
    cls = RULES.get(name)
    if cls is None:
        raise SolverParamError(f'unknown solver type "{name}" (one of: {", ".join(RULES)})')
    return cls(param, dtype)


# -- what every rule shares (SGDSolver::ClipGradients, Normalize, Regularize) --

def global_norm(diffs):
    """The L2 norm of all gradients together, as Caffe sums it: a BLAS dot per blob, in the dtype."""
    total = None
    for d in diffs:
        flat = d.ravel()
        sq = array_module(d).dot(flat, flat)
        total = sq if total is None else total + sq
    return array_module(total).sqrt(total) if total is not None else 0.0


def regularize(diff, data, local_decay, kind, work) -> None:
    """diff += local_decay * data (L2) or local_decay * sign(data) (L1)."""
    if not local_decay:
        return
    xp = array_module(diff)
    if kind == "L2":
        xp.multiply(data, local_decay, out=work)
    elif kind == "L1":
        xp.sign(data, out=work)
        work *= local_decay
    else:
        raise SolverParamError(f'unknown regularization_type "{kind}" (L1 or L2)')
    diff += work
