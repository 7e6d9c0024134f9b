// The CUDA glue of csrc/cuda/glue.h: what one communicator keeps between
// calls (status record, launch order, registrations, graph table) and how a
// call is launched (the kernels: kernel_api.h, defined in kernels.cu). The
// pure decisions are in call_plan.h, which tests/sim runs too. No torch
// header here: adapter.cpp is the torch side.
#include "glue.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

#include "runtime.h"

namespace pyallreduce {
namespace cuda {

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  return capture != cudaStreamCaptureStatusNone;
}

namespace {

// ---- zero-copy registrations ------------------------------------------------------
// Per context: registered local buffers by start address, and the graph table.
// The key is the Context's address (a call receives a Context&, not its
// handle); the weak_ptr detects a destroyed context whose address was reused.

struct Registration {
  int64_t nbytes = 0;
  std::array<int64_t, kMaxRanks> peers{};  // every rank's buffer as mapped here
  bool captured = false;  // a captured call reads it in place: its graph holds the peers' addresses
};

// The graph table (GraphEntry, explained in all_reduce.cuh): entries for
// calls captured inside comm.capture() whose inputs may be registered when it
// exits. Blocks of device memory, zeroed (every entry kStaged) when allocated,
// which happens only outside captures, and never moved or reused: captured
// kernels hold pointers into them. Slot s is entry s % block_entries of block
// s / block_entries. comm.capture() starts a new block when the current one is
// more than half used, so one capture has at least half a block of entries.
struct GraphBlock {
  GraphEntry* device = nullptr;
  std::vector<GraphEntry> host;  // what the device entries say
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
  std::vector<Keep> kept;
  // Inputs of entries made zero copy and then staged again (graph_reset_entries):
  // the peers mapped them when comm.capture() shared them, so they too stay
  // until close().
  std::vector<Keep> retired;
  bool open = false;                // inside comm.capture(); the ranks compare `captured` at exit
  std::vector<CapturedCall> captured;
  int64_t calls_without_entry = 0;  // eligible, but the block was full

