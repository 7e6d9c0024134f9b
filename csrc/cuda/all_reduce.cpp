// CUDA backend of the pyallreduce ops: picks the source mode (staged or
// zero-copy registered), builds the kernel arguments and launches the kernels
// (all-reduce, reduce-scatter, all-gather: kernel_api.h, defined in
// kernels.cu) on the current stream; runs the agreement round
// (cuda_agree) and reports what the kernels recorded in the communicator's
// status record (a deadline, a mismatch). Argument checks common to every
// backend already ran (run_collective in csrc/module.cpp). The pure decisions
// are in call_plan.h, which tests/sim runs too.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs cuBLAS/cuSPARSE headers

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "../common/op_args.h"
#include "call_plan.h"
#include "ipc.h"
#include "kernel_api.h"

namespace pyallreduce {
namespace {

// The kernels' element type of a reduction's dtype; false for a dtype without kernels.
bool element_of(at::ScalarType dtype, cuda::Element& element) {
  switch (dtype) {
    case at::kFloat: element = cuda::Element::kFloat32; return true;
    case at::kHalf: element = cuda::Element::kFloat16; return true;
    case at::kBFloat16: element = cuda::Element::kBFloat16; return true;
    default: return false;
  }
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// ---- zero-copy registrations ------------------------------------------------------
// Per context: registered local buffers by start address, and the graph table.
// The key is the Context's address (the op implementation receives a Context&,
// not its handle); the weak_ptr detects a destroyed context whose address was
// reused.

struct Registration {
  int64_t nbytes = 0;
  std::array<int64_t, kMaxRanks> peers{};  // every rank's buffer as mapped here
  bool captured = false;  // a captured call reads it in place: its graph holds the peers' addresses
};

// A call captured inside comm.capture(), until it exits. The ranks compare
// everything after `input` (a replay pairs calls by position).
struct CapturedCall {
  int64_t slot;   // its graph-table entry, or -1 (not eligible, or no free entry)
  int64_t input;  // this rank's input address
  int64_t nbytes;
  bool in_place;
  int64_t algo;
  std::string dtype;
  bool average;
};

// The graph table (cuda::GraphEntry, explained in all_reduce.cuh): entries for
// calls captured inside comm.capture() whose inputs may be registered when it
// exits. Blocks of device memory, zeroed (every entry kStaged) when allocated,
// which happens only outside captures, and never moved or reused: captured
// kernels hold pointers into them. Slot s is entry s % block_entries of block
// s / block_entries. comm.capture() starts a new block when the current one is
// more than half used, so one capture has at least half a block of entries.
struct GraphBlock {
  cuda::GraphEntry* device = nullptr;
  std::vector<cuda::GraphEntry> host;  // what the device entries say
};

struct GraphTable {
  int device_index = -1;
  int64_t block_entries = 0;
  std::vector<GraphBlock> blocks;
  int64_t next_slot = 0;
  std::vector<int64_t> input;       // per slot: this rank's captured input (0: never used)
  std::vector<uint8_t> in_place;    // per slot: the captured call was in place
  // Per slot: the captured input itself. Peers map its memory once the entry
  // is zero copy, and the graph's pool may free it when the graph goes: it is
  // kept until close() hands it to the transport, which drops it only after
  // every peer has unmapped it (a reference, no copy; no CUDA call: legal
  // during a capture). An entry that stayed staged lets its input go at the
  // next capture (peers never mapped it).
  std::vector<at::Tensor> kept;
  // Inputs of entries made zero copy and then staged again (graph_reset_entries):
  // the peers mapped them when comm.capture() shared them, so they too stay
  // until close().
  std::vector<at::Tensor> retired;
  bool open = false;                // inside comm.capture()
  std::vector<CapturedCall> captured;
  int64_t calls_without_entry = 0;  // eligible, but the block was full

  cuda::GraphEntry& host_entry(int64_t slot) {
    return blocks[slot / block_entries].host[slot % block_entries];
  }
};

struct ContextBuffers {
  std::weak_ptr<Context> owner;
  std::map<int64_t, Registration> by_start;
  GraphTable graph;
};

std::mutex buffers_mutex;
std::unordered_map<const Context*, ContextBuffers> buffers_by_context;
using BuffersIter = std::unordered_map<const Context*, ContextBuffers>::iterator;
// How many graph tables are open: eager calls check this, not the mutex.
std::atomic<int> open_graph_tables{0};

// Frees the graph table's device memory too. Only reached outside captures
// (close(), register(), capture() entry). The device may be unusable by then
// (process exit): a failed free is not an error worth raising here.
BuffersIter erase_buffers(BuffersIter it) {
  GraphTable& graph = it->second.graph;
  if (graph.open) open_graph_tables.fetch_sub(1);
  if (!graph.blocks.empty()) {
    try {
      RelaxedCaptureScope relaxed;
      c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(graph.device_index));
      for (GraphBlock& block : graph.blocks) {
        if (cudaFree(block.device) != cudaSuccess) cudaGetLastError();
      }
    } catch (const std::exception&) {  // no usable device left: nothing to free it on
    }
  }
  return buffers_by_context.erase(it);
}

// The live table of ctx, or nullptr. Caller holds buffers_mutex.
ContextBuffers* buffers_of(const Context* ctx) {
  auto it = buffers_by_context.find(ctx);
  if (it == buffers_by_context.end()) return nullptr;
  // Stale: that context is gone (buffers_for frees it, outside any capture).
  if (it->second.owner.lock().get() != ctx) return nullptr;
  return &it->second;
}

// The table of ctx, created if needed. Caller holds buffers_mutex.
ContextBuffers& buffers_for(const std::shared_ptr<Context>& ctx) {
  for (auto it = buffers_by_context.begin(); it != buffers_by_context.end();) {  // drop stale tables
    it = it->second.owner.expired() ? erase_buffers(it) : std::next(it);
  }
  ContextBuffers& table = buffers_by_context[ctx.get()];
  table.owner = ctx;
  return table;
}

// If [ptr, ptr + nbytes) lies inside a registered buffer at a 16-byte aligned
// offset, fills every rank's corresponding address. Every rank registered
// buffers of equal size at 16-byte aligned addresses and calls with the same
// offset, so every rank reaches the same answer here. A call being captured
// marks the buffer: it cannot be unregistered any more.
bool find_registered(const Context& ctx, int64_t ptr, int64_t nbytes, char* (&peers)[kMaxRanks],
                     bool capturing = false) {
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  if (table == nullptr) return false;
  auto it = table->by_start.upper_bound(ptr);
  if (it == table->by_start.begin()) return false;
  --it;
  const int64_t offset = ptr - it->first;
  if (offset + nbytes > it->second.nbytes || offset % cuda::kVecBytes != 0) return false;
  for (int q = 0; q < ctx.world_size; ++q) {
    peers[q] = reinterpret_cast<char*>(it->second.peers[q] + offset);
  }
  it->second.captured |= capturing;
  return true;
}

bool aligned(const void* p) { return cuda::vec_aligned(reinterpret_cast<uintptr_t>(p)); }

// Every rank's address of one buffer, as mapped here, for zero-copy reads
// (register() and graph entries): one per rank, this rank's is its own
// buffer, all 16-byte aligned for the kernels' vectors.
void check_peer_addresses(const Context& ctx, const std::vector<int64_t>& ptrs, int64_t own,
                          const std::string& what) {
  TORCH_CHECK(static_cast<int>(ptrs.size()) == ctx.world_size, "pyallreduce: ", what, " got ",
              ptrs.size(), " addresses for world size ", ctx.world_size);
  TORCH_CHECK(ptrs[ctx.rank] == own, "pyallreduce: ", what,
              ": this rank's address must be its own buffer");
  for (int q = 0; q < ctx.world_size; ++q) {
    TORCH_CHECK(ptrs[q] != 0 && aligned(reinterpret_cast<const void*>(ptrs[q])),
                "pyallreduce: ", what, ": rank ", q, "'s buffer is not ", cuda::kVecBytes,
                "-byte aligned");
  }
}

// For a call being captured inside comm.capture(): its graph-table entry, or
// nullptr (eager call, not eligible, or no free entry). Records every captured
// call so comm.capture() can check that the ranks captured the same ones.
const cuda::GraphEntry* graph_entry_for(const Context& ctx, cudaStream_t stream, bool eligible,
                                        const at::Tensor& tensor, const char* input, int64_t bytes,
                                        bool in_place, int64_t algo, bool average) {
  if (open_graph_tables.load(std::memory_order_relaxed) == 0) return nullptr;  // eager calls stop here
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  if (table == nullptr || !table->graph.open) return nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusActive) return nullptr;
  GraphTable& graph = table->graph;
  int64_t slot = -1;
  if (eligible) {
    slot = cuda::graph_take_slot(static_cast<int64_t>(graph.blocks.size()), graph.block_entries,
                                 graph.next_slot);
    if (slot < 0) {
      ++graph.calls_without_entry;
    } else {
      graph.input[slot] = reinterpret_cast<int64_t>(input);
      graph.in_place[slot] = in_place;
      graph.kept[slot] = tensor;
    }
  }
  graph.captured.push_back({slot, reinterpret_cast<int64_t>(input), bytes, in_place, algo,
                            c10::toString(tensor.scalar_type()), average});
  if (slot < 0) return nullptr;
  return graph.blocks[slot / graph.block_entries].device + slot % graph.block_entries;
}

// Copies the host entries of `slots` to the device and waits until they are
// there (a copy from pageable memory may return before its DMA ends). The
// caller makes sure no kernel of this communicator runs meanwhile.
void upload_entries(GraphTable& graph, const std::vector<int64_t>& slots) {
  std::vector<std::pair<int64_t, int64_t>> ranges;  // per block touched: [first, last)
  ranges.assign(graph.blocks.size(), {graph.block_entries, 0});
  for (int64_t slot : slots) {
    auto& r = ranges[slot / graph.block_entries];
    r.first = std::min(r.first, slot % graph.block_entries);
    r.second = std::max(r.second, slot % graph.block_entries + 1);
  }
  const auto device = static_cast<c10::DeviceIndex>(graph.device_index);
  RelaxedCaptureScope relaxed;  // a copy from pageable memory: the host waits
  c10::cuda::CUDAGuard device_guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  for (size_t b = 0; b < ranges.size(); ++b) {
    const auto [first, last] = ranges[b];
    if (first >= last) continue;
    C10_CUDA_CHECK(cudaMemcpyAsync(graph.blocks[b].device + first, graph.blocks[b].host.data() + first,
                                   sizeof(cuda::GraphEntry) * static_cast<size_t>(last - first),
                                   cudaMemcpyHostToDevice, stream));
  }
  C10_CUDA_CHECK(wait_relaxed(nullptr, stream));
}

// A zeroed block of n entries (every entry kStaged).
GraphBlock allocate_block(int device, int64_t n) {
  RelaxedCaptureScope relaxed;
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  const size_t nbytes = sizeof(cuda::GraphEntry) * static_cast<size_t>(n);
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, nbytes));
  cudaError_t err = cudaMemsetAsync(ptr, 0, nbytes, stream);
  if (err == cudaSuccess) err = wait_relaxed(nullptr, stream);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    C10_CUDA_CHECK(err);
  }
  GraphBlock block;
  block.device = static_cast<cuda::GraphEntry*>(ptr);
  block.host.assign(static_cast<size_t>(n), cuda::GraphEntry{});
  return block;
}

