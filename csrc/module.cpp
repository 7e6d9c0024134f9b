// pyallreduce._C: every op schema, the context registry and the Python-visible
// constants. Backends add their kernels with PYALLREDUCE_REGISTER_BACKEND in
// their own files (csrc/cpu, csrc/cuda).
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <array>
#include <map>
#include <sstream>

#include "backend.h"
#include "common/context.h"
#include "common/op_args.h"
#include "common/protocol.h"
#include "cpu/shm.h"
#ifdef PYALLREDUCE_WITH_CUDA
#include "cuda/adapter.h"
#endif

namespace pyallreduce {

// ---- context registry -------------------------------------------------------

namespace {
std::mutex registry_mutex;
std::map<int64_t, std::shared_ptr<Context>> registry;
std::vector<std::shared_ptr<Context>> kept_alive;  // destroy_context(keep_alive): never freed
int64_t next_handle = 1;
}  // namespace

int64_t register_context(std::unique_ptr<Context> ctx) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  int64_t handle = next_handle++;
  registry.emplace(handle, std::move(ctx));
  return handle;
}

std::shared_ptr<Context> seal_context(int64_t handle) {
  std::shared_ptr<Context> ctx;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(handle);
    if (it == registry.end()) return nullptr;
    ctx = it->second;
  }
  // Wait for a collective still running in another thread before the caller
  // frees or unmaps what it uses. The handle stays registered meanwhile, so
  // that an abort on a third thread (abort_context) still ends that
  // collective's wait for a peer.
  std::lock_guard<std::mutex> wait(ctx->in_flight);
  ctx->closed = true;
  return ctx;
}

void destroy_context(int64_t handle, bool keep_alive) {
  std::shared_ptr<Context> ctx = seal_context(handle);
  if (ctx == nullptr) return;
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
  if (keep_alive) kept_alive.push_back(ctx);
}

std::shared_ptr<Context> get_context(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(handle);
  // Handles are never reused: one below next_handle was closed, maybe by
  // another thread between the steps of this call (or a compiled graph kept it).
  TORCH_CHECK(it != registry.end() || handle < 1 || handle >= next_handle, "pyallreduce: communicator handle ",
              handle, " was closed (before this call, or by another thread during it); create a new Communicator");
  TORCH_CHECK(it != registry.end(), "pyallreduce: communicator handle ", handle,
              " was never created; create a new Communicator");
  return it->second;
}

void abort_context(int64_t handle, bool end_kernels) {
  std::shared_ptr<Context> ctx;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(handle);
    if (it == registry.end()) return;
    ctx = it->second;
  }
  ctx->aborted.store(true);
#ifdef PYALLREDUCE_WITH_CUDA
  // Before the wait below: a call in flight may be waiting for its kernel (an agreement round).
  if (end_kernels && ctx->is_cuda) cuda_interrupt(*ctx);
#endif
  // Then waits for a call already past its guard (a host wait gives up at its
  // next look; a CUDA call returns once launched, or, waiting for its kernel,
  // once that ends): afterwards none runs and none starts, so every launch is
  // in the launch chain close() waits for (with end_kernels, each gives up
  // waiting within kAbortLookNs).
  std::lock_guard<std::mutex> sealed(ctx->in_flight);
}

CollectiveGuard::CollectiveGuard(Context& ctx) : ctx_(ctx) {
  TORCH_CHECK(ctx.in_flight.try_lock(),
              "pyallreduce: another thread is inside a collective on this communicator; "
              "a communicator runs one collective at a time (use one per thread)");
  if (ctx.closed) {
    ctx.in_flight.unlock();
    TORCH_CHECK(false, "pyallreduce: this communicator is closed; create a new Communicator");
  }
  if (ctx.aborted.load()) {
    ctx.in_flight.unlock();
    TORCH_CHECK(false, "pyallreduce: this communicator was aborted; create a new Communicator (or process group) "
                "on the ranks that go on");
  }
  if (ctx.broken.load()) {
    ctx.in_flight.unlock();
    TORCH_CHECK(false, "pyallreduce: this communicator is unusable after an earlier failure (",
                ctx.broken_reason, "); close() it and create a new Communicator on every rank");
  }
}