  GraphEntry& host_entry(int64_t slot) { return blocks[slot / block_entries].host[slot % block_entries]; }
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
      DeviceScope device(graph.device_index);
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
  if (offset + nbytes > it->second.nbytes || offset % kVecBytes != 0) return false;
  for (int q = 0; q < ctx.world_size; ++q) {
    peers[q] = reinterpret_cast<char*>(it->second.peers[q] + offset);
  }
  it->second.captured |= capturing;
  return true;
}

bool aligned(const void* p) { return vec_aligned(reinterpret_cast<uintptr_t>(p)); }

// Every rank's address of one buffer, as mapped here, for zero-copy reads
// (register() and graph entries): one per rank, this rank's is its own
// buffer, all 16-byte aligned for the kernels' vectors.
void check_peer_addresses(const Context& ctx, const std::vector<int64_t>& ptrs, int64_t own,
                          const std::string& what) {
  require(static_cast<int>(ptrs.size()) == ctx.world_size,
          what + " got " + std::to_string(ptrs.size()) + " addresses for world size " + std::to_string(ctx.world_size));
  require(ptrs[ctx.rank] == own, what + ": this rank's address must be its own buffer");
  for (int q = 0; q < ctx.world_size; ++q) {
    require(ptrs[q] != 0 && aligned(reinterpret_cast<const void*>(ptrs[q])),
            what + ": rank " + std::to_string(q) + "'s buffer is not " + std::to_string(kVecBytes) + "-byte aligned");
  }
}

// For a call being captured inside comm.capture(): its graph-table entry, or
// nullptr (eager call, not eligible, or no free entry). Records every captured
// call so comm.capture() can check that the ranks captured the same ones.
// keep: the input's keeper, made only when the call takes an entry.
const GraphEntry* graph_entry_for(const Context& ctx, cudaStream_t stream, bool eligible, const MakeKeep* keep,
                                  const char* input, int64_t bytes, bool in_place, int64_t algo, uint32_t dtype,
                                  bool average) {
  if (open_graph_tables.load(std::memory_order_relaxed) == 0) return nullptr;  // eager calls stop here
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  if (table == nullptr || !table->graph.open) return nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusActive) return nullptr;
  GraphTable& graph = table->graph;
  int64_t slot = -1;
  if (eligible && keep != nullptr) {
    slot = graph_take_slot(static_cast<int64_t>(graph.blocks.size()), graph.block_entries, graph.next_slot);
    if (slot < 0) {
      ++graph.calls_without_entry;
    } else {
      graph.input[slot] = reinterpret_cast<int64_t>(input);
      graph.in_place[slot] = in_place;
      graph.kept[slot] = (*keep)();
    }
  }
  graph.captured.push_back({slot, reinterpret_cast<int64_t>(input), bytes, in_place, algo, dtype, average});
  if (slot < 0) return nullptr;
  return graph.blocks[slot / graph.block_entries].device + slot % graph.block_entries;
}

// Copies the host entries of `slots` to the device and waits until they are
// there (a copy from pageable memory may return before its DMA ends). The
// caller makes sure no kernel of this communicator runs meanwhile.
void upload_entries(GraphTable& graph, const std::vector<int64_t>& slots, cudaStream_t stream) {
  std::vector<std::pair<int64_t, int64_t>> ranges;  // per block touched: [first, last)
  ranges.assign(graph.blocks.size(), {graph.block_entries, 0});
  for (int64_t slot : slots) {
    auto& r = ranges[slot / graph.block_entries];
    r.first = std::min(r.first, slot % graph.block_entries);
    r.second = std::max(r.second, slot % graph.block_entries + 1);
  }
  DeviceScope device(graph.device_index);  // relaxed: the host waits for a copy from pageable memory
  for (size_t b = 0; b < ranges.size(); ++b) {
    const auto [first, last] = ranges[b];
    if (first >= last) continue;
    check_cuda(cudaMemcpyAsync(graph.blocks[b].device + first, graph.blocks[b].host.data() + first,
                               sizeof(GraphEntry) * static_cast<size_t>(last - first), cudaMemcpyHostToDevice,
                               stream),
               "copying graph-table entries");
  }
  check_cuda(wait_relaxed(nullptr, stream), "waiting for the graph-table entries");
}

// A zeroed block of n entries (every entry kStaged).
GraphBlock allocate_block(int device, int64_t n, cudaStream_t stream) {
  DeviceScope scope(device);
  const size_t nbytes = sizeof(GraphEntry) * static_cast<size_t>(n);
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, nbytes), "cudaMalloc of a graph-table block");
  cudaError_t err = cudaMemsetAsync(ptr, 0, nbytes, stream);
  if (err == cudaSuccess) err = wait_relaxed(nullptr, stream);
  if (err != cudaSuccess) {
    cudaFree(ptr);
    raise_cuda(err, "zeroing a graph-table block");
  }
  GraphBlock block;
  block.device = static_cast<GraphEntry*>(ptr);
  block.host.assign(static_cast<size_t>(n), GraphEntry{});
  return block;
}

// The open graph table of ctx. Caller holds buffers_mutex.
GraphTable& graph_table_of(const Context& ctx) {
  ContextBuffers* table = buffers_of(&ctx);
  require(table != nullptr && !table->graph.blocks.empty(), "this communicator has no graph table");
  return table->graph;
}

// ---- status records ----------------------------------------------------------------
// Per context: the record the kernels fill in on a deadline or a mismatch
// (CallStatus, explained in kernel_api.h), in pinned host memory mapped into
// the device, so checking it before a launch is one host memory read.
// Allocated by prepare() when the Communicator is created, never at a call:
// a call may be inside a global-mode CUDA graph capture (torch.cuda.graph),
// where cudaHostAlloc and cudaEventCreate are prohibited and would invalidate
// the capture. Freed by clear_buffers (cudaFreeHost waits for the device, so
// no kernel still writes it).

}  // namespace

struct StatusRecord {
  CallStatus* host = nullptr;
  CallStatus* device = nullptr;   // the same memory as the kernels address it
  uint32_t* claim = nullptr;      // device memory, two words: the claim (CallStatus) and Call::gave_up
  char* own_region = nullptr;     // tells a record of a destroyed context whose address was reused
  LaunchOrder order;              // the last eager launch's stream (call_plan.h)
  cudaEvent_t launched = nullptr; // recorded after it
  bool captured = false;          // a kernel was launched into a capture: its graph may replay on any stream
};

