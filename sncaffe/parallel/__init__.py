"""Parallel training: data parallelism over processes on MPI (and NCCL between GPUs) and over the
locations of one process, and its trace.

- ``mpi``: the job (``world()``, None outside mpiexec), ``abort_on_error``, the MPI reducer
- ``nccl``: the NCCL reducer between GPUs
- ``buckets``: which gradients are all-reduced together, in backward order
- ``data_parallel``: ``DataParallel(solver, comm)``: process set-up and the pass inserting all-reduce operators
- ``replicas``: data parallelism inside one process (``replicate``, ``Replicas``): summing operators
- ``overlap``: one iteration's Chrome trace, and how much all-reduce hid behind backward

mpi4py is imported only when a job runs under mpiexec (the ``mpi`` extra).
"""
from .buckets import BUCKET_BYTES, Bucket, make_buckets
from .data_parallel import TIMEOUT, CommTimeout, DataParallel
from .mpi import abort_on_error, launched, world
from .overlap import IterationTrace, overlap

__all__ = ["BUCKET_BYTES", "Bucket", "make_buckets", "TIMEOUT", "CommTimeout", "DataParallel",
           "abort_on_error", "launched", "world", "IterationTrace", "overlap"]
