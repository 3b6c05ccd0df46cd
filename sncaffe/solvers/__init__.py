"""Solvers, as Caffe's: update rules (update.py), learning-rate policies (lr_policy.py), the loop (solver.py)."""
from .lr_policy import POLICIES, SolverParamError, learning_rate  # noqa: F401
from .solver import SnapshotError, Solver, TrainingError  # noqa: F401
from .update import RULES  # noqa: F401