// The open graph table of ctx. Caller holds buffers_mutex.
GraphTable& graph_table_of(const Context& ctx) {
  ContextBuffers* table = buffers_of(&ctx);
  TORCH_CHECK(table != nullptr && !table->graph.blocks.empty(),
              "pyallreduce: this communicator has no graph table");
  return table->graph;
}

// ---- status records ----------------------------------------------------------------
// Per context: the record the kernels fill in on a deadline or a mismatch
// (cuda::CallStatus, explained in all_reduce.cuh), in pinned host memory mapped
// into the device, so checking it before a launch is one host memory read.
// Allocated by cuda_prepare when the Communicator is created, never at a call:
// a call may be inside a global-mode CUDA graph capture (torch.cuda.graph),
// where cudaHostAlloc and cudaEventCreate are prohibited and would invalidate
// the capture. Freed by clear_cuda_buffers (cudaFreeHost waits for the device,
// so no kernel still writes it).

struct StatusRecord {
  cuda::CallStatus* host = nullptr;
  cuda::CallStatus* device = nullptr;  // the same memory as the kernels address it
  uint32_t* claim = nullptr;           // device memory (kernel_api.h CallStatus)
  char* own_region = nullptr;          // tells a record of a destroyed context whose address was reused
  cuda::LaunchOrder order;             // the last eager launch's stream (call_plan.h)
  cudaEvent_t launched = nullptr;      // recorded after it
};