CollectiveGuard::~CollectiveGuard() { ctx_.in_flight.unlock(); }

void CollectiveGuard::fail(const std::string& reason) {
  // The first line only: "unusable after an earlier failure (...)" quotes it,
  // and a C++ stack trace there would bury the reason.
  ctx_.broken_reason = reason.substr(0, reason.find('\n'));
  ctx_.broken.store(true);
}

// ---- per-call agreement (protocol.h, CallDesc) ------------------------------

bool calls_agree(const CallDesc& mine, const CallDesc* descs, int world_size) {
  for (int q = 0; q < world_size; ++q) {
    if (!same_call(descs[q], mine)) return false;
  }
  return true;
}

namespace {
std::string describe_call(const CallDesc& d, uint32_t epoch) {
  static const char* const kAlgos[] = {"one_shot", "two_shot", "agreement only", "reduce_scatter", "all_gather"};
  static const char* const kModes[] = {"staged", "zero-copy", "zero-copy in place",
                                       "torch.distributed fallback"};
  const uint32_t dtype = d.kind & 0xFFu, algo = (d.kind >> 8) & 0xFFu, mode = (d.kind >> 16) & 0xFFu;
  std::ostringstream s;
  s << d.bytes << " bytes, "
    << (dtype < static_cast<uint32_t>(at::ScalarType::NumOptions)
            ? c10::toString(static_cast<at::ScalarType>(dtype)) : "dtype ?")
    << ", " << (d.kind >> 24 & 1u ? "avg" : "sum") << ", " << (algo < 5 ? kAlgos[algo] : "algo ?")
    << ", " << (mode < 4 ? kModes[mode] : "mode ?") << ", " << (d.kind >> 25 & 1u ? "in place" : "out of place");
  if (d.epoch != epoch) s << " (protocol epoch " << d.epoch << ", expected " << epoch << ")";
  return s.str();
}
}  // namespace

std::string mismatch_message(int64_t call, uint32_t epoch, const CallDesc* descs, int world_size,
                             int64_t mismatches, int64_t last_call) {
  std::ostringstream s;
  s << "pyallreduce: the ranks disagree about collective call " << call
    << " on this communicator; nothing was reduced (every rank raises this error, and the "
       "communicator stays usable). Every rank must make the same calls in the same order, with the "
       "same size, dtype, op and algorithm:";
  for (int q = 0; q < world_size; ++q) s << "\n  rank " << q << ": " << describe_call(descs[q], epoch);
  if (mismatches > 1) {
    s << "\nThe ranks disagreed about " << mismatches - 1 << " later call" << (mismatches > 2 ? "s" : "")
      << " too, up to call " << last_call << ", before this rank looked: those were skipped as well, "
         "and none of their outputs was written.";
  }
  return s.str();
}

// ---- argument checks --------------------------------------------------------