namespace {

std::mutex status_mutex;
std::unordered_map<const Context*, StatusRecord> status_by_context;

void free_status(StatusRecord& rec) {
  RelaxedCaptureScope relaxed;  // frees
  if (rec.host != nullptr && cudaFreeHost(rec.host) != cudaSuccess) cudaGetLastError();
  if (rec.claim != nullptr && cudaFree(rec.claim) != cudaSuccess) cudaGetLastError();
  if (rec.launched != nullptr && cudaEventDestroy(rec.launched) != cudaSuccess) cudaGetLastError();
  rec = StatusRecord{};
}

// The context's own record, or null: none made (prepare not called, or it
// failed), or only a destroyed context's at this address. Caller holds status_mutex.
StatusRecord* own_record(const Context& ctx) {
  auto it = status_by_context.find(&ctx);
  return it != status_by_context.end() && it->second.own_region == ctx.own_region() ? &it->second : nullptr;
}

}  // namespace

StatusRecord& record_of(const Context& ctx) {
  std::lock_guard<std::mutex> lock(status_mutex);
  StatusRecord* rec = own_record(ctx);
  require(rec != nullptr,
          "this CUDA communicator has no status record (_C.cuda_prepare was not called after create_context)");
  return *rec;
}

std::pair<cudaEvent_t, bool> launch_chain(const Context& ctx) {
  std::lock_guard<std::mutex> lock(status_mutex);
  const StatusRecord* rec = own_record(ctx);
  if (rec == nullptr) return {nullptr, false};  // nothing was launched
  return {rec->launched, rec->captured};
}

namespace {

// Launches one kernel of the communicator after its previous one, whatever
// stream each is on (call_plan.h LaunchOrder).
template <typename Launch>
void launch_in_order(StatusRecord& rec, cudaStream_t stream, bool capturing, Launch launch) {
  if (order_launch(rec.order, stream, capturing)) {
    check_cuda(cudaStreamWaitEvent(stream, rec.launched, 0), "cudaStreamWaitEvent");
  }
  rec.captured |= capturing;  // first: a launch that raises below may still be in the graph
  launch();
  // The event follows whatever was enqueued, also when an earlier error is reported now.
  const cudaError_t launch_error = cudaGetLastError();
  if (!capturing) check_cuda(cudaEventRecord(rec.launched, stream), "cudaEventRecord");
  check_cuda(launch_error, "launching a kernel");
}

// Waits until no kernel of this communicator can still write its record: its
// last eager launch (every earlier one ran before it: launch_in_order) and
// what `stream`, the caller's current stream, holds (a replayed graph runs
// there, ordered with the eager calls as comm.capture() requires).
void wait_for_kernels(const StatusRecord& rec, cudaStream_t stream) {
  check_cuda(wait_relaxed(rec.launched, stream), "waiting for the communicator's kernels");
}

// Raises what the kernels recorded, if anything (only a deadline or an abort
// when `mismatch_too` is false). A deadline (or abort) stays recorded and marks the context
// broken (epochs are out of step). A mismatch is raised as CallMismatch (the
// kernels skipped the call and put the epochs back in step) once no kernel of
// ours can still count one, naming the first skipped call and how many
// followed; the record is cleared, so the next call starts clean. While
// `stream` is being captured nothing can wait: the record is then raised and
// kept.
void raise_from(Context& ctx, StatusRecord& rec, cudaStream_t stream, bool mismatch_too) {
  uint32_t code = __atomic_load_n(&rec.host->code, __ATOMIC_ACQUIRE);
  if (code == kStatusOk || (code == kStatusMismatch && !mismatch_too)) return;
  const bool capturing = is_capturing(stream);
  if (code == kStatusMismatch && !capturing) {
    wait_for_kernels(rec, stream);
    // A later kernel's deadline or abort may have taken the record over meanwhile (kClaimSevere).
    code = __atomic_load_n(&rec.host->code, __ATOMIC_ACQUIRE);
  }
  if (code == kStatusDeadline || code == kStatusAborted) {
    const std::string msg = gave_up_message(*rec.host, ctx.rank, ctx.world_size, ctx.timeout_ns);
    ctx.broken_reason = msg;
    ctx.broken.store(true);
    throw std::runtime_error(msg);
  }
  const CallStatus st = *rec.host;
  if (!capturing) {  // a new generation: the next failing block claims the record again (`aborted` stays)
    std::memset(rec.host, 0, offsetof(CallStatus, aborted));
    rec.host->generation = st.generation + 1;
  }
  throw CallMismatch(mismatch_message(st.call, st.epoch, st.descs, ctx.world_size, st.mismatches,
                                      st.last_mismatch_call));
}

// The fields every launch of ctx shares.
Call new_call(const Context& ctx, const StatusRecord& rec) {
  Call call{};
  for (int q = 0; q < ctx.world_size; ++q) call.regions[q] = ctx.regions[q];
  call.max_bytes = ctx.max_bytes;
  call.timeout_ns = ctx.timeout_ns;
  call.rank = ctx.rank;
  call.call_number = ctx.calls;
  call.status = rec.device;
  call.claim = rec.claim;
  call.gave_up = rec.claim + 1;
  return call;
}

}  // namespace