std::mutex status_mutex;
std::unordered_map<const Context*, StatusRecord> status_by_context;

void free_status(StatusRecord& rec) {
  RelaxedCaptureScope relaxed;
  if (rec.host != nullptr && cudaFreeHost(rec.host) != cudaSuccess) cudaGetLastError();
  if (rec.claim != nullptr && cudaFree(rec.claim) != cudaSuccess) cudaGetLastError();
  if (rec.launched != nullptr && cudaEventDestroy(rec.launched) != cudaSuccess) cudaGetLastError();
  rec = StatusRecord{};
}

// The record of ctx, made by cuda_prepare.
StatusRecord& status_of(Context& ctx) {
  std::lock_guard<std::mutex> lock(status_mutex);
  auto it = status_by_context.find(&ctx);
  TORCH_CHECK(it != status_by_context.end() && it->second.own_region == ctx.own_region(),
              "pyallreduce: this CUDA communicator has no status record (_C.cuda_prepare was not called "
              "after create_context)");
  return it->second;
}

}  // namespace

void cuda_prepare(int64_t handle) {
  std::shared_ptr<Context> ctx = get_context(handle);
  TORCH_CHECK(ctx->is_cuda, "pyallreduce: cuda_prepare needs a CUDA communicator");
  RelaxedCaptureScope relaxed;  // allocations: see ipc.h
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx->device));
  std::lock_guard<std::mutex> lock(status_mutex);
  StatusRecord& rec = status_by_context[ctx.get()];
  free_status(rec);  // a destroyed context's, whose address this one reuses
  void* host = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(cuda::CallStatus), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, sizeof(cuda::CallStatus));
  static_cast<cuda::CallStatus*>(host)->generation = 1;  // above the claim word's 0
  void* device = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&device, host, 0);
  void* claim = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&claim, sizeof(uint32_t));
  // Zeroed before any kernel can claim it.
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx->device));
  if (err == cudaSuccess) err = cudaMemsetAsync(claim, 0, sizeof(uint32_t), stream);
  if (err == cudaSuccess) err = wait_relaxed(nullptr, stream);
  cudaEvent_t launched = nullptr;
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&launched, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    if (claim != nullptr) cudaFree(claim);
    C10_CUDA_CHECK(err);
  }
  rec.host = static_cast<cuda::CallStatus*>(host);
  rec.device = static_cast<cuda::CallStatus*>(device);
  rec.claim = static_cast<uint32_t*>(claim);
  rec.own_region = ctx->own_region();
  rec.launched = launched;
}

