"""pycaffe's solvers over sncaffe.Solver: SGDSolver ... AdamSolver and get_solver.

``SGDSolver(file)`` trains with SGD whatever the file's ``type`` says, as in
pycaffe; ``get_solver(file)`` takes the file's type. The solver runs on the
device of ``caffe.set_mode_*`` (pycaffe ignores ``solver_mode``); ``solver.net``
and ``solver.test_nets`` are pycaffe Nets over the solver's own nets.
"""
from __future__ import annotations

from ..proto import sncaffe_pb2 as pb
from ..prototxt import read_solver
from ..solvers import solver as _sn
from . import mode as _caffe
from .net import KeptNet, Net


class _KeptSolver(_sn.Solver):
    """sncaffe.Solver whose nets keep the blobs named in ``keep`` (see KeptNet)."""

    def __init__(self, param, keep=(), **kw):
        self._keep = keep
        super().__init__(param, **kw)

    def _make_net(self, net_param, state, seed, what):
        net_param.state.CopyFrom(state)
        _sn.log.info("Creating %s", what)
        train = state.phase == pb.TRAIN and what.startswith("training")
        mp = self.param.memory_param if self.param.HasField("memory_param") else net_param.memory_param
        host_params = self.param.memory_param.host_params or net_param.memory_param.host_params
        return KeptNet(net_param, state.phase, device=self.device, stages=list(state.stage),
                       level=state.level, seed=seed, dtype=self.dtype, memory=mp.mode or "none",
                       reserve=self._history_bytes if train else 0, host_params=host_params and train,
                       keep=self._keep)


class Solver:
    type = None         # the update rule; None: the file's

    def __init__(self, filename, keep=()):
        param = read_solver(filename)
        _sn.upgrade_snapshot_prefix(param, filename)
        if self.type:
            param.ClearField("solver_type")
            param.type = self.type
        if _caffe.seed() and param.random_seed < 0:
            param.random_seed = _caffe.seed()
        self._solver = _KeptSolver(param, keep=keep, device=_caffe.device())
        self.net = Net._wrap(self._solver.net)
        self.test_nets = [Net._wrap(n) for n in self._solver.test_nets]

    @property
    def iter(self):
        return self._solver.iter

    @property
    def param(self):
        return self._solver.param

    def step(self, iters):
        self._solver.step(int(iters))

    def solve(self, resume_file=None):
        self._solver.solve(resume_file)

    def restore(self, filename):
        self._solver.restore(str(filename))

    def snapshot(self):
        self._solver.snapshot()

    def apply_update(self):
        return self._solver.apply_update()

    def test_all(self):
        return self._solver.test_all()

    def share_weights(self, net):
        """``net`` uses this solver's trained parameters (pycaffe's share_weights)."""
        net.share_with(self.net)

    def add_callback(self, on_start, on_gradients_ready):
        """Caffe's Solver callback: ``on_start()`` before each iteration's first forward,
        ``on_gradients_ready()`` after its backward, before the update."""
        started = [None]

        def start(layer_index):
            if layer_index == 0 and started[0] != self._solver.iter:     # once per iteration (iter_size)
                started[0] = self._solver.iter
                on_start()
        self.net.before_forward(start)
        previous = self._solver.before_update           # a data-parallel wait, if any, runs first

        def ready():
            if previous is not None:
                previous()
            on_gradients_ready()
        self._solver.before_update = ready


def _solver_class(name, rule):
    return type(name, (Solver,), {"type": rule, "__doc__": f"pycaffe's {name}: the {rule} update rule."})


SGDSolver = _solver_class("SGDSolver", "SGD")
NesterovSolver = _solver_class("NesterovSolver", "Nesterov")
AdaGradSolver = _solver_class("AdaGradSolver", "AdaGrad")
RMSPropSolver = _solver_class("RMSPropSolver", "RMSProp")
AdaDeltaSolver = _solver_class("AdaDeltaSolver", "AdaDelta")
AdamSolver = _solver_class("AdamSolver", "Adam")


def get_solver(filename, keep=()):
    """The solver of the type the file names (``type``, or the legacy ``solver_type``)."""
    return Solver(filename, keep=keep)