// ---- status record, launch order, checks --------------------------------------------

void prepare(Context& ctx, cudaStream_t stream) {
  require(ctx.is_cuda, "cuda_prepare needs a CUDA communicator");
  DeviceScope device(ctx.device);  // relaxed: allocations (see RelaxedCaptureScope)
  // Made without status_mutex: the wait below lasts as long as a kernel
  // already on `stream`, and an abort of that kernel's communicator
  // (interrupt) needs the mutex.
  void* host = nullptr;
  check_cuda(cudaHostAlloc(&host, sizeof(CallStatus), cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc of the status record");
  std::memset(host, 0, sizeof(CallStatus));
  static_cast<CallStatus*>(host)->generation = 1;  // above the claim word's 0
  void* mapped = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&mapped, host, 0);
  void* claim = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&claim, 2 * sizeof(uint32_t));
  // Zeroed before any kernel can claim it (or read that a wait gave up).
  if (err == cudaSuccess) err = cudaMemsetAsync(claim, 0, 2 * sizeof(uint32_t), stream);
  if (err == cudaSuccess) err = wait_relaxed(nullptr, stream);
  cudaEvent_t launched = nullptr;
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&launched, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    if (claim != nullptr) cudaFree(claim);
    raise_cuda(err, "making the status record");
  }
  StatusRecord made;
  made.host = static_cast<CallStatus*>(host);
  made.device = static_cast<CallStatus*>(mapped);
  made.claim = static_cast<uint32_t*>(claim);
  made.own_region = ctx.own_region();
  made.launched = launched;
  StatusRecord stale;  // a destroyed context's, whose address this one reuses
  {
    std::lock_guard<std::mutex> lock(status_mutex);
    StatusRecord& rec = status_by_context[&ctx];
    stale = rec;
    rec = made;
  }
  free_status(stale);  // not under the mutex either: cudaFreeHost waits for the device
}

void interrupt(const Context& ctx) {
  // The mutex keeps the record from being freed meanwhile; no CUDA call is
  // ever made under it (prepare, clear_buffers), so this never waits long.
  std::lock_guard<std::mutex> lock(status_mutex);
  StatusRecord* rec = own_record(ctx);
  if (rec == nullptr) return;  // no record of its own: no kernel of it ever ran
  __atomic_store_n(&rec->host->aborted, 1u, __ATOMIC_RELEASE);
}

void check(Context& ctx, cudaStream_t stream) {
  StatusRecord& rec = record_of(ctx);
  // Every kernel launched so far finishes or reaches its deadline.
  if (!is_capturing(stream)) wait_for_kernels(rec, stream);
  raise_from(ctx, rec, stream, /*mismatch_too=*/true);
}