namespace {

// Launches one kernel of the communicator after its previous one, whatever
// stream each is on (call_plan.h LaunchOrder).
template <typename Launch>
void launch_in_order(StatusRecord& rec, cudaStream_t stream, bool capturing, Launch launch) {
  if (cuda::order_launch(rec.order, stream, capturing)) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, rec.launched, 0));
  }
  launch();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!capturing) C10_CUDA_CHECK(cudaEventRecord(rec.launched, stream));
}

// Waits until no kernel of this communicator can still write its record: its
// last eager launch (every earlier one ran before it: launch_in_order) and
// what `stream`, the caller's current stream, holds (a replayed graph runs
// there, ordered with the eager calls as comm.capture() requires).
void wait_for_kernels(const StatusRecord& rec, cudaStream_t stream) {
  C10_CUDA_CHECK(wait_relaxed(rec.launched, stream));
}

// Raises what the kernels recorded, if anything (only a deadline when
// `mismatch_too` is false). A deadline stays recorded and marks the context
// broken (epochs are out of step). A mismatch is raised as CallMismatch (the
// kernels skipped the call and put the epochs back in step) once no kernel of
// ours can still count one, naming the first skipped call and how many
// followed; the record is cleared, so the next call starts clean. While
// `stream` is being captured nothing can wait: the record is then raised and
// kept.
void raise_recorded(Context& ctx, StatusRecord& rec, cudaStream_t stream, bool mismatch_too = true) {
  const uint32_t code = __atomic_load_n(&rec.host->code, __ATOMIC_ACQUIRE);
  if (code == cuda::kStatusOk || (code == cuda::kStatusMismatch && !mismatch_too)) return;
  if (code == cuda::kStatusDeadline) {
    const std::string msg = cuda::deadline_message(*rec.host, ctx.rank, ctx.world_size, ctx.timeout_ns);
    ctx.broken_reason = msg;
    ctx.broken.store(true);
    TORCH_CHECK(false, msg);
  }
  const bool capturing = is_capturing(stream);
  if (!capturing) wait_for_kernels(rec, stream);
  const cuda::CallStatus st = *rec.host;
  if (!capturing) {  // a new generation: the next failing block claims the record again
    std::memset(rec.host, 0, sizeof(cuda::CallStatus));
    rec.host->generation = st.generation + 1;
  }
  throw CallMismatch(mismatch_message(st.call, st.epoch, st.descs, ctx.world_size, st.mismatches,
                                      st.last_mismatch_call));
}

}  // namespace

