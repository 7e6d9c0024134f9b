"""pyallreduce: single-node all-reduce over peer memory (CUDA IPC or POSIX shm).

    comm = pyallreduce.Communicator()          # after dist.init_process_group
    y = comm.all_reduce(x)                      # out-of-place, op="sum" | "avg"
    comm.all_reduce_(x)                         # in place
    pyallreduce.ddp.register(ddp_model)         # DDP communication hook
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the torch.ops.pyallreduce schemas and kernels)
from . import backend  # registers the "pyallreduce" torch.distributed backend
from . import ddp
from .logs import log_once, logger

if backend.SERVES_IN_CPP:
    logger.info("pyallreduce: the torch.distributed backend 'pyallreduce' serves eager calls in C++ "
                "(csrc/backend.cpp), torch %s", torch.__version__)
else:
    log_once(f"the torch.distributed backend 'pyallreduce' serves every call in Python with torch "
             f"{torch.__version__} (its C++ serving path needs torch >= 2.9): the same results, a few "
             "microseconds slower per call")
from .communicator import DEFAULT_TIMEOUT, Communicator

__version__ = "0.1.0"
__all__ = ["Communicator", "DEFAULT_TIMEOUT", "ddp"]
