"""``from sncaffe.solver import Solver``: the solvers live in the package sncaffe/solvers/."""
from .solvers import (POLICIES, RULES, SnapshotError, Solver, SolverParamError,  # noqa: F401
                      TrainingError, learning_rate)