void agree(Context& ctx, CallDesc desc, cudaStream_t stream) {
  // The host must know the answer before it calls torch.distributed, and a
  // capture cannot wait for it: there is no agreement round inside a capture.
  if (is_capturing(stream)) return;
  StatusRecord& rec = record_of(ctx);
  // An earlier call's deadline: launch nothing. Its mismatch is raised after
  // the round (every rank runs every round), with the round's own if any: the
  // record counts both.
  raise_from(ctx, rec, stream, /*mismatch_too=*/false);

  // The one-shot kernel with no bytes: start barrier, descriptor check, the
  // mid flags stored (protocol.h, kAgreeOnly). Its element type is immaterial.
  // The descriptor names the collective the round stands for (agree_algo).
  Call call = new_call(ctx, rec);
  call.bytes = 0;
  call.desc_bytes = desc.bytes;
  call.algo = kAgreeOnly;
  call.agree_algo = (desc.kind >> 8) & 0xFFu;
  call.mode = static_cast<Mode>((desc.kind >> 16) & 0xFFu);
  call.dtype = desc.kind & 0xFFu;
  call.average = (desc.kind >> 24) & 1u;
  call.in_place = (desc.kind >> 25) & 1u;
  bool launched = false;
  launch_in_order(rec, stream, /*capturing=*/false, [&] {
    launched = kernels::all_reduce(Element::kFloat32, ctx.world_size, call, ctx.nblocks, stream);
  });
  require(launched, "no CUDA kernel for world size " + std::to_string(ctx.world_size));
  wait_for_kernels(rec, stream);
  raise_from(ctx, rec, stream, /*mismatch_too=*/true);
}

