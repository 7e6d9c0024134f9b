"""pyallreduce: single-node all-reduce over peer memory (CUDA IPC or POSIX shm).

    comm = pyallreduce.Communicator()          # after dist.init_process_group
    y = comm.all_reduce(x)                      # out-of-place, op="sum" | "avg"
    comm.all_reduce_(x)                         # in place
    pyallreduce.ddp.register(ddp_model)         # DDP communication hook
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the torch.ops.pyallreduce schemas and kernels)
from . import ddp
try:  # registers the "pyallreduce" torch.distributed backend
    from . import backend  # noqa: F401
except (AttributeError, TypeError) as e:  # a torch whose c10d Backend Python cannot subclass
    from .logs import log_once

    log_once(f"the torch.distributed backend 'pyallreduce' is not available with torch {torch.__version__}: {e}")
from .communicator import DEFAULT_TIMEOUT, Communicator

__version__ = "0.1.0"
__all__ = ["Communicator", "DEFAULT_TIMEOUT", "ddp"]