// Why input/out cannot go to a kernel as they are, or "" if they can.
std::string collective_args_problem(const Context& ctx, const at::Tensor& input, const at::Tensor& out,
                                    int64_t algo) {
  const auto dtype = input.scalar_type();
  // all-gather copies bytes: any dtype; the reductions sum these three.
  if (algo != kAllGather && dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
    return c10::str("pyallreduce: dtype ", dtype, " is not supported (float32, float16, bfloat16)");
  }
  if (!input.is_contiguous() || !out.is_contiguous()) {
    return "pyallreduce: the op needs contiguous tensors (Communicator handles others)";
  }
  // The per-rank segment (protocol.h S) and the tensor that holds W of them.
  const bool scatters = algo == kReduceScatter, gathers = algo == kAllGather;
  const at::Tensor& segment = scatters ? out : input;
  const at::Tensor& whole = scatters ? input : out;
  const bool segmented = scatters || gathers;
  const int64_t parts = segmented ? ctx.world_size : 1;
  if (out.scalar_type() != dtype || whole.numel() != parts * segment.numel()) {
    if (!segmented) return "pyallreduce: out must have the input's dtype and numel";
    return c10::str("pyallreduce: ", scatters ? "reduce_scatter" : "all_gather", " needs one dtype and ",
                    scatters ? "input" : "out", ".numel() == world size (", ctx.world_size, ") x ",
                    scatters ? "out" : "input", ".numel()");
  }
  if (input.device() != out.device()) return "pyallreduce: input and out on different devices";
  const auto elem = static_cast<uintptr_t>(input.element_size());
  if (reinterpret_cast<uintptr_t>(input.data_ptr()) % elem || reinterpret_cast<uintptr_t>(out.data_ptr()) % elem) {
    return "pyallreduce: tensors must be aligned to their element size; pass a .clone() of this view";
  }
  if (input.is_cuda() != ctx.is_cuda || (ctx.is_cuda && input.get_device() != ctx.device)) {
    return c10::str("pyallreduce: tensor on ", input.device(), " but the communicator's memory is on ",
                    ctx.is_cuda ? "cuda:" + std::to_string(ctx.device) : std::string("cpu"));
  }
  const auto overlap = at::get_overlap_status(input, out);
  if (segmented) {
    const bool own_segment = collective_in_place(reinterpret_cast<uintptr_t>(input.data_ptr()),
                                                 reinterpret_cast<uintptr_t>(out.data_ptr()),
                                                 static_cast<int64_t>(segment.nbytes()), ctx.rank, algo);
    if (overlap != at::MemOverlapStatus::No && !own_segment) {
      return c10::str("pyallreduce: the input and out of ", scatters ? "reduce_scatter" : "all_gather",
                      " overlap; pass separate tensors, or as ", scatters ? "out" : "input",
                      " exactly this rank's segment of ", scatters ? "input" : "out");
    }
  } else if (overlap == at::MemOverlapStatus::Partial || overlap == at::MemOverlapStatus::TooHard) {
    // Large messages are reduced in rounds, so out would overwrite input not yet copied in.
    // (Full overlap, the same memory, is an in-place call.)
    return "pyallreduce: out overlaps the input; pass the same tensor (all_reduce_) or a separate one";
  }
  // What one call stages: the host backend runs reduce-scatter and all-gather
  // of any size in rounds; everything else must fit (the Communicator chunks).
  const int64_t staged = !segmented ? static_cast<int64_t>(input.nbytes())
                         : scatters ? parts * segment_stride(segment.nbytes())
                                    : static_cast<int64_t>(segment.nbytes());
  if ((!segmented || ctx.is_cuda) && staged > ctx.max_bytes) {
    return c10::str("pyallreduce: ", staged, " bytes to stage exceed the staging buffer (max_bytes=",
                    ctx.max_bytes, "); the Communicator chunks large tensors");
  }
  return {};
}

void check_collective_args(const Context& ctx, const at::Tensor& input, const at::Tensor& out,
                           int64_t algo) {
  TORCH_CHECK(algo == kOneShot || algo == kTwoShot || algo == kReduceScatter || algo == kAllGather,
              "pyallreduce: unknown algorithm id ", algo);
  const std::string problem = collective_args_problem(ctx, input, out, algo);
  TORCH_CHECK(problem.empty(), problem);
}