int64_t resident_blocks(int device, int64_t world_size) {
  DeviceScope scope(device);
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  require(world_size >= 1 && world_size <= kMaxRanks, "no CUDA kernel for world size " + std::to_string(world_size));
  int per_sm = 0;
  check_cuda(kernels::fewest_resident_blocks_per_sm(static_cast<int>(world_size), &per_sm),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return int64_t(per_sm) * sms;
}

// ---- one collective call ---------------------------------------------------------------

void raise_deadline(Context& ctx, StatusRecord& rec, cudaStream_t stream) {
  raise_from(ctx, rec, stream, /*mismatch_too=*/false);
}

// Its mismatch is raised only after a call is launched: the host cannot know
// whether its previous kernel has finished, so whether it sees that record
// yet depends on timing; every rank launching every call keeps the ranks in
// step whichever call each one raises in (the record counts every mismatched
// call, so none goes unreported).
void raise_recorded(Context& ctx, StatusRecord& rec, cudaStream_t stream) {
  raise_from(ctx, rec, stream, /*mismatch_too=*/true);
}

bool launch_segment(Context& ctx, StatusRecord& rec, cudaStream_t stream, const CallArgs& args) {
  Call call = new_call(ctx, rec);
  call.bytes = args.bytes;
  call.desc_bytes = static_cast<uint64_t>(ctx.world_size) * static_cast<uint64_t>(args.bytes);
  call.input = args.input;
  call.out = args.out;
  call.algo = args.algo;
  call.average = args.average;
  call.dtype = args.dtype;
  const auto in_addr = reinterpret_cast<uintptr_t>(args.input);
  const auto out_addr = reinterpret_cast<uintptr_t>(args.out);
  const CallPlan plan = plan_segment_call(in_addr, out_addr, args.bytes, ctx.rank, args.algo);
  call.mode = plan.mode;
  call.in_place = plan.in_place;
  const bool capturing = is_capturing(stream);
  // The kernels access the caller's side element by element where it is not
  // 16-byte aligned (the adapter refused elements not aligned to their size,
  // which would fault). No graph entry: recorded for comm.capture()'s comparison only.
  graph_entry_for(ctx, stream, /*eligible=*/false, nullptr, args.input, args.bytes, plan.in_place, args.algo,
                  args.dtype, args.average);
  bool launched = false;
  launch_in_order(rec, stream, capturing, [&] {
    if (args.algo == kAllGather) {
      launched = kernels::all_gather(ctx.world_size, call, ctx.nblocks, stream);
    } else if (args.reduces) {
      launched = kernels::reduce_scatter(args.element, ctx.world_size, call, ctx.nblocks, stream);
    }
  });
  return launched;
}

AllReduceCall plan_all_reduce(Context& ctx, const StatusRecord& rec, cudaStream_t stream, const CallArgs& args) {
  AllReduceCall c;
  c.call = new_call(ctx, rec);
  c.call.bytes = args.bytes;
  c.call.desc_bytes = static_cast<uint64_t>(args.bytes);
  c.call.algo = args.algo;
  c.call.average = args.average;
  c.call.dtype = args.dtype;
  c.capturing = is_capturing(stream);
  const auto in_addr = reinterpret_cast<uintptr_t>(args.input);
  const auto out_addr = reinterpret_cast<uintptr_t>(args.out);
  const bool registered = may_read_in_place(in_addr, out_addr, args.bytes) &&
                          find_registered(ctx, reinterpret_cast<int64_t>(args.input), args.bytes,
                                          c.call.registered, c.capturing);
  c.plan = plan_call(in_addr, out_addr, args.bytes, args.algo, registered);
  c.call.mode = c.plan.mode;
  c.call.in_place = c.plan.in_place;
  return c;
}

bool launch_all_reduce(Context& ctx, StatusRecord& rec, cudaStream_t stream, AllReduceCall& c, const char* input,
                       char* out, const CallArgs& args, const MakeKeep& keep) {
  c.call.input = input;
  c.call.out = out;
  c.call.graph_entry = graph_entry_for(ctx, stream, c.plan.graph_entry_eligible, &keep, input, args.bytes,
                                       c.plan.in_place, args.algo, args.dtype, args.average);
  bool launched = false;
  launch_in_order(rec, stream, c.capturing, [&] {
    if (args.reduces) launched = kernels::all_reduce(args.element, ctx.world_size, c.call, ctx.nblocks, stream);
  });
  return launched;
}

// ---- zero-copy registrations ---------------------------------------------------------

void register_buffer(const std::shared_ptr<Context>& ctx, int64_t local_ptr, int64_t nbytes,
                     const std::vector<int64_t>& peer_ptrs) {
  require(ctx->is_cuda, "register needs a CUDA communicator");
  require(nbytes > 0, "cannot register an empty buffer");
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
  if (overlaps_next || overlaps_prev) {
    std::ostringstream s;
    s << "buffer at 0x" << std::hex << local_ptr << " overlaps a buffer already registered with this communicator";
    require(false, s.str());
  }
  table.by_start.emplace(local_ptr, reg);
}

bool unregister_buffer(const Context& ctx, int64_t local_ptr) {
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  if (table == nullptr) return false;
  auto it = table->by_start.find(local_ptr);
  if (it == table->by_start.end()) return false;
  require(!it->second.captured, "unregister: a CUDA graph captured a call that reads this buffer in place, and "
                                "its replays use the peers' mappings of it; it stays registered until close() "
                                "(free the graph, then close the communicator)");
  table->by_start.erase(it);
  return true;
}

bool is_registered(const Context& ctx, int64_t ptr, int64_t nbytes) {
  char* peers[kMaxRanks] = {};
  return find_registered(ctx, ptr, nbytes, peers);
}

std::vector<Keep> clear_buffers(const Context& ctx) {
  std::vector<Keep> kept;
  {
    std::lock_guard<std::mutex> lock(buffers_mutex);
    auto it = buffers_by_context.find(&ctx);
    if (it != buffers_by_context.end()) {
      for (Keep& t : it->second.graph.kept) {
        if (t) kept.push_back(std::move(t));
      }
      for (Keep& t : it->second.graph.retired) kept.push_back(std::move(t));
      erase_buffers(it);
    }
  }
  StatusRecord gone;
  {
    std::lock_guard<std::mutex> status_lock(status_mutex);
    auto st = status_by_context.find(&ctx);
    if (st != status_by_context.end()) {
      gone = st->second;
      status_by_context.erase(st);
    }
  }
  free_status(gone);  // outside the mutex (see prepare)
  return kept;
}

// ---- the graph table of comm.capture() ---------------------------------------------

void graph_capture_begin(const std::shared_ptr<Context>& ctx, int64_t block_entries, cudaStream_t stream) {
  require(ctx->is_cuda, "capture needs a CUDA communicator");
  require(block_entries > 0, "graph table blocks need a positive size");
  bool need_block;
  {
    std::lock_guard<std::mutex> lock(buffers_mutex);
    GraphTable& graph = buffers_for(ctx).graph;
    require(!graph.open, "comm.capture() is already open on this communicator");
    require(graph.blocks.empty() || graph.block_entries == block_entries, "graph table blocks cannot change size");
    need_block = graph_needs_block(static_cast<int64_t>(graph.blocks.size()), block_entries, graph.next_slot);
  }
  GraphBlock block;
  if (need_block) block = allocate_block(ctx->device, block_entries, stream);  // not under the lock
  std::lock_guard<std::mutex> lock(buffers_mutex);
  GraphTable& graph = buffers_for(ctx).graph;
  require(!graph.open, "comm.capture() is already open on this communicator");
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
    if (graph.host_entry(slot).mode == kStaged) graph.kept[slot] = nullptr;
  }
  graph.open = true;
  graph.captured.clear();
  graph.calls_without_entry = 0;
  open_graph_tables.fetch_add(1);
}