void cuda_check(Context& ctx) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx.device));
  StatusRecord& rec = status_of(ctx);
  // Every kernel launched so far finishes or reaches its deadline.
  if (!is_capturing(stream)) wait_for_kernels(rec, stream);
  raise_recorded(ctx, rec, stream);
}

void graph_capture_begin(int64_t handle, int64_t block_entries) {
  std::shared_ptr<Context> ctx = get_context(handle);
  TORCH_CHECK(ctx->is_cuda, "pyallreduce: capture needs a CUDA communicator");
  TORCH_CHECK(block_entries > 0, "pyallreduce: graph table blocks need a positive size");
  bool need_block;
  {
    std::lock_guard<std::mutex> lock(buffers_mutex);
    GraphTable& graph = buffers_for(ctx).graph;
    TORCH_CHECK(!graph.open, "pyallreduce: comm.capture() is already open on this communicator");
    TORCH_CHECK(graph.blocks.empty() || graph.block_entries == block_entries,
                "pyallreduce: graph table blocks cannot change size");
    need_block = cuda::graph_needs_block(static_cast<int64_t>(graph.blocks.size()), block_entries,
                                         graph.next_slot);
  }
  GraphBlock block;
  if (need_block) block = allocate_block(ctx->device, block_entries);  // not under the lock
  std::lock_guard<std::mutex> lock(buffers_mutex);
  GraphTable& graph = buffers_for(ctx).graph;
  TORCH_CHECK(!graph.open, "pyallreduce: comm.capture() is already open on this communicator");
  if (need_block) {
    graph.device_index = ctx->device;
    graph.block_entries = block_entries;
    graph.next_slot = static_cast<int64_t>(graph.blocks.size()) * block_entries;  // skips the old block's rest
    graph.blocks.push_back(std::move(block));
    graph.input.resize(graph.blocks.size() * block_entries, 0);
    graph.in_place.resize(graph.blocks.size() * block_entries, 0);
    graph.kept.resize(graph.blocks.size() * block_entries);
  }
  for (int64_t slot = 0; slot < graph.next_slot; ++slot) {
    if (graph.host_entry(slot).mode == cuda::kStaged) graph.kept[slot] = at::Tensor();
  }
  graph.open = true;
  graph.captured.clear();
  graph.calls_without_entry = 0;
  open_graph_tables.fetch_add(1);
}

GraphCapture graph_capture_end(int64_t handle) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(ctx.get());
  GraphCapture result;
  if (table == nullptr || !table->graph.open) return result;
  GraphTable& graph = table->graph;
  graph.open = false;
  open_graph_tables.fetch_sub(1);
  for (const CapturedCall& c : graph.captured) {
    result.calls.emplace_back(c.slot, c.input, c.nbytes, c.in_place, c.algo, c.dtype, c.average);
  }
  result.calls_without_entry = graph.calls_without_entry;
  graph.captured.clear();
  return result;
}

void graph_set_entries(int64_t handle, const std::vector<int64_t>& slots,
                       const std::vector<std::vector<int64_t>>& peer_ptrs) {
  std::shared_ptr<Context> ctx = get_context(handle);
  TORCH_CHECK(slots.size() == peer_ptrs.size(), "pyallreduce: graph entries: ", slots.size(),
              " slots but ", peer_ptrs.size(), " address lists");
  std::lock_guard<std::mutex> lock(buffers_mutex);
  GraphTable& graph = graph_table_of(*ctx);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i];
    const std::vector<int64_t>& ptrs = peer_ptrs[i];
    TORCH_CHECK(slot >= 0 && slot < graph.next_slot && graph.input[slot] != 0,
                "pyallreduce: graph entry ", slot, " was never used");
    check_peer_addresses(*ctx, ptrs, graph.input[slot], "graph entry " + std::to_string(slot));
    cuda::GraphEntry entry{};
    for (int q = 0; q < ctx->world_size; ++q) entry.registered[q] = reinterpret_cast<const char*>(ptrs[q]);
    entry.mode = graph.in_place[slot] ? cuda::kRegisteredInPlace : cuda::kRegistered;
    graph.host_entry(slot) = entry;
  }
  upload_entries(graph, slots);
}