namespace {

// Runs one collective's protocol under its guard. A CallMismatch leaves the
// context usable (the protocol re-synchronised the ranks); any other failure
// past the checks happened mid-protocol: epochs are out of step, so it breaks.
template <typename Body>
void run_guarded(CollectiveGuard& guard, Context& ctx, Body&& body) {
  ++ctx.calls;
  try {
    body();
  } catch (const CallMismatch& e) {
    TORCH_CHECK(false, e.what());
  } catch (const c10::Error& e) {
    guard.fail(e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    guard.fail(e.what());
    throw;
  }
}

void run_on_context(Context& ctx, CollectiveImpl impl, const at::Tensor& input, at::Tensor& out,
                    int64_t algo, bool average, bool checked = false) {
  CollectiveGuard guard(ctx);
  if (!checked) check_collective_args(ctx, input, out, algo);
  run_guarded(guard, ctx, [&] { impl(ctx, input, out, algo, average); });
}

}  // namespace

void run_collective(CollectiveImpl impl, int64_t handle, const at::Tensor& input, at::Tensor& out,
                    int64_t algo, bool average) {
  std::shared_ptr<Context> held = get_context(handle);  // outlives a concurrent close()
  run_on_context(*held, impl, input, out, algo, average);
}

namespace {
// Filled by static initialisers (PYALLREDUCE_REGISTER_BACKEND) before any call.
std::array<CollectiveImpl, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
    eager_impls{};
}  // namespace

bool register_eager_impl(c10::DeviceType type, CollectiveImpl impl) {
  eager_impls[static_cast<size_t>(type)] = impl;
  return true;
}

namespace {
AgreeImpl agree_impls[2] = {};  // [is_cuda]
}  // namespace

bool register_agree_impl(c10::DeviceType type, AgreeImpl impl) {
  agree_impls[type == c10::DeviceType::CUDA] = impl;
  return true;
}

// pyallreduce._C.agree: the agreement round for a call this rank does not run
// through the kernels (a torch.distributed fallback, or an empty tensor).
// algo: kAgreeOnly for an all-reduce, else the collective (kReduceScatter,
// kAllGather) the round stands for, so that different fallbacks cannot pair.
void agree(int64_t handle, int64_t dtype, int64_t nbytes, int64_t mode, bool average, bool in_place,
           int64_t algo) {
  std::shared_ptr<Context> held = get_context(handle);
  AgreeImpl impl = agree_impls[held->is_cuda];
  TORCH_CHECK(impl != nullptr, "pyallreduce: this build has no agreement round for this device");
  CollectiveGuard guard(*held);
  CallDesc desc{static_cast<uint64_t>(nbytes), 0,
                desc_kind(static_cast<uint32_t>(dtype), static_cast<uint32_t>(algo), static_cast<uint32_t>(mode),
                          average, in_place)};
  run_guarded(guard, *held, [&] { impl(*held, desc); });
}

// The custom ops' work without the dispatcher's boxing, about a microsecond
// less per call, for Communicator's eager fast paths (never under torch.compile
// or a dispatch mode, which must see the op). algo: any op entry point's
// (kOneShot, kTwoShot, kReduceScatter, kAllGather). Returns false, having done
// nothing, where the tensors cannot go to a kernel as they are (see
// collective_args_problem); Communicator's general path then handles them.
namespace {
bool collective_eager(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo, bool average) {
  // Whatever must see the op: dispatch modes, torch function modes, the JIT
  // tracer, and wrapper tensors (functorch's vmap/grad, functionalization,
  // Python subclasses), whose data is not theirs to hand to a kernel.
  static const c10::DispatchKeySet kWrappers{c10::DispatchKey::FuncTorchBatched,
                                             c10::DispatchKey::FuncTorchGradWrapper,
                                             c10::DispatchKey::Functionalize, c10::DispatchKey::Python};
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled() ||
      torch::jit::tracer::isTracing() || (input.key_set() | out.key_set()).has_any(kWrappers) ||
      !input.has_storage() || !out.has_storage()) {
    return false;
  }
  CollectiveImpl impl = eager_impls[static_cast<size_t>(input.device().type())];
  const bool segmented = algo == kReduceScatter || algo == kAllGather;
  if (impl == nullptr || input.numel() == 0 || (!segmented && out.sizes() != input.sizes()) ||
      !collective_args_problem(ctx, input, out, algo).empty()) {
    return false;
  }
  // The op's name, so torch.profiler shows these calls as it shows the op's.
  RECORD_FUNCTION(algo == kReduceScatter ? "pyallreduce::reduce_scatter_out"
                  : algo == kAllGather   ? "pyallreduce::all_gather_out"
                  : input.is_same(out)   ? "pyallreduce::all_reduce_"
                                         : "pyallreduce::all_reduce_out",
                  std::vector<c10::IValue>{});
  run_on_context(ctx, impl, input, out, algo, average, /*checked=*/true);
  return true;
}
}  // namespace

