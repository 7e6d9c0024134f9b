// The "pyallreduce" torch.distributed backend's C++ half (pyallreduce/backend.py
// is the rest): the base class of its Python backend, which serves the eager
// all-reduce, reduce-scatter and all-gather of one tensor without entering
// Python.
//
// Why: a Python backend costs torch's Python trampoline on every collective
// (GIL, argument conversion, a Python Work): about as much as the collective
// itself at small sizes, which is where a custom all-reduce wins or loses
// against NCCL. Its three fast methods run the call on the group's
// Communicator context through try_collective_eager (the Communicator's own
// eager fast path) and return a finished Work; whatever that declines, and
// every other method, goes to the Python subclass, where the decisions live.
// What the fast path may take is the Communicator's decision too: it hands over
// its context with its crossover row (set_fast) only when its eager calls go
// direct.
//
// The serving backend is built for torch 2.9 and later: the first whose
// c10d::Backend and Work have every method overridden here (shutdown and
// abort came in 2.7, getFutureResult in 2.6, blockCurrentStream in 2.9, read
// off the headers of 2.4.1 to 2.12.1; this file compiles against those of
// 2.9.1, 2.10.0 and 2.12.1); tested on 2.11, 2.13, 2.14 and 2.15. With an
// older torch the module has FinishedWork alone (for the methods that torch
// has) and backend.py serves every call in Python, on a Python ProcessGroup.
// Where torch's c10d::Backend differs (TORCH_2_14 below): 2.14 renamed
// the tensor collectives (all_gather_single for _allgather_base, ...; the old
// names stay as aliases that forward to the new ones) and gave a Backend a
// PyObject slot.
#include <torch/version.h>

#include "backend.h"

#define TORCH_AT_LEAST_2(minor) (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= (minor))
#define PYALLREDUCE_SERVING_BACKEND TORCH_AT_LEAST_2(9)
#define TORCH_2_14 TORCH_AT_LEAST_2(14)
#include <pybind11/chrono.h>  // BarrierOptions::timeout as a datetime.timedelta
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/Exceptions.h>
#if TORCH_2_14
#include <torch/csrc/utils/pyobject_preservation.h>
// The canonical names: overriding 2.14's deprecated aliases instead would trip
// its re-entry guard when a served call's own exchanges come back here.
#define ALL_GATHER_SINGLE all_gather_single
#define ALL_GATHER_SINGLE_COALESCED all_gather_single_coalesced
#define REDUCE_SCATTER_SINGLE reduce_scatter_single
#define REDUCE_SCATTER_SINGLE_COALESCED reduce_scatter_single_coalesced
#define ALL_TO_ALL_SINGLE all_to_all_single
#else
#define ALL_GATHER_SINGLE _allgather_base
#define ALL_GATHER_SINGLE_COALESCED allgather_into_tensor_coalesced
#define REDUCE_SCATTER_SINGLE _reduce_scatter_base
#define REDUCE_SCATTER_SINGLE_COALESCED reduce_scatter_tensor_coalesced
#define ALL_TO_ALL_SINGLE alltoall_base
#endif

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/op_args.h"
#include "common/protocol.h"
#ifdef PYALLREDUCE_WITH_CUDA
#include "cuda/adapter.h"
#endif

namespace pyallreduce {
namespace {

namespace py = pybind11;

// The Work of every call this backend runs itself, on the fast path below or
// through the Python subclass (backend.py's `_finished`): the call has run
// (CPU) or its kernel is enqueued on the stream current at the call (CUDA).
// One class for both, with the contract of gloo's and NCCL's Works
// (tests/test_work_contract.py): wait() returns True or raises the call's
// error; is_completed() is true once the collective has finished (CUDA: its
// kernel, as NCCL's); result() and the future's value are the output tensors;
// getFutureResult() is NCCL's SUCCESS / COMM_ERROR code. For CUDA the future was
// completed on the launch stream (its events follow the kernel), so wait(),
// synchronize() and blockCurrentStream() make the caller's current stream wait
// for the collective, not the host, as NCCL's do; wait() with a timeout also
// blocks the host until the kernel ended (raising past the timeout), as NCCL's
// does. Inside a CUDA graph capture the graph orders the captured work: no events.
class FinishedWork : public c10d::Work {
 public:
  // stream_device: the CUDA device whose current stream the call's kernels
  // were enqueued on, or none (CPU, a failed call, or inside a capture).
  FinishedWork(std::vector<at::Tensor> result, std::exception_ptr error, std::optional<c10::Device> stream_device)
      : result_(std::move(result)) {
    std::vector<c10::Device> devices;
    if (stream_device && !error) {
      devices.push_back(*stream_device);
      done_.emplace(c10::DeviceType::CUDA);
      done_->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(*stream_device));
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::move(devices));
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
  }

