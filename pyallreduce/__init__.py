"""pyallreduce: single-node all-reduce over peer memory (CUDA IPC or POSIX shm).

    comm = pyallreduce.Communicator()          # after dist.init_process_group
    y = comm.all_reduce(x)                      # out-of-place, op="sum" | "avg"
    comm.all_reduce_(x)                         # in place
    pyallreduce.ddp.register(ddp_model)         # DDP communication hook
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the torch.ops.pyallreduce schemas and kernels)
from . import ddp
from .logs import log_once, logger

try:  # registers the "pyallreduce" torch.distributed backend
    from . import backend  # noqa: F401
except (AttributeError, TypeError) as e:  # a torch older than 2.9: csrc/backend.cpp builds no ServingBackend
    log_once(f"the torch.distributed backend 'pyallreduce' needs torch >= 2.9, this is {torch.__version__} ({e}); "
             "the Communicator, the ops and the DDP hook work without it")
else:
    logger.info("pyallreduce: the torch.distributed backend 'pyallreduce' serves eager calls in C++ "
                "(csrc/backend.cpp), torch %s", torch.__version__)
from .communicator import DEFAULT_TIMEOUT, Communicator

__version__ = "0.1.0"
__all__ = ["Communicator", "DEFAULT_TIMEOUT", "ddp"]