bool try_collective_eager(const at::Tensor& input, at::Tensor out, int64_t handle, int64_t algo, bool average) {
  std::shared_ptr<Context> held = get_context(handle);  // outlives a concurrent close()
  return collective_eager(*held, input, out, algo, average);
}

// ---- the eager all-reduce as one Python callable -------------------------------
//
// pyallreduce._C.eager_all_reduce(handle, two_shot_min_bytes, reference_min_bytes)
// makes a communicator's eager all-reduce: call(src, dst, op, algo) -> dst
// (dst None: a new tensor), or None having done nothing, which leaves the call
// to the Communicator's general path. Every decision of a call is made here,
// from what was fixed when the object was made (the context, the crossover
// row), and the object is called through CPython's vectorcall: no argument
// parsing, no handle lookup, no Python frame between the user's call and the
// kernel (issue 40: the Python layers were half of a small call's time).
// It declines what it does not decide itself: a tensor subclass, an op or
// algo that is not one of the strings, keywords.
namespace {

struct EagerAllReduce {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  std::shared_ptr<Context>* ctx;  // owned; keeps the context alive through a concurrent close()
  int64_t two_shot_min_bytes;
  int64_t reference_min_bytes;  // < 0: the reference never wins
};

PyObject* interned(const char* text) {
  static std::map<std::string, PyObject*> strings;  // made under the GIL, kept for the process
  auto it = strings.find(text);
  if (it == strings.end()) it = strings.emplace(text, PyUnicode_InternFromString(text)).first;
  return it->second;
}

// Whether obj is the str `text` (an interned literal is the same object; a str made at run time compares).
bool is_str(PyObject* obj, PyObject* text) {
  return obj == text || (PyUnicode_CheckExact(obj) && PyUnicode_Compare(obj, text) == 0);
}

PyObject* eager_all_reduce_call(PyObject* callable, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  static PyObject* const sum = interned("sum");
  static PyObject* const avg = interned("avg");
  static PyObject* const automatic = interned("auto");
  static PyObject* const one_shot = interned("one_shot");
  static PyObject* const two_shot = interned("two_shot");
  const auto* self = reinterpret_cast<EagerAllReduce*>(callable);
  if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != nullptr) Py_RETURN_NONE;
  PyObject *src_obj = args[0], *dst_obj = args[1], *op = args[2], *algo = args[3];
  if (!THPVariable_CheckExact(src_obj) || (dst_obj != Py_None && !THPVariable_CheckExact(dst_obj))) {
    Py_RETURN_NONE;
  }
  bool average;
  if (is_str(op, sum)) {
    average = false;
  } else if (is_str(op, avg)) {
    average = true;
  } else {
    Py_RETURN_NONE;
  }
  const at::Tensor& src = THPVariable_Unpack(src_obj);
  const auto dtype = src.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) Py_RETURN_NONE;
  int64_t kernel;
  if (is_str(algo, automatic)) {
    const auto nbytes = static_cast<int64_t>(src.nbytes());
    if (self->reference_min_bytes >= 0 && nbytes >= self->reference_min_bytes) Py_RETURN_NONE;
    kernel = nbytes >= self->two_shot_min_bytes ? kTwoShot : kOneShot;
  } else if (is_str(algo, one_shot)) {
    kernel = kOneShot;
  } else if (is_str(algo, two_shot)) {
    kernel = kTwoShot;
  } else {
    Py_RETURN_NONE;
  }
  at::Tensor dst = dst_obj == Py_None ? at::empty_like(src) : THPVariable_Unpack(dst_obj);
  bool ran;
  {
    pybind11::gil_scoped_release no_gil;  // while the ranks meet, as torch.ops calls do
    ran = collective_eager(**self->ctx, src, dst, kernel, average);
  }
  if (!ran) Py_RETURN_NONE;
  if (dst_obj != Py_None) {
    Py_INCREF(dst_obj);
    return dst_obj;
  }
  return THPVariable_Wrap(std::move(dst));
  END_HANDLE_TH_ERRORS
}