  bool isCompleted() override { return !done_ || done_->query(); }
  bool isSuccess() const override { return !future_->hasError(); }
  std::exception_ptr exception() const override { return future_->exception_ptr(); }
  std::vector<at::Tensor> result() override { return result_; }
  void synchronize() override { future_->wait(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (done_ && timeout != ::kNoTimeout) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      // torch's Python binding has released the GIL; a C++ caller may hold it.
      std::optional<py::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil.emplace();
      while (!done_->query()) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "pyallreduce: the collective did not finish within ",
                    timeout.count(), " ms of Work.wait(timeout); its kernel waits for a peer until the "
                    "communicator's own deadline, then records the ranks that never arrived");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    future_->waitAndThrow();
    return true;
  }
#if TORCH_AT_LEAST_2(9)
  void blockCurrentStream() override { future_->wait(); }
#endif
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
#if TORCH_AT_LEAST_2(6)
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    auto code = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    code->markCompleted(c10::IValue(static_cast<int64_t>(
        future_->hasError() ? c10d::WorkResult::COMM_ERROR : c10d::WorkResult::SUCCESS)));
    return code;
  }
#endif

 private:
  std::vector<at::Tensor> result_;
  std::optional<c10::Event> done_;  // CUDA, not captured: recorded after the kernel
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Python exception as a C++ one that torch turns back into the same Python
// object (type, message, traceback) each time it is raised again: wait(), the
// future's wait(), DDP's reducer. (pybind11's error_already_set can be raised
// into Python only once.)
std::exception_ptr as_exception_ptr(py::handle error) {
  if (error.is_none()) return nullptr;
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  python_error e;
  e.persist();
  return std::make_exception_ptr(std::move(e));
}

#if PYALLREDUCE_SERVING_BACKEND
c10::intrusive_ptr<c10d::Work> issued(const at::Tensor& result, std::exception_ptr error) {
  std::optional<c10::Device> stream_device;
#ifdef PYALLREDUCE_WITH_CUDA
  if (result.is_cuda() && !cuda_current_stream_capturing(result.get_device())) stream_device = result.device();
#endif
  return c10::make_intrusive<FinishedWork>(std::vector<at::Tensor>{result}, std::move(error), stream_device);
}

// The communicators this thread is inside (a served call, a construction, a
// close): their own torch.distributed calls on the group come back here and
// must go to the inner backend, never to the fast path (which would wait for
// the turn this thread holds).
thread_local std::vector<const void*> serving_here;

bool is_serving(const void* backend) {
  for (const void* b : serving_here) {
    if (b == backend) return true;
  }
  return false;
}

// The Python subclass's method `pyname` for the Backend method `name`, as
// torch's trampoline (c10d::PyBackend) calls it. Not that trampoline itself:
// its lookup matches the Python object's C++ type exactly, which here is
// ServingBackend, so it would find no Python method. The Work it returns is a
// C++ one (FinishedWork, or the inner backend's), handed to torch as it is: a
// Python subclass of Work would answer only wait() and get_future() (torch's
// Python-Work trampoline forwards nothing else), so backend.py makes none.
#define PYTHON_WORK(name, pyname, ...)                                                              \
  do {                                                                                             \
    sequence_.fetch_add(1, std::memory_order_relaxed);                                             \
    py::gil_scoped_acquire gil;                                                                    \
    py::function method = py::get_override(static_cast<const ServingBackend*>(this), pyname);      \
    if (!method) return Backend::name(__VA_ARGS__);                                                \
    py::object work = method(__VA_ARGS__);                                                         \
    if (work.is_none()) return {};                                                                 \
    return work.cast<c10::intrusive_ptr<c10d::Work>>();                                            \
  } while (false)

class ServingBackend : public c10d::Backend {
 public:
  ServingBackend(int rank, int size, std::string name) : Backend(rank, size), name_(std::move(name)) {}