void graph_reset_entries(int64_t handle, const std::vector<int64_t>& slots) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  GraphTable& graph = graph_table_of(*ctx);
  std::vector<int64_t> valid;
  for (int64_t slot : slots) {
    if (slot < 0 || slot >= graph.next_slot) continue;
    graph.host_entry(slot) = cuda::GraphEntry{};
    if (graph.kept[slot].defined()) graph.retired.push_back(std::move(graph.kept[slot]));
    graph.kept[slot] = at::Tensor();
    valid.push_back(slot);
  }
  upload_entries(graph, valid);
}

std::vector<int64_t> graph_entry_modes(int64_t handle) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(ctx.get());
  std::vector<int64_t> modes;
  if (table == nullptr) return modes;
  GraphTable& graph = table->graph;
  RelaxedCaptureScope relaxed;  // copies the host waits for
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx->device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx->device));
  for (int64_t slot = 0; slot < graph.next_slot; ++slot) {
    if (graph.input[slot] == 0) continue;  // skipped when a new block began
    cuda::GraphEntry entry;  // read back from the device: what the kernels will see
    C10_CUDA_CHECK(cudaMemcpyAsync(&entry,
                                   graph.blocks[slot / graph.block_entries].device + slot % graph.block_entries,
                                   sizeof(entry), cudaMemcpyDeviceToHost, stream));
    C10_CUDA_CHECK(wait_relaxed(nullptr, stream));
    modes.push_back(entry.mode);
  }
  return modes;
}

void register_cuda_buffer(int64_t handle, int64_t local_ptr, int64_t nbytes,
                          const std::vector<int64_t>& peer_ptrs) {
  std::shared_ptr<Context> ctx = get_context(handle);
  TORCH_CHECK(ctx->is_cuda, "pyallreduce: register needs a CUDA communicator");
  TORCH_CHECK(nbytes > 0, "pyallreduce: cannot register an empty buffer");
  check_peer_addresses(*ctx, peer_ptrs, local_ptr, "register");
  Registration reg;
  reg.nbytes = nbytes;
  for (int q = 0; q < ctx->world_size; ++q) reg.peers[q] = peer_ptrs[q];
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers& table = buffers_for(ctx);
  auto next = table.by_start.lower_bound(local_ptr);
  if (next != table.by_start.end() && next->first == local_ptr && next->second.nbytes == nbytes &&
      next->second.peers == reg.peers) {
    return;  // registering the same buffer again is a no-op
  }
  const bool overlaps_next = next != table.by_start.end() && next->first < local_ptr + nbytes;
  const bool overlaps_prev = next != table.by_start.begin() &&
                             std::prev(next)->first + std::prev(next)->second.nbytes > local_ptr;
  TORCH_CHECK(!overlaps_next && !overlaps_prev, "pyallreduce: buffer at 0x", std::hex, local_ptr,
              " overlaps a buffer already registered with this communicator");
  table.by_start.emplace(local_ptr, reg);
}

bool unregister_cuda_buffer(int64_t handle, int64_t local_ptr) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(ctx.get());
  if (table == nullptr) return false;
  auto it = table->by_start.find(local_ptr);
  if (it == table->by_start.end()) return false;
  TORCH_CHECK(!it->second.captured, "pyallreduce: unregister: a CUDA graph captured a call that reads this "
              "buffer in place, and its replays use the peers' mappings of it; it stays registered until "
              "close() (free the graph, then close the communicator)");
  table->by_start.erase(it);
  return true;
}

std::vector<at::Tensor> clear_cuda_buffers(int64_t handle) {
  std::shared_ptr<Context> ctx = get_context(handle);
  std::lock_guard<std::mutex> lock(buffers_mutex);
  std::vector<at::Tensor> kept;
  auto it = buffers_by_context.find(ctx.get());
  if (it != buffers_by_context.end()) {
    for (at::Tensor& t : it->second.graph.kept) {
      if (t.defined()) kept.push_back(std::move(t));
    }
    for (at::Tensor& t : it->second.graph.retired) kept.push_back(std::move(t));
    erase_buffers(it);
  }
  std::lock_guard<std::mutex> status_lock(status_mutex);
  auto st = status_by_context.find(ctx.get());
  if (st != status_by_context.end()) {
    free_status(st->second);
    status_by_context.erase(st);
  }
  return kept;
}

bool is_cuda_buffer_registered(int64_t handle, int64_t ptr, int64_t nbytes) {
  std::shared_ptr<Context> ctx = get_context(handle);
  char* peers[kMaxRanks] = {};
  return find_registered(*ctx, ptr, nbytes, peers);
}