void eager_all_reduce_dealloc(PyObject* obj) {
  delete reinterpret_cast<EagerAllReduce*>(obj)->ctx;
  Py_TYPE(obj)->tp_free(obj);
}

PyTypeObject eager_all_reduce_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "pyallreduce._C.EagerAllReduce";
  t.tp_basicsize = sizeof(EagerAllReduce);
  t.tp_dealloc = eager_all_reduce_dealloc;
  t.tp_vectorcall_offset = offsetof(EagerAllReduce, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_doc = "a communicator's eager all-reduce: call(src, dst, op, algo) -> dst, or None having done nothing";
  return t;
}();

py::object make_eager_all_reduce(int64_t handle, int64_t two_shot_min_bytes, int64_t reference_min_bytes) {
  std::shared_ptr<Context> ctx = get_context(handle);
  if (PyType_Ready(&eager_all_reduce_type) < 0) throw py::error_already_set();
  PyObject* obj = PyType_GenericAlloc(&eager_all_reduce_type, 0);
  if (obj == nullptr) throw py::error_already_set();
  auto* self = reinterpret_cast<EagerAllReduce*>(obj);
  self->vectorcall = eager_all_reduce_call;
  self->ctx = new std::shared_ptr<Context>(std::move(ctx));
  self->two_shot_min_bytes = two_shot_min_bytes;
  self->reference_min_bytes = reference_min_bytes;
  return py::reinterpret_steal<py::object>(obj);
}

}  // namespace

// pyallreduce._C.check: raises what a GPU kernel of this communicator recorded
// (a mismatch, a deadline), which the calls themselves report only at the
// next call. Host calls raise at once: nothing to do there.
void check(int64_t handle) {
  std::shared_ptr<Context> held = get_context(handle);
#ifdef PYALLREDUCE_WITH_CUDA
  if (held->is_cuda) {
    CollectiveGuard guard(*held);
    try {
      cuda_check(*held);
    } catch (const CallMismatch& e) {  // the protocol is in step again: still usable
      TORCH_CHECK(false, e.what());
    }
  }
#endif
}

}  // namespace pyallreduce

// ---- schemas ------------------------------------------------------------------

TORCH_LIBRARY(pyallreduce, m) {
  // handle: a Context from create_context; algo: 0 one-shot, 1 two-shot;
  // average: divide the fp32 sum by the world size before the final cast.
  m.def("all_reduce(Tensor input, int handle, int algo, bool average) -> Tensor");
  m.def("all_reduce_out(Tensor input, Tensor(a!) out, int handle, int algo, bool average) -> ()");
  m.def("all_reduce_(Tensor(a!) tensor, int handle, int algo, bool average) -> ()");
  // input: W segments, out: one (out may be this rank's segment of input).
  m.def("reduce_scatter_out(Tensor input, Tensor(a!) out, int handle, bool average) -> ()");
  // input: one segment (may be this rank's segment of out), out: W segments.
  m.def("all_gather_out(Tensor input, Tensor(a!) out, int handle) -> ()");
}

// ---- Python module ----------------------------------------------------------

