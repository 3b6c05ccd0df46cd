"""Checkmate's optimal rematerialization (Jain et al. 2020) on an sncaffe graph: a reference
for the planner's recomputation on nets small enough to solve. Never imported by planning;
needs ``highspy`` (the HiGHS MILP solver, the ``checkmate`` extra).

The abstraction. Checkmate schedules a graph of nodes that each produce one immutable output.
sncaffe's operators often write in place (a convolution's BatchNorm, Scale and ReLU on the
convolution's own block), so the nodes here are coarser:

- forward nodes: the per-layer chains of recomputation (``recompute.segments``: a checkpoint
  operator and the cheap operators after it), in forward order. A chain's output is every
  scheduled value its operators write first (its blocks, the BatchNorm statistics and masks
  among them), held or freed together; its cost is the FLOPs of its operators
  (``result.layer_flops``). A chain with an operator that cannot be replayed (data, loss,
  random draws: ``recompute.is_replayable``) is computed once, as sncaffe does.
- backward nodes: each chain's backward operators, after the forward nodes in backward order;
  their output is the gradients they write first. They are computed exactly once, each in its
  own stage (they are given their FLOPs, but are never replayed).
- edges: a node depends on the nodes that first wrote what its operators read or write
  (``liveness.op_tensors``); writing a value another node made (an in-place gradient, a
  gradient sum) is a use of it, so the value lives until the last such writer.

What lives across iterations (parameters, their gradients, net inputs and outputs: the
persistent roots of ``passes.liveness``) is constant: it is left out of the budget, as are
workspaces (scratch inside one operator, chunked by the planner) and the solver's history.
A budget here is bytes of scheduled values (``block_bytes``, as the planner counts them).

Within this abstraction recomputing a chain replays all of it. sncaffe can do what the model
cannot: per-layer recomputation keeps a snapshot of a convolution's output and replays only the
cheap layers after it, dropping their values but not the convolution's; so at a budget sncaffe
may replay fewer FLOPs than the "optimum" here, or fit where the model has no schedule.

The formulation is Checkmate's MILP: one stage per node (stage t computes node t, and may
recompute earlier forward nodes), binaries R[t,i] (node i computed in stage t), S[t,i] (i's
output kept from stage t-1 into t) and FREE[t,i,k] (i's output freed after node k is computed in
stage t), and the memory U[t,k] after computing node k in stage t, at most the budget:

    R[t,t] = 1, R[t,i] = S[t,i] = 0 for i > t (and S[t,t] = 0)
    R[t,j] <= R[t,i] + S[t,i]           for each edge i -> j (inputs resident)
    S[t,i] <= R[t-1,i] + S[t-1,i]       (only what was there is kept)
    U[t,0] = sum_i S[t,i] m_i + R[t,0] m_0
    U[t,k] = U[t,k-1] + R[t,k] m_k - sum_{i in deps(k-1) + [k-1]} m_i FREE[t,i,k-1]
    FREE[t,i,k] = R[t,k] (1 - S[t+1,i]) prod_{j user of i, j > k} (1 - R[t,j])   (linearized)
    minimize sum_t sum_i cost_i R[t,i]

with O(n^2) binaries (FREE: one per stage and edge): nets up to about 60 nodes solve in seconds.
``check`` replays a schedule (R, S) under these rules, independently of the solver.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .liveness import op_tensors
from .passes import liveness
from .recompute import is_replayable, segments
from .result import layer_flops


class ScheduleError(ValueError):
    """A schedule that computes a node before its inputs, or exceeds the budget."""


@dataclass
class Problem:
    """The graph in Checkmate's terms: node i's ``cost`` (FLOPs), ``mem`` (bytes of its
    output), ``deps`` (nodes whose outputs it uses, all before it)."""
    names: list
    cost: list
    mem: list
    deps: list
    recomputable: list      # forward nodes Checkmate may compute more than once
    nf: int                 # forward nodes: the first nf
    chains: list            # per forward node: its forward operators' indices
    layers: list            # per forward node: the ids of its layers (graph nodes)
    users: list = field(default_factory=list)

    def __post_init__(self):
        self.users = [[] for _ in self.names]
        for j, ds in enumerate(self.deps):
            for i in ds:
                self.users[i].append(j)

    def __len__(self):
        return len(self.names)


def build_problem(graph) -> Problem:
    """The Checkmate problem of ``graph`` (see the module docstring)."""
    forward, backward = graph.forward_ops, graph.backward_ops
    roots, _ = liveness(graph, forward + backward, "recompute")
    persistent = {id(r) for r in roots}
    chains = [[k for k in [s.checkpoint] + s.cheap if k is not None] for s in segments(forward, persistent)[0]]
    chain_of = {id(forward[k].node): c for c, ks in enumerate(chains) for k in ks}
    groups: dict = {}                   # chain -> its backward operators, in backward order
    for op in backward:
        groups.setdefault(chain_of[id(op.node)], []).append(op)
    nodes = [[forward[k] for k in ks] for ks in chains] + list(groups.values())
    names = [ops[0].node.name for ops in nodes[:len(chains)]] + \
            [ops[-1].node.name + ":backward" for ops in nodes[len(chains):]]
    producer, mem, deps = {}, [], []
    for n, ops in enumerate(nodes):
        size, need = 0, set()
        for op in ops:
            for r, write in op_tensors(op):
                if id(r) in persistent:
                    continue
                if id(r) not in producer:
                    if not write:
                        raise ValueError(f"{op.name} reads {r.name} before anything writes it")
                    producer[id(r)] = n
                    size += r.block_bytes
                elif producer[id(r)] != n:
                    need.add(producer[id(r)])
        mem.append(size)
        deps.append(sorted(need))
        if need and max(need) > n:
            raise ValueError(f"{names[n]} uses a later node: backward order is not a topological order")
    recomputable = [all(is_replayable(forward[k].node) for k in ks) for ks in chains]
    for key, (p, last, changed) in _changes(nodes, producer, persistent).items():
        # A forward value a backward node changes (Scale's backward writes BatchNorm's scratch)
        # would replay to its old value: not replayed where a later node uses the changed one.
        if p < len(chains) and changed is not None and last > changed:
            recomputable[p] = False
    cost = [sum(layer_flops(op.node) for op in ops) for ops in nodes]
    layers = [{id(forward[k].node) for k in ks} for ks in chains]
    return Problem(names, cost, mem, deps, recomputable + [False] * len(groups), len(chains), chains, layers)


def _changes(nodes, producer, persistent) -> dict:
    """id(root) -> (its producer, the last node using it, the first backward-side node other
    than the producer writing it, or None)."""
    out = {}
    for n, ops in enumerate(nodes):
        for op in ops:
            for r, write in op_tensors(op):
                if id(r) in persistent:
                    continue
                p, _, changed = out.get(id(r), (producer[id(r)], n, None))
                if write and n != p and changed is None and op.kind == "backward":
                    changed = n
                out[id(r)] = (p, n, changed)
    return out


@dataclass
class Solution:
    status: str             # "optimal", "infeasible", or HiGHS's word for where it stopped
    budget: int
    cost: int | None = None             # FLOPs recomputed (beyond each node's first computation)
    bound: float | None = None          # the solver's lower bound of that cost
    R: list | None = None
    S: list | None = None
    seconds: float = 0.0
    size: tuple = ()                    # (binaries, rows) of the MILP

    @property
    def feasible(self) -> bool:
        return self.R is not None


def solve(problem: Problem, budget: int, time_limit: float | None = None, threads: int = 1) -> Solution:
    """The schedule of least recomputed FLOPs whose memory stays within ``budget`` bytes."""
    import highspy
    import numpy as np

    T = len(problem)
    mem, deps, users = problem.mem, problem.deps, problem.users
    unit = _units(mem)                  # whole units: the solver's tolerances cannot blur a byte
    m = [x // unit for x in mem]
    cap = budget // unit

    cost = []                           # per column; every column is binary

    def var(c=0):
        cost.append(c)
        return len(cost) - 1

    # R[t][i], S[t][i]: a column, or a Const where fixed (nodes computed once, nothing above t)
    zero, one = Const(0), Const(1)
    R = [[zero] * T for _ in range(T)]
    S = [[zero] * T for _ in range(T + 1)]          # S[T]: nothing is kept after the last stage
    for t in range(T):
        for i in range(t + 1):
            R[t][i] = one if i == t else (var(problem.cost[i]) if problem.recomputable[i] else zero)
        for i in range(t):
            S[t][i] = var()
    rows = []                           # (lower, upper, {column: coefficient})

    def row(lo, hi, terms):
        coefs = {}
        for c, x in terms:
            if isinstance(x, Const):
                lo, hi = lo - c * x.value, hi - c * x.value
            else:
                coefs[x] = coefs.get(x, 0) + c
        rows.append((lo, hi, coefs))

    inf = highspy.kHighsInf
    for t in range(T):
        for j in range(t + 1):
            for i in deps[j]:           # inputs resident: R[t,j] <= R[t,i] + S[t,i]
                row(-inf, 0, [(1, R[t][j]), (-1, R[t][i]), (-1, S[t][i])])
        for i in range(t):              # kept only what was there: S[t,i] <= R[t-1,i] + S[t-1,i]
            row(-inf, 0, [(1, S[t][i]), (-1, R[t - 1][i]), (-1, S[t - 1][i])])
    for t in range(T):
        U = [(m[i], S[t][i]) for i in range(t)]     # memory, a sum grown as stage t runs
        for k in range(t + 1):
            if R[t][k] is zero:
                continue
            U.append((m[k], R[t][k]))
            row(-inf, cap, U)
            for i in deps[k] + [k]:
                later = [j for j in users[i] if k < j <= t and R[t][j] is not zero]
                if any(R[t][j] is one for j in later):
                    continue            # a later node of this stage surely uses it: not freed here
                # hazards (1 + these terms): k not computed, i kept into the next stage, a later
                # user computed in this one; FREE[t,i,k] is 1 exactly where there are none
                hazards = [(-1, R[t][k]), (1, S[t + 1][i])] + [(1, R[t][j]) for j in later]
                most = 2 + len(later)
                f = var()
                # 1 - FREE <= 1 + hazards, and most (1 - FREE) >= 1 + hazards
                row(0, inf, [(1, f)] + hazards)
                row(1 - most, inf, [(-most, f)] + [(-c, x) for c, x in hazards])
                if m[i]:
                    U.append((-m[i], f))

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", threads)
    h.setOptionValue("mip_rel_gap", 0.0)
    if time_limit:
        h.setOptionValue("time_limit", float(time_limit))
    n = len(cost)
    h.addCols(n, np.array(cost, dtype=float), np.zeros(n), np.ones(n), 0,
              np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([]))
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * n))
    lo, hi, starts, index, value = [], [], [], [], []
    for a, b, coefs in rows:
        lo.append(a)
        hi.append(b)
        starts.append(len(index))
        for c, v in coefs.items():
            if v:
                index.append(c)
                value.append(v)
    h.addRows(len(rows), np.array(lo), np.array(hi), len(index), np.array(starts, dtype=np.int32),
              np.array(index, dtype=np.int32), np.array(value))
    start = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - start
    status = h.getModelStatus()
    out = Solution(h.modelStatusToString(status).lower(), budget, seconds=seconds, size=(n, len(rows)))
    if status == highspy.HighsModelStatus.kInfeasible:
        out.status = "infeasible"
        return out
    info = h.getInfo()
    if info.primal_solution_status != 2:            # no feasible point found (time limit)
        return out
    x = list(h.getSolution().col_value)
    val = lambda v: v.value if isinstance(v, Const) else int(round(x[v]))
    out.R = [[val(R[t][i]) for i in range(T)] for t in range(T)]
    out.S = [[val(S[t][i]) for i in range(T)] for t in range(T)]
    out.cost = recomputed_flops(problem, out.R)
    out.bound = info.mip_dual_bound
    if status == highspy.HighsModelStatus.kOptimal:
        out.status = "optimal"
    return out


class Const:
    """A fixed entry of R or S (a node computed once, or nothing to keep)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _units(mem):
    """The greatest common divisor of the sizes: memory in whole units keeps the solver exact."""
    g = 0
    for x in mem:
        g = math.gcd(g, x)
    return g or 1


