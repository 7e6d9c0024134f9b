"""The Work contract: what a torch.distributed Work answers, asked of every
kind of Work the "pyallreduce" backend returns (its fast path's, its Python
path's, the inner backend's it forwards) and compared with what gloo's Work
answers for the same collective (tests/test_work_contract.py on CPU,
tests/test_cuda.py's check_work_contract on CUDA, where the reference is the
contract NCCL documents).

observe(work) asks every question of the Work API, in the order a user may
(a bounded is_completed() polling loop first), and returns the answers as
plain values: ("returns", value) or ("raises", exception type name). A Work
that never completes fails here, within POLL_S, instead of hanging the test.
"""
import datetime
import time

import torch

POLL_S = 60.0
# NCCL's WorkResult codes (torch/csrc/distributed/c10d/Work.hpp), the value of get_future_result().
SUCCESS, COMM_ERROR = 0, 2


def _exception_binding_works():
    """Whether torch's Work.exception() can answer at all: before 2.13 (seen
    on 2.4 and 2.11) its binding cannot convert the std::exception_ptr and
    raises TypeError for every Work, gloo's too."""
    import torch.distributed as dist

    try:
        dist.distributed_c10d.Work().exception()
        return True
    except TypeError:
        return False


EXCEPTION_BINDING_WORKS = _exception_binding_works()
# Work.get_future_result() came in torch 2.6: before, asking it raises AttributeError.
NO_FUTURE_RESULT = ("raises", "AttributeError")
HAS_FUTURE_RESULT = hasattr(torch._C._distributed_c10d.Work, "get_future_result")


def gloo_has_list_reduce_scatter(group):
    """Collective over `group` (gloo's): whether this torch's gloo has the list
    form of reduce_scatter, which the tests take as the reference (torch 2.4's
    has not, 2.11's has). Without it, every rank raises before anything moves."""
    import torch.distributed as dist

    try:
        dist.reduce_scatter(torch.zeros(1), [torch.zeros(1)] * dist.get_world_size(group), group=group)
    except RuntimeError as e:
        if "does not support reduce_scatter" not in str(e):
            raise
        return False
    return True


def plain(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.cpu().tolist())
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, BaseException):
        return ("exception", type(value).__name__, str(value).splitlines()[0])
    return value


def ask(question):
    try:
        return ("returns", plain(question()))
    except Exception as e:  # noqa: BLE001  (any answer is an answer to compare)
        return ("raises", type(e).__name__)


def poll_until_completed(work, what, bound_s=POLL_S):
    """The loop users write around an async collective: it must end."""
    deadline = time.monotonic() + bound_s
    while not work.is_completed():
        assert time.monotonic() < deadline, f"{what}: is_completed() stayed False for {bound_s:.0f} s"
        time.sleep(0.001)


def observe(work, what, poll=True):
    """Every answer of `work` (the Work of call `what`), after a polling loop
    that must end (poll: gloo's reduce_scatter_tensor Work never says it
    completed, in torch 2.14.1 as before)."""
    if poll:
        poll_until_completed(work, what)
    return {
        "wait()": ask(work.wait),
        "is_completed()": ask(work.is_completed),
        "is_success()": ask(work.is_success),
        "exception()": ask(work.exception),
        "result()": ask(work.result),
        "source_rank()": ask(work.source_rank),
        "synchronize()": ask(work.synchronize),
        "get_future().wait()": ask(lambda: work.get_future().wait()),
        "get_future_result().wait()": ask(lambda: work.get_future_result().wait()),
        # After the poll nothing is left to wait for (gloo's recv, waited twice, waits its timeout out).
        "wait(timeout)": ask(lambda: work.wait(datetime.timedelta(seconds=2))),
    }


def _assert_answers(answers, want, what):
    wrong = {k: (answers[k], v) for k, v in want.items() if answers[k] != v}
    assert not wrong, f"{what}: (got, expected) {wrong}"


def assert_succeeded(answers, outputs, what):
    """The contract of a Work of ours that succeeded: `outputs` are the call's
    output tensors, as result() and the future's value give them."""
    expected = plain(list(outputs))
    want = {
        "wait()": ("returns", True),
        "is_completed()": ("returns", True),
        "is_success()": ("returns", True),
        "exception()": ("returns", None) if EXCEPTION_BINDING_WORKS else ("raises", "TypeError"),
        "result()": ("returns", expected),
        "source_rank()": ("raises", "RuntimeError"),  # not a recv from any source
        "synchronize()": ("returns", None),
        "get_future().wait()": ("returns", expected),
        "get_future_result().wait()": ("returns", SUCCESS) if HAS_FUTURE_RESULT else NO_FUTURE_RESULT,
        "wait(timeout)": ("returns", True),
    }
    _assert_answers(answers, want, what)


def assert_failed(answers, error_type, what):
    """The contract of a Work of ours whose call raised `error_type`: every
    wait raises it, the Work is completed and says it failed."""
    want = {
        "wait()": ("raises", error_type),
        "is_completed()": ("returns", True),
        "is_success()": ("returns", False),
        "get_future().wait()": ("raises", error_type),
        "get_future_result().wait()": ("returns", COMM_ERROR) if HAS_FUTURE_RESULT else NO_FUTURE_RESULT,
        "wait(timeout)": ("raises", error_type),
    }
    _assert_answers(answers, want, what)
    if not EXCEPTION_BINDING_WORKS:
        assert answers["exception()"] == ("raises", "TypeError"), answers["exception()"]
        return
    kind, (_, name, _) = answers["exception()"]
    assert kind == "returns" and name == error_type, f"{what}: exception() gave {answers['exception()']}"