namespace {

int64_t create_context(const std::vector<int64_t>& regions, int64_t rank, int64_t max_bytes,
                       int64_t nblocks, double timeout_s, int64_t device,
                       const std::vector<int64_t>& pids, bool ranks_outnumber_cores) {
  using namespace pyallreduce;
  const int64_t world = static_cast<int64_t>(regions.size());
  TORCH_CHECK(world >= 1 && world <= kMaxRanks, "pyallreduce: world size ", world,
              " outside 1..", kMaxRanks);
  TORCH_CHECK(rank >= 0 && rank < world, "pyallreduce: rank ", rank, " outside the group");
  TORCH_CHECK(max_bytes > 0 && max_bytes % kAlignment == 0, "pyallreduce: max_bytes must be a ",
              "positive multiple of ", kAlignment);
  TORCH_CHECK(nblocks >= 1 && nblocks <= kMaxBlocks, "pyallreduce: nblocks outside 1..",
              kMaxBlocks);
  TORCH_CHECK(timeout_s > 0, "pyallreduce: timeout must be positive");
  auto ctx = std::make_unique<Context>();
  ctx->rank = static_cast<int>(rank);
  ctx->world_size = static_cast<int>(world);
  ctx->max_bytes = max_bytes;
  ctx->nblocks = static_cast<int>(nblocks);
  ctx->timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
  ctx->is_cuda = device >= 0;
  ctx->device = static_cast<int>(device);
  for (int64_t q = 0; q < world; ++q) ctx->regions[q] = reinterpret_cast<char*>(regions[q]);
  ctx->pids = pids;
  ctx->ranks_outnumber_cores = ranks_outnumber_cores;
  return register_context(std::move(ctx));
}

// Host backend: this communicator's round size (Context::round_bytes), the
// same on every rank, before its first call: a rank that changed it later
// would run other rounds than its peers, whose descriptors carry only the
// call's size.
void set_round_bytes(int64_t handle, int64_t round_bytes) {
  using namespace pyallreduce;
  TORCH_CHECK(round_bytes > 0 && round_bytes % kAlignment == 0, "pyallreduce: round_bytes must be a positive ",
              "multiple of ", kAlignment, ", got ", round_bytes);
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(ctx->in_flight);
  TORCH_CHECK(ctx->calls == 0, "pyallreduce: set_round_bytes after the communicator's first call (",
              ctx->calls, " made); every rank must set it right after creating the communicator");
  ctx->round_bytes = round_bytes;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  using namespace pyallreduce;
  m.doc() = "pyallreduce kernels, op schemas and protocol constants";
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("ABORT_LOOK_NS") = kAbortLookNs;
  m.attr("ABORTED_BY") = kAbortedBy;
  m.attr("MAX_BLOCKS") = kMaxBlocks;
  m.attr("ALIGNMENT") = kAlignment;
  m.attr("DEFAULT_ROUND_BYTES") = kDefaultRoundBytes;
  m.attr("START_FLAGS_OFFSET") = kStartFlagsOffset;
  m.attr("MID_FLAGS_OFFSET") = kMidFlagsOffset;
  m.attr("EPOCH_OFFSET") = kEpochOffset;
  m.attr("DATA_OFFSET") = kDataOffset;
  m.attr("ONE_SHOT") = kOneShot;
  m.attr("TWO_SHOT") = kTwoShot;
  m.attr("AGREE_ONLY") = kAgreeOnly;
  m.attr("REDUCE_SCATTER") = kReduceScatter;
  m.attr("ALL_GATHER") = kAllGather;
  m.attr("SEGMENT_UNIT") = kSegmentUnit;
  m.attr("DESC_OFFSET") = kDescOffset;
  m.attr("DESC_BYTES") = kDescBytes;
  m.attr("MODE_STAGED") = kModeStaged;
  m.attr("MODE_FALLBACK") = kModeFallback;
  m.attr("DESC_COMPARED") = kDescCompared;
#ifdef PYALLREDUCE_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
#ifdef PYALLREDUCE_CUDA_SKIPPED_ON_REQUEST
  m.attr("CUDA_SKIPPED_ON_REQUEST") = true;  // PYALLREDUCE_SKIP_CUDA=1 (setup.py)
#else
  m.attr("CUDA_SKIPPED_ON_REQUEST") = false;
#endif
  m.def("region_bytes", &region_bytes, "bytes of one rank's region for a given max_bytes");
  m.def("segment_stride", &segment_stride, py::arg("segment_bytes"),
        "reduce-scatter's distance between segments in staging (protocol.h)");
  m.def("create_context", &create_context, py::arg("regions"), py::arg("rank"),
        py::arg("max_bytes"), py::arg("nblocks"), py::arg("timeout_s"), py::arg("device"),
        py::arg("pids"), py::arg("ranks_outnumber_cores") = false);
  m.def("set_round_bytes", &set_round_bytes, py::arg("handle"), py::arg("round_bytes"),
        "the host backend's round size of this communicator (every rank the same), before its first call",
        py::call_guard<py::gil_scoped_release>());
  // Both wait for a call in flight on another thread, which may need the GIL to finish.
  m.def(
      "seal_context", [](int64_t handle) { seal_context(handle); }, py::arg("handle"),
      "refuses every later collective on the context and waits for one in flight on another thread; the "
      "handle stays registered (abort_context reaches it) until destroy_context",
      py::call_guard<py::gil_scoped_release>());
  m.def("destroy_context", &destroy_context, py::arg("handle"), py::arg("keep_alive") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("abort_context", &abort_context, py::arg("handle"), py::arg("end_kernels"),
        py::call_guard<py::gil_scoped_release>());
  // The GIL is released while the ranks wait for each other, as torch.ops calls do.
  m.def("try_collective_eager", &try_collective_eager, py::arg("input"), py::arg("out"),
        py::arg("handle"), py::arg("algo"), py::arg("average"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eager_all_reduce", &make_eager_all_reduce, py::arg("handle"), py::arg("two_shot_min_bytes"),
        py::arg("reference_min_bytes"),
        "a communicator's eager all-reduce as one callable (see csrc/module.cpp)");
  m.def("dtype_code", [](at::ScalarType t) { return dtype_code(t); }, py::arg("dtype"),
        "the dtype field of a call descriptor (protocol.h CallDesc)");
  m.def("desc_kind", [](uint32_t dtype, int64_t algo, uint32_t mode, bool average, bool in_place) {
          return desc_kind(dtype, static_cast<uint32_t>(algo), mode, average, in_place);
        }, py::arg("dtype"), py::arg("algo"), py::arg("mode"), py::arg("average"), py::arg("in_place"));
  m.def("mismatch_message", [](int64_t call, uint32_t epoch, const std::vector<std::tuple<uint64_t, uint32_t, uint32_t>>& descs,
                                int64_t mismatches, int64_t last_call) {
          std::vector<CallDesc> d;
          for (const auto& [bytes, e, kind] : descs) d.push_back(CallDesc{bytes, e, kind});
          return mismatch_message(call, epoch, d.data(), static_cast<int>(d.size()), mismatches, last_call);
        }, py::arg("call"), py::arg("epoch"), py::arg("descs"), py::arg("mismatches") = 1, py::arg("last_call") = 0,
        "the mismatch error text from (bytes, epoch, kind) per rank (the Triton path uses it)");
  m.def("load_acquire_u32", [](int64_t address) {
          return __atomic_load_n(reinterpret_cast<const uint32_t*>(address), __ATOMIC_ACQUIRE);
        }, py::arg("address"),
        "the 32-bit word at address, read with acquire ordering (the Triton path's status record code, "
        "stored by a GPU with release: the fields read after it are the ones written before it)");
  // Collective, like a call: the GIL is released while the ranks meet.
  m.def("check", &check, py::arg("handle"), py::call_guard<py::gil_scoped_release>());
  m.def("agree", &agree, py::arg("handle"), py::arg("dtype"), py::arg("nbytes"), py::arg("mode"),
        py::arg("average"), py::arg("in_place"), py::arg("algo") = kAgreeOnly,
        py::call_guard<py::gil_scoped_release>());
  bind_shm(m);
  bind_backend(m);
  m.def("cpu_isa", &host_isa, "the vector ISA of the CPU backend's reductions: avx512, avx2 or generic");
#ifdef PYALLREDUCE_WITH_CUDA
  bind_cuda(m);
#endif
}
