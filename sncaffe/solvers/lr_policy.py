"""Caffe's learning-rate policies (SGDSolver::GetLearningRate).

``learning_rate(param, iter, current_step)`` returns ``(rate, current_step)``:
"step" recomputes current_step from iter, "multistep" advances it by at most
one per call (as Caffe does, so it must be called every iteration and
current_step is saved in the .solverstate); the others leave it alone. The
rate is rounded to float32 as Caffe's ``Dtype rate`` is, with float32 inputs.
"""
from __future__ import annotations

import math

import numpy as np

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")

f32 = np.float32


class SolverParamError(ValueError):
    """A SolverParameter that cannot be used, named by its field."""


def check_policy(param) -> None:
    """The checks Caffe makes (CHECK_GT/GE) before training starts, not at the first use."""
    policy = param.lr_policy
    if not param.HasField("lr_policy"):
        raise SolverParamError(f'lr_policy is not set (one of: {", ".join(POLICIES)})')
    if policy not in POLICIES:
        raise SolverParamError(f'unknown lr_policy "{policy}" (one of: {", ".join(POLICIES)})')
    if policy in ("step", "sigmoid") and param.stepsize <= 0:
        raise SolverParamError(f'lr_policy "{policy}" needs stepsize > 0 (got {param.stepsize})')
    if policy in ("step", "exp", "inv", "multistep", "sigmoid") and param.gamma < 0:
        raise SolverParamError(f'lr_policy "{policy}" needs gamma >= 0 (got {param.gamma})')
    if policy == "poly" and param.max_iter <= 0:
        raise SolverParamError('lr_policy "poly" needs max_iter > 0')


def learning_rate(param, iter: int, current_step: int = 0) -> tuple[float, int]:
    policy = param.lr_policy
    base_lr, gamma, power = f32(param.base_lr), f32(param.gamma), f32(param.power)
    if policy == "fixed":
        rate = base_lr
    elif policy == "step":
        current_step = iter // param.stepsize
        rate = float(base_lr) * float(gamma) ** current_step
    elif policy == "exp":
        rate = float(base_lr) * float(gamma) ** iter
    elif policy == "inv":
        rate = float(base_lr) * float(f32(1) + gamma * f32(iter)) ** -float(power)
    elif policy == "multistep":
        if current_step < len(param.stepvalue) and iter >= param.stepvalue[current_step]:
            current_step += 1
        rate = float(base_lr) * float(gamma) ** current_step
    elif policy == "poly":
        rate = float(base_lr) * float(f32(1) - f32(iter) / f32(param.max_iter)) ** float(power)
    elif policy == "sigmoid":
        rate = float(base_lr) / (1.0 + math.exp(-float(gamma) * float(f32(iter) - f32(param.stepsize))))
    else:
        check_policy(param)
    return float(f32(rate)), current_step