def recomputed_flops(problem: Problem, R) -> int:
    """FLOPs of every computation of a node beyond its first."""
    return sum(problem.cost[i] * (sum(R[t][i] for t in range(len(problem))) - 1) for i in range(len(problem)))


def check(problem: Problem, R, S, budget: int | None = None) -> int:
    """Replay the schedule (R, S) stage by stage, as the formulation reads it, and return its
    peak: after each computation, what was kept into the stage and what the stage computed so
    far, less what was freed (a value no later node of the stage uses, not kept into the
    next). Raises ScheduleError where a node runs before its inputs are resident, a value is
    kept that was not there, or the peak exceeds ``budget``."""
    T = len(problem)
    peak = 0
    for t in range(T):
        if not R[t][t] or any(R[t][i] for i in range(t + 1, T)) or any(S[t][i] for i in range(t, T)):
            raise ScheduleError(f"stage {t} does not compute {problem.names[t]} as its last node")
        for i in range(t):
            if S[t][i] and not (R[t - 1][i] or S[t - 1][i]):
                raise ScheduleError(f"stage {t} keeps {problem.names[i]}, absent from stage {t - 1}")
        nxt = S[t + 1] if t + 1 < T else [0] * T
        held = {i: problem.mem[i] for i in range(t) if S[t][i]}
        copies = 0                      # a node computed again while kept: two blocks, as the MILP counts
        done = [k for k in range(t + 1) if R[t][k]]
        for n, k in enumerate(done):
            for i in problem.deps[k]:
                if not (S[t][i] or (R[t][i] and i in done[:n])):
                    raise ScheduleError(f"stage {t}: {problem.names[k]} runs without {problem.names[i]}")
            if k in held:
                copies += problem.mem[k]
            held[k] = problem.mem[k]
            used = sum(held.values()) + copies
            peak = max(peak, used)
            if budget is not None and used > budget:
                raise ScheduleError(f"stage {t}: {used} bytes after {problem.names[k]}, over {budget}")
            for i in problem.deps[k] + [k]:
                if i in held and not nxt[i] and not any(j in done[n + 1:] for j in problem.users[i]):
                    del held[i]
    return peak