namespace {

// Reduce-scatter and all-gather (protocol.h): staged whatever is registered,
// no temporaries, no graph-table entry (call_plan.h plan_segment_call). A
// capture still records the call, so that comm.capture() compares it across
// ranks. Returns whether a kernel exists for the dtype and world size.
bool launch_segment_call(Context& ctx, StatusRecord& rec, cudaStream_t stream, bool capturing,
                         const at::Tensor& input, const at::Tensor& out, int64_t algo, cuda::Call& call) {
  const at::Tensor& segment = algo == kReduceScatter ? out : input;
  call.bytes = static_cast<int64_t>(segment.nbytes());
  call.desc_bytes = static_cast<uint64_t>(ctx.world_size) * static_cast<uint64_t>(call.bytes);
  call.input = static_cast<const char*>(input.data_ptr());
  call.out = static_cast<char*>(out.data_ptr());
  const auto in_addr = reinterpret_cast<uintptr_t>(call.input);
  const auto out_addr = reinterpret_cast<uintptr_t>(call.out);
  const cuda::CallPlan plan = cuda::plan_segment_call(in_addr, out_addr, call.bytes, ctx.rank, algo);
  call.mode = plan.mode;
  call.in_place = plan.in_place;
  // The kernels access the caller's side element by element where it is not
  // 16-byte aligned (collective_args_problem refused elements not aligned to
  // their size, which would fault).
  graph_entry_for(ctx, stream, /*eligible=*/false, input, call.input, call.bytes, plan.in_place, algo,
                  call.average);
  bool launched = false;
  launch_in_order(rec, stream, capturing, [&] {
    cuda::Element element;
    if (algo == kAllGather) {
      launched = cuda::kernels::all_gather(ctx.world_size, call, ctx.nblocks, stream);
    } else if (element_of(input.scalar_type(), element)) {
      launched = cuda::kernels::reduce_scatter(element, ctx.world_size, call, ctx.nblocks, stream);
    }
  });
  return launched;
}

// All-reduce (kOneShot, kTwoShot). Returns whether a kernel exists for the
// dtype and world size.
bool launch_all_reduce_call(Context& ctx, StatusRecord& rec, cudaStream_t stream, bool capturing,
                            const at::Tensor& input, at::Tensor& out, int64_t algo, cuda::Call& call) {
  const int64_t bytes = call.bytes;
  const auto* in_ptr = static_cast<const char*>(input.data_ptr());
  auto* out_ptr = static_cast<char*>(out.data_ptr());
  const auto in_addr = reinterpret_cast<uintptr_t>(in_ptr);
  const auto out_addr = reinterpret_cast<uintptr_t>(out_ptr);
  const bool registered = cuda::may_read_in_place(in_addr, out_addr, bytes) &&
                          find_registered(ctx, reinterpret_cast<int64_t>(in_ptr), bytes, call.registered, capturing);
  const cuda::CallPlan plan = cuda::plan_call(in_addr, out_addr, bytes, algo, registered);
  call.mode = plan.mode;
  call.in_place = plan.in_place;
  at::Tensor input_tmp, out_tmp;
  if (plan.copy_input) {
    input_tmp = input.clone(at::MemoryFormat::Contiguous);
    in_ptr = static_cast<const char*>(input_tmp.data_ptr());
  }
  if (plan.copy_out) {
    // A copy of out, not empty_like: a call the kernels skip (mismatch) must
    // leave out as it was after the copy back below.
    out_tmp = out.clone(at::MemoryFormat::Contiguous);
    out_ptr = static_cast<char*>(out_tmp.data_ptr());
  }
  call.input = in_ptr;
  call.out = out_ptr;
  call.graph_entry = graph_entry_for(ctx, stream, plan.graph_entry_eligible, input, in_ptr, bytes,
                                     plan.in_place, algo, call.average);

  bool launched = false;
  launch_in_order(rec, stream, capturing, [&] {
    cuda::Element element;
    if (element_of(input.scalar_type(), element)) {
      launched = cuda::kernels::all_reduce(element, ctx.world_size, call, ctx.nblocks, stream);
    }
  });
  if (launched && out_tmp.defined()) out.copy_(out_tmp);
  return launched;
}

}  // namespace