GraphCapture graph_capture_end(const Context& ctx) {
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  GraphCapture result;
  if (table == nullptr || !table->graph.open) return result;
  GraphTable& graph = table->graph;
  graph.open = false;
  open_graph_tables.fetch_sub(1);
  result.calls = std::move(graph.captured);
  result.calls_without_entry = graph.calls_without_entry;
  graph.captured.clear();
  return result;
}

void graph_set_entries(const Context& ctx, const std::vector<int64_t>& slots,
                       const std::vector<std::vector<int64_t>>& peer_ptrs, cudaStream_t stream) {
  require(slots.size() == peer_ptrs.size(), "graph entries: " + std::to_string(slots.size()) + " slots but " +
                                                std::to_string(peer_ptrs.size()) + " address lists");
  std::lock_guard<std::mutex> lock(buffers_mutex);
  GraphTable& graph = graph_table_of(ctx);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i];
    const std::vector<int64_t>& ptrs = peer_ptrs[i];
    require(slot >= 0 && slot < graph.next_slot && graph.input[slot] != 0,
            "graph entry " + std::to_string(slot) + " was never used");
    check_peer_addresses(ctx, ptrs, graph.input[slot], "graph entry " + std::to_string(slot));
    GraphEntry entry{};
    for (int q = 0; q < ctx.world_size; ++q) entry.registered[q] = reinterpret_cast<const char*>(ptrs[q]);
    entry.mode = graph.in_place[slot] ? kRegisteredInPlace : kRegistered;
    graph.host_entry(slot) = entry;
  }
  upload_entries(graph, slots, stream);
}

void graph_reset_entries(const Context& ctx, const std::vector<int64_t>& slots, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(buffers_mutex);
  GraphTable& graph = graph_table_of(ctx);
  std::vector<int64_t> valid;
  for (int64_t slot : slots) {
    if (slot < 0 || slot >= graph.next_slot) continue;
    graph.host_entry(slot) = GraphEntry{};
    if (graph.kept[slot]) graph.retired.push_back(std::move(graph.kept[slot]));
    graph.kept[slot] = nullptr;
    valid.push_back(slot);
  }
  upload_entries(graph, valid, stream);
}

std::vector<int64_t> graph_entry_modes(const Context& ctx, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(buffers_mutex);
  ContextBuffers* table = buffers_of(&ctx);
  std::vector<int64_t> modes;
  if (table == nullptr) return modes;
  GraphTable& graph = table->graph;
  DeviceScope device(ctx.device);  // relaxed: copies the host waits for
  for (int64_t slot = 0; slot < graph.next_slot; ++slot) {
    if (graph.input[slot] == 0) continue;  // skipped when a new block began
    GraphEntry entry;  // read back from the device: what the kernels will see
    check_cuda(cudaMemcpyAsync(&entry, graph.blocks[slot / graph.block_entries].device + slot % graph.block_entries,
                               sizeof(entry), cudaMemcpyDeviceToHost, stream),
               "reading a graph-table entry");
    check_cuda(wait_relaxed(nullptr, stream), "waiting for a graph-table entry");
    modes.push_back(entry.mode);
  }
  return modes;
}

}  // namespace cuda
}  // namespace pyallreduce