  // ---- served here when they fit, else by the Python subclass ----------------

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1) {
      if (auto work = fast(tensors[0], tensors[0], opts.reduceOp, kAgreeOnly)) return work;
    }
    PYTHON_WORK(allreduce, "allreduce", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> REDUCE_SCATTER_SINGLE(at::Tensor& output, at::Tensor& input,
                                                       const c10d::ReduceScatterOptions& opts) override {
    if (auto work = fast(input, output, opts.reduceOp, kReduceScatter)) return work;
    PYTHON_WORK(REDUCE_SCATTER_SINGLE, "reduce_scatter_single", output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> ALL_GATHER_SINGLE(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
    if (auto work = fast(input, output, c10d::ReduceOp(c10d::ReduceOp::SUM), kAllGather)) return work;
    PYTHON_WORK(ALL_GATHER_SINGLE, "all_gather_single", output, input, opts);
  }

  // ---- by the Python subclass --------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    PYTHON_WORK(allreduce_coalesced, "allreduce_coalesced", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    PYTHON_WORK(allreduce_sparse, "allreduce_sparse", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> REDUCE_SCATTER_SINGLE_COALESCED(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    PYTHON_WORK(REDUCE_SCATTER_SINGLE_COALESCED, "reduce_scatter_single_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    PYTHON_WORK(reduce_scatter, "reduce_scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> ALL_GATHER_SINGLE_COALESCED(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) override {
    PYTHON_WORK(ALL_GATHER_SINGLE_COALESCED, "all_gather_single_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    PYTHON_WORK(allgather, "allgather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    PYTHON_WORK(allgather_coalesced, "allgather_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    PYTHON_WORK(broadcast, "broadcast", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    PYTHON_WORK(reduce, "reduce", tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override {
    PYTHON_WORK(gather, "gather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    PYTHON_WORK(scatter, "scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> ALL_TO_ALL_SINGLE(at::Tensor& output, at::Tensor& input,
                                                   std::vector<int64_t>& output_splits,
                                                   std::vector<int64_t>& input_splits,
                                                   const c10d::AllToAllOptions& opts) override {
    PYTHON_WORK(ALL_TO_ALL_SINGLE, "all_to_all_single", output, input, output_splits, input_splits, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    PYTHON_WORK(alltoall, "alltoall", outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override {
    PYTHON_WORK(send, "send", tensors, dst_rank, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override {
    PYTHON_WORK(recv, "recv", tensors, src_rank, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    PYTHON_WORK(recvAnysource, "recv_anysource", tensors, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    PYTHON_WORK(barrier, "barrier", opts);
  }
  // The inner gloo backend's (gloo alone has one): it names the ranks that did not arrive.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    py::function method = py::get_override(static_cast<const ServingBackend*>(this), "monitored_barrier");
    if (!method) return Backend::monitoredBarrier(opts, wait_all_ranks);
    method(opts.timeout, wait_all_ranks);
  }
  // Sequence numbers, as gloo's: every collective issued here counts one, from 0
  // on every rank. torch's collective checker (TORCH_DISTRIBUTED_DEBUG=DETAIL)
  // compares them across ranks before each collective.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(std::memory_order_relaxed); }
  void shutdown() override { call_python("shutdown"); }
  void abort() override { call_python("abort"); }
  const std::string getBackendName() const override { return name_; }

  // ---- for the Python subclass ----------------------------------------------

  // The Communicator context that serves `device` eagerly, with its crossover
  // row (reference_min_bytes < 0: never the reference). Caller holds the turn.
  void set_fast(const c10::Device& device, int64_t handle, int64_t two_shot_min_bytes,
                int64_t reference_min_bytes) {
    for (Fast& f : fast_) {
      if (f.device == device) {
        f = Fast{device, handle, two_shot_min_bytes, reference_min_bytes};
        return;
      }
    }
    fast_.push_back(Fast{device, handle, two_shot_min_bytes, reference_min_bytes});
  }
  void clear_fast() { fast_.clear(); }  // caller holds the turn

  // `with backend._scope(turn, serve):` for the Python subclass. turn: one served
  // call at a time, in the order callers arrive (NCCL orders a process's
  // collectives too); the GIL is released while waiting. serve: this thread is
  // inside a Communicator call (serving_here). A context manager, not separate
  // calls: a KeyboardInterrupt between taking the turn and a `try` would keep it
  // taken for good, and `with` leaves no such gap.
  class Scope {
   public:
    Scope(ServingBackend& backend, bool turn, bool serve) : backend_(backend), turn_(turn), serve_(serve) {}
    void enter() {
      if (turn_) {
        // The turn is not recursive: a signal handler or a finalizer that runs
        // abort(), destroy_process_group() or a collective while this thread is
        // inside a served call would wait for itself for good.
        if (backend_.turn_holder_.load() == std::this_thread::get_id()) {
          throw std::runtime_error(
              "pyallreduce: this thread is inside a call of this process group (a signal handler or a finalizer "
              "interrupted it?), so it would wait for itself: call abort(), destroy_process_group() or the "
              "collective from another thread, or after the call returns");
        }
        py::gil_scoped_release nogil;
        backend_.turn_.lock();
        backend_.turn_holder_ = std::this_thread::get_id();
      }
      if (serve_) serving_here.push_back(&backend_);
    }
    void exit() {
      if (serve_) {
        for (auto it = serving_here.rbegin(); it != serving_here.rend(); ++it) {
          if (*it == &backend_) {
            serving_here.erase(std::next(it).base());
            break;
          }
        }
      }
      if (turn_) {
        backend_.turn_holder_ = std::thread::id();
        backend_.turn_.unlock();
      }
    }

   private:
    ServingBackend& backend_;
    const bool turn_, serve_;
  };

  bool serving() const { return is_serving(this); }
  int64_t fast_calls() const { return fast_calls_.load(std::memory_order_relaxed); }
#if !TORCH_2_14
  py::object python_object_;  // its Python subclass's object (_keep_python_object)
#endif

 private:
  struct Fast {
    c10::Device device;
    int64_t handle;
    int64_t two_shot_min_bytes;
    int64_t reference_min_bytes;

    // policy.Crossover's rule: the kernel for nbytes, or -1 where the reference wins.
    int64_t algo_for(int64_t nbytes) const {
      if (reference_min_bytes >= 0 && nbytes >= reference_min_bytes) return -1;
      return nbytes >= two_shot_min_bytes ? kTwoShot : kOneShot;
    }
  };

  // The call run here, or null having done nothing (the Python subclass then serves it).
  c10::intrusive_ptr<c10d::Work> fast(const at::Tensor& input, at::Tensor& out, const c10d::ReduceOp& op,
                                      int64_t collective) {
    if (op.op_ != c10d::ReduceOp::SUM && op.op_ != c10d::ReduceOp::AVG) return {};
    if (input.layout() != at::kStrided || out.layout() != at::kStrided || is_serving(this)) return {};
    // Whoever holds the GIL here (a caller outside torch's collective bindings, which
    // release it) must not keep it while waiting for the turn or for the peers.
    std::optional<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil.emplace();
    std::lock_guard<std::mutex> turn(turn_);
    const Fast* f = nullptr;
    for (const Fast& candidate : fast_) {
      if (candidate.device == input.device()) f = &candidate;
    }
    if (f == nullptr) return {};
    const int64_t algo = collective == kAgreeOnly ? f->algo_for(static_cast<int64_t>(input.nbytes())) : collective;
    if (algo < 0) return {};
    std::exception_ptr error;
    try {
      if (!try_collective_eager(input, out, f->handle, algo, op.op_ == c10d::ReduceOp::AVG)) return {};
    } catch (...) {
      error = std::current_exception();  // raised by the Work's wait(), as torch's backends do
    }
    fast_calls_.fetch_add(1, std::memory_order_relaxed);
    sequence_.fetch_add(1, std::memory_order_relaxed);
    return issued(out, error);
  }

  void call_python(const char* pyname) {
    py::gil_scoped_acquire gil;
    if (py::function method = py::get_override(static_cast<const ServingBackend*>(this), pyname)) method();
  }

  const std::string name_;
  std::mutex turn_;
  std::atomic<std::thread::id> turn_holder_{};  // the thread in a Scope holding turn_ (none: the fast path's)
  std::vector<Fast> fast_;  // under turn_
  std::atomic<int64_t> fast_calls_{0};  // read without the turn
  std::atomic<uint64_t> sequence_{0};  // collectives issued (getSequenceNumberForGroup)
};

#endif  // PYALLREDUCE_SERVING_BACKEND
}  // namespace

void bind_backend(pybind11::module_& m) {
  py::module_::import("torch.distributed");  // registers c10d.Backend, the base class below
  m.def(
      "finished_work",
      [](std::vector<at::Tensor> result, py::object error, std::optional<c10::Device> stream_device) {
        return c10::intrusive_ptr<c10d::Work>(
            c10::make_intrusive<FinishedWork>(std::move(result), as_exception_ptr(error), stream_device));
      },
      py::arg("result"), py::arg("error") = py::none(), py::arg("stream_device") = py::none(),
      "The Work of a call the backend ran: result (its output tensors) or error (the exception its wait() "
      "raises); stream_device: the CUDA device on whose current stream its kernels were enqueued, which the "
      "Work then follows (csrc/backend.cpp FinishedWork)");
#if PYALLREDUCE_SERVING_BACKEND
  py::class_<ServingBackend::Scope>(m, "_ServingScope")
      .def("__enter__", [](ServingBackend::Scope& s) { s.enter(); })
      .def("__exit__", [](ServingBackend::Scope& s, py::args) {
        s.exit();
        return false;
      });
  py::class_<ServingBackend, c10d::Backend, c10::intrusive_ptr<ServingBackend>>(
      m, "ServingBackend",
      "Base class of pyallreduce.backend.PyallreduceBackend: serves eager single-tensor all_reduce, "
      "reduce_scatter_tensor and all_gather_into_tensor in C++ on the Communicator that set_fast named")
      .def(py::init<int, int, std::string>(), py::arg("rank"), py::arg("size"), py::arg("name"))
      // torch keeps only the C++ object (intrusive_ptr); the Python subclass's methods
      // live on while torch holds it once the object's PyObject slot names its Python
      // object (as torch's trampoline does for the backends that split() returns).
      // Before 2.14 a Backend has no such slot: the C++ object holds its Python
      // object itself, a cycle that _drop_python_object breaks once the group ended.
      .def("_keep_python_object",
           [](py::object self) {
#if TORCH_2_14
             auto backend = self.cast<c10::intrusive_ptr<c10d::Backend>>();
             Py_DECREF(torch::utils::PyObjectPreservation::get_or_init(
                 *backend, [&] { return Py_NewRef(self.ptr()); }));
#else
             self.cast<ServingBackend&>().python_object_ = self;
#endif
           })
      .def("_drop_python_object",
           [](ServingBackend& backend) {
#if !TORCH_2_14
             backend.python_object_ = py::object();
#endif
           })
      .def("_set_fast", &ServingBackend::set_fast, py::arg("device"), py::arg("handle"),
           py::arg("two_shot_min_bytes"), py::arg("reference_min_bytes"))
      .def("_clear_fast", &ServingBackend::clear_fast)
      .def("_scope", [](ServingBackend& b, bool turn, bool serve) { return ServingBackend::Scope(b, turn, serve); },
           py::arg("turn"), py::arg("serve"), py::keep_alive<0, 1>())
      .def("_is_serving", &ServingBackend::serving)
      .def_property_readonly("fast_calls", &ServingBackend::fast_calls,
                             "how many calls the C++ fast path has served");
#endif  // PYALLREDUCE_SERVING_BACKEND
}

}  // namespace pyallreduce