void cuda_collective(Context& ctx, const at::Tensor& input, at::Tensor& out, int64_t algo,
                     bool average) {
  const int64_t bytes = static_cast<int64_t>(input.nbytes());
  if (bytes == 0) return;  // same size on every rank: nobody signals, epochs stay in step
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx.device));
  // An earlier call's deadline: the ranks are out of step, launch nothing.
  // Its mismatch is raised only after this call is launched (below): the
  // host cannot know whether its previous kernel has finished, so whether it
  // sees that record yet depends on timing; every rank launching every call
  // keeps the ranks in step whichever call each one raises in (the record
  // counts every mismatched call, so none goes unreported).
  StatusRecord& rec = status_of(ctx);
  raise_recorded(ctx, rec, stream, /*mismatch_too=*/false);

  cuda::Call call{};
  for (int q = 0; q < ctx.world_size; ++q) call.regions[q] = ctx.regions[q];
  call.bytes = bytes;
  call.desc_bytes = static_cast<uint64_t>(bytes);
  call.max_bytes = ctx.max_bytes;
  call.timeout_ns = ctx.timeout_ns;
  call.rank = ctx.rank;
  call.algo = algo;
  call.average = average;
  call.dtype = dtype_code(input.scalar_type());
  call.call_number = ctx.calls;
  call.status = rec.device;
  call.claim = rec.claim;
  const bool capturing = is_capturing(stream);
  const bool launched = algo == kReduceScatter || algo == kAllGather
                            ? launch_segment_call(ctx, rec, stream, capturing, input, out, algo, call)
                            : launch_all_reduce_call(ctx, rec, stream, capturing, input, out, algo, call);
  TORCH_CHECK(launched, "pyallreduce: no CUDA kernel for dtype ", input.scalar_type(),
              " and world size ", ctx.world_size);
  raise_recorded(ctx, rec, stream);
}

void cuda_agree(Context& ctx, CallDesc desc) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(ctx.device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(ctx.device));
  // The host must know the answer before it calls torch.distributed, and a
  // capture cannot wait for it: there is no agreement round inside a capture.
  if (is_capturing(stream)) return;
  StatusRecord& rec = status_of(ctx);
  // An earlier call's deadline: launch nothing. Its mismatch is raised after
  // the round (every rank runs every round), with the round's own if any: the
  // record counts both.
  raise_recorded(ctx, rec, stream, /*mismatch_too=*/false);

  // The one-shot kernel with no bytes: start barrier, descriptor check, the
  // mid flags stored (protocol.h, kAgreeOnly). Its element type is immaterial.
  // The descriptor names the collective the round stands for (agree_algo).
  cuda::Call call{};
  for (int q = 0; q < ctx.world_size; ++q) call.regions[q] = ctx.regions[q];
  call.bytes = 0;
  call.desc_bytes = desc.bytes;
  call.max_bytes = ctx.max_bytes;
  call.timeout_ns = ctx.timeout_ns;
  call.rank = ctx.rank;
  call.algo = kAgreeOnly;
  call.agree_algo = (desc.kind >> 8) & 0xFFu;
  call.mode = static_cast<cuda::Mode>((desc.kind >> 16) & 0xFFu);
  call.dtype = desc.kind & 0xFFu;
  call.average = (desc.kind >> 24) & 1u;
  call.in_place = (desc.kind >> 25) & 1u;
  call.call_number = ctx.calls;
  call.status = rec.device;
  call.claim = rec.claim;
  bool launched = false;
  launch_in_order(rec, stream, /*capturing=*/false, [&] {
    launched = cuda::kernels::all_reduce(cuda::Element::kFloat32, ctx.world_size, call, ctx.nblocks, stream);
  });
  TORCH_CHECK(launched, "pyallreduce: no CUDA kernel for world size ", ctx.world_size);
  wait_for_kernels(rec, stream);
  raise_recorded(ctx, rec, stream);
}

int64_t cuda_resident_blocks(int64_t device, int64_t world_size) {
  c10::cuda::CUDAGuard device_guard(static_cast<c10::DeviceIndex>(device));
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, static_cast<int>(device)));
  TORCH_CHECK(world_size >= 1 && world_size <= kMaxRanks, "pyallreduce: no CUDA kernel for world size ", world_size);
  int per_sm = 0;
  C10_CUDA_CHECK(cuda::kernels::fewest_resident_blocks_per_sm(static_cast<int>(world_size), &per_sm));
  return int64_t(per_sm) * sms;
}

}  // namespace pyallreduce

PYALLREDUCE_REGISTER_BACKEND(CUDA, ::pyallreduce::cuda_collective)
static const bool pyallreduce_agree_cuda =
    ::pyallreduce::register_agree_impl(c10::DeviceType::CUDA, &::pyallreduce::cuda_agree);
