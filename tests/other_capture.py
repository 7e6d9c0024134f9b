"""Another thread of the process capturing a CUDA graph in global mode
(torch.cuda.graph's default), for tests/test_cuda.py and tests/explorer.py:
while it captures, CUDA prohibits potentially unsafe calls (an allocation, a
synchronisation) in every thread of the process, and one invalidates the
capture."""
import contextlib
import threading

import torch


@contextlib.contextmanager
def another_threads_capture(timeout, device=None):
    """Another thread captures on a stream of its own (of `device`, or the
    current one) for the duration; yields the list of what that capture
    raised, complete once the block is left."""
    capturing, done, errors = threading.Event(), threading.Event(), []

    def capture():
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin()
                capturing.set()
                done.wait(timeout)
                graph.capture_end()
        except Exception as e:  # noqa: BLE001 (the caller decides)
            errors.append(e)
        capturing.set()

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert capturing.wait(timeout)
        yield errors
    finally:
        done.set()
        thread.join()
