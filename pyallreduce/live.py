"""The communicators of this process that hold an engine: the blocks their
kernels hold on each GPU, which the next communicator's grid must leave room
for (policy.resident_nblocks), and their close at interpreter exit (without
the peers, which may already be gone)."""
import atexit
import weakref

_open = weakref.WeakKeyDictionary()  # Communicator -> (its GPU or None, the blocks its kernels hold there)


def opened(comm, gpu, nblocks):
    _open[comm] = (gpu, nblocks)


def closed(comm):
    _open.pop(comm, None)


def blocks_held(gpu):
    """The blocks this process's open communicators' kernels hold on `gpu`."""
    return sum(n for on, n in list(_open.values()) if on == gpu)


@atexit.register
def close_all():
    for comm in list(_open):
        comm._close(sync=False)