def kept(problem: Problem, R):
    """The least S for R: a value is kept into a stage where its next event, from that stage
    on, is a use (not a computation of it again, nor nothing)."""
    T = len(problem)
    S = [[0] * T for _ in range(T)]
    for i in range(T):
        for t in range(i + 1, T):
            if not (R[t - 1][i] or S[t - 1][i]):
                continue
            for u in range(t, T):
                if R[u][i]:
                    break
                if any(R[u][j] for j in problem.users[i]):
                    S[t][i] = 1
                    break
    return S


def replay_schedule(problem: Problem, dropped):
    """(R, S) of recomputation as sncaffe does it, speed-centric: each forward node once in
    forward, then the ``dropped`` forward nodes recomputed in backward at the first stage that
    needs them (with what they need of the dropped, in forward order), and kept until their
    last use."""
    T, nf = len(problem), problem.nf
    R = [[int(i == t) for i in range(T)] for t in range(T)]
    back = set()                        # dropped nodes recomputed already

    def bring(i, t):
        for d in problem.deps[i]:
            if d in dropped and d not in back:
                bring(d, t)
        R[t][i] = 1
        back.add(i)
    for t in range(nf, T):
        for i in problem.deps[t]:
            if i in dropped and i not in back:
                bring(i, t)
    return R, kept(problem, R)


def replayed_nodes(problem: Problem, plan) -> set:
    """The forward nodes of which ``plan`` (of the same graph) replays an operator in backward."""
    layers = {id(ins.op.node) for ins in plan.schedule.backward if ins.kind == "run" and ins.recompute}
    return {n for n, ids in enumerate(problem.layers) if ids & layers}
