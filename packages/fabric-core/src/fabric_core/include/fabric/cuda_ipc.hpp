// CudaIpcDomain<Inner>: CUDA memory between the processes of one host, over CUDA IPC (NVLink
// or the GPU's own copy engines), added to any Domain of the engine core (fabric/engine.hpp).
//
// The inner domain (libfabric's shm provider, say) keeps carrying everything it carries: host
// memory, control messages, and every imm. What it cannot carry (a libfabric built without
// CUDA refuses FI_HMEM_CUDA registrations) is CUDA memory; this layer carries it:
//
// - Registering CUDA memory (of any visible GPU: the handle is taken in the allocation's own
//   device's primary context) exports the allocation's IPC handle (cuIpcGetMemHandle) into this
//   domain's handle table, a small POSIX shared-memory file named in the domain's address. The
//   key handed out (kIpcKeyBit set) names the table slot and the slot's generation. The
//   descriptor format is the engine's as ever: a key per NIC.
// - A write to such a key looks the key up in the peer's table (mapped read-only on first
//   use, entries read under a sequence lock and cached until the slot changes), opens the
//   allocation's handle once (cached; a peer in this same process is written directly), checks
//   the range, and copies (cuMemcpyDtoDAsync / HtoD) on this domain's own non-blocking
//   stream. Nothing of the caller's streams waits on it, or it on them. Copies of under
//   kKernelMaxBytes (FABRIC_CUDA_COPY_KERNEL_MAX overrides it; 0 turns the kernel off) from
//   this GPU's memory are cut into segments of kSegBytes and wait for the next poll, which
//   moves them (when there are kKernelMinBatch segments or more) in one launch of a
//   copy-list kernel (fabric/cuda_copy_kernel.cu, a block per segment at a time: the
//   segments go to the GPU through a pinned ring, one host-to-device copy per launch);
//   larger copies, and all where the kernel cannot be loaded, are a cuMemcpy each (the copy
//   engines). A paged write of thousands of pages is thus a few launches, not thousands of
//   copy-engine operations (each of those costs a few microseconds of the stream, whatever
//   its size). The poll then records one event for every copy queued since.
// - poll() finds the finished copies (events, in order: one stream) and only then delivers the
//   imms, so an imm arrives after its bytes are in place: the contract's "imm implies data".
//   They go through the peer's imm inbox (fabric/imm_inbox.hpp: a lane of shared memory this
//   domain claims in it), one record per run of copies with the same imm; where the peer has
//   no inbox or no free lane, or the lane is full, each is a zero-length write-with-imm
//   through the inner domain to the peer's doorbell (a tiny host region registered at open and
//   named in the address). Either way the peer's counter table counts it like any other. A
//   write without imm completes when its copy has.
// - Errors are the contract's: an unknown or stale key, a range outside the region or a
//   region without remote write is kRemoteAccess; a peer whose table is gone is
//   kPeerUnreachable; a failed copy is kTransport. All are reported through poll, as the
//   inner domain reports its own.
// - A peer whose process is gone, or whose engine closed, is kPeerUnreachable, checked before
//   each copy (its process at most every kAliveCheckNs) and again, in the poll that finds the
//   copy done, before the write is reported or its imm is sent: the provider would take a
//   write into a dead process's shared memory and complete it (shm does), and the copy
//   itself lands in memory this process keeps alive by its IPC mapping, so neither would
//   say so.
//
// Deregistration bumps the slot's sequence: initiators see it on their next write to the key,
// and a sweep (every kSweepNs while anything is cached) drops stale entries and closes the
// IPC mappings nothing uses any more, so a peer's freed GPU memory is not held here.
//
// Memory CUDA IPC cannot export (cuMemCreate / VMM allocations, as PyTorch's
// expandable_segments makes) is refused at registration with the driver's reason.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fabric/cuda.hpp>
#include <fabric/cuda_copy_kernel.hpp>
#include <fabric/engine.hpp>
#include <fabric/imm_inbox.hpp>
#include <fabric/shm_orphans.hpp>

namespace fabric::cuda_ipc {

constexpr uint64_t kIpcKeyBit = uint64_t(1) << 62;
constexpr uint32_t kSlots = 4096;
constexpr uint64_t kTableMagic = 0x3143504943424146ULL;  // "FABCIPC1"
constexpr uint64_t kDoorbellKey = uint64_t(1) << 47;    // apart from user and local keys
constexpr int64_t kSweepNs = 100'000'000;
// The intervals here (kSweepNs, kAliveCheckNs) are read from the coarse monotonic clock: a
// vDSO read of the last tick, no timer read. Every poll reads it (the inbox's reaping) and
// every copy to another process (the liveness check): the precise clock cost a few percent of
// a paged request's worker time on an H200 host (perf).
inline int64_t coarse_now_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}
constexpr int64_t kAliveCheckNs = 1'000'000;
constexpr char kTrailerMagic[8] = {'F', 'A', 'B', 'R', 'I', 'P', 'C', '1'};
constexpr size_t kNameBytes = 32;
// Appended to the inner address: doorbell address, doorbell key, table name, inner length,
// magic. A peer without it (no CUDA IPC there) is reached through the inner domain only.
constexpr size_t kTrailerBytes = 8 + 8 + kNameBytes + 2 + sizeof(kTrailerMagic);
constexpr uint64_t kKernelMaxBytes = uint64_t(16) << 20;  // smaller copies go through the copy-list kernel
constexpr uint64_t kSegBytes = uint64_t(256) << 10;       // ... cut into segments of this (a block each)
constexpr size_t kRingSegs = size_t(1) << 16;            // the kernel's segment ring (1.5 MiB)
constexpr size_t kMaxLaunch = size_t(1) << 14;            // segments per launch at most
constexpr unsigned kKernelBlocks = 1024, kKernelThreads = 512;
constexpr size_t kLaunchesAhead = 2;   // launches (marks) queued on the stream before the next batch waits
constexpr size_t kKernelMinBatch = 4;  // fewer pending segments: a cuMemcpy each (no ring copy, a launch less)

struct Seg {  // the kernel's FabricSeg
    uint64_t src, dst, len;
};
static_assert(sizeof(Seg) == 24, "the copy-list kernel reads 24-byte segments");

struct alignas(64) Entry {
    std::atomic<uint64_t> seq;  // even: stable; odd: being written. Never reused.
    uint64_t key;               // 0: free
    uint64_t va;                // the registered pointer, in the owner's address space
    uint64_t len;
    uint64_t offset;            // va minus the base of its allocation
    uint64_t remote_write;
    uint64_t pad[2];
    cuda::IpcMemHandle handle;
};
static_assert(sizeof(Entry) == 128, "one table entry is two cache lines");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the table is shared between processes");

struct Table {
    uint64_t magic;
    uint64_t pid;
    std::atomic<uint64_t> closed;  // set when the owner closes its engine
    uint64_t pad[13];
    Entry entries[kSlots];
};

class IpcError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Makes ``ctx`` current on this thread for the scope, restoring what was (the caller's thread
// may be a Python thread whose current device PyTorch relies on).
class ContextScope {
  public:
    explicit ContextScope(cuda::CUcontext ctx) {
        const cuda::Driver& d = cuda::Driver::get();
        cuda::CUcontext cur = nullptr;
        if (d.ctx_get_current(&cur) == 0 && cur == ctx) return;
        pushed_ = d.ctx_push(ctx) == 0;
    }
    ~ContextScope() {
        if (!pushed_) return;
        cuda::CUcontext popped = nullptr;
        cuda::Driver::get().ctx_pop(&popped);
    }
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

  private:
    bool pushed_ = false;
};

// Removes the tables and inboxes of processes that died without closing (kill -9):
// /dev/shm/fabric-ipc-<pid>-*.
inline void remove_orphan_tables() {
    remove_orphans("/dev/shm", [](const char* name) {
        int pid = 0;
        return std::sscanf(name, "fabric-ipc-%d-", &pid) == 1 ? pid : 0;
    });
}

template <class Inner>
class CudaIpcDomain : public Inner {
  public:
    struct Region {
        typename Inner::Mr inner{};
        void* inner_desc = nullptr;
        int slot = -1;       // >= 0: CUDA memory in this domain's table
        bool local = false;  // CUDA memory of this domain's own device (the kernel may read it)
    };
    using Mr = Region*;

    // ``cuda_device``: the device whose primary context holds this domain's stream and the
    // peers' opened allocations; < 0: no CUDA IPC (the inner domain, unchanged).
    template <class... Args>
    explicit CudaIpcDomain(int cuda_device, Args&&... args) : Inner(std::forward<Args>(args)...) {
        if (cuda_device >= 0) {
            try {
                open_ipc(cuda_device);
            } catch (...) {
                close_ipc();
                throw;
            }
        }
        address_ = Inner::address();
        if (ipc_) address_ += trailer();
    }
    ~CudaIpcDomain() { close_ipc(); }
    CudaIpcDomain(const CudaIpcDomain&) = delete;
    CudaIpcDomain& operator=(const CudaIpcDomain&) = delete;

    bool cuda_ipc() const { return ipc_; }
    // Why copies do not go through the copy-list kernel ("" where they do).
    const std::string& copy_kernel_off() const { return kernel_why_; }
    // Why imms go through the provider's doorbell rather than this domain's inbox ("" where
    // peers can use the inbox).
    const std::string& inbox_off() const { return inbox_why_; }
    const std::string& address() const { return address_; }

    // Whether a write counts towards the engine's queue depth (Engine::configure_queue). The
    // depth keeps a sender out of the provider's queue to a busy peer (on shm, a spin on the
    // target's queue lock). A copy into a peer's CUDA memory waits in no provider queue: it
    // is a segment for the next launch of the copy-list kernel, or a copy on this domain's
    // stream. Capping those made a paged request a pipeline of depth-sized batches, each
    // waiting for its kernel's event before the next was posted (two GPUs: KvCache 21 ms;
    // figures in docs/gpu.md). Zero-length writes (an imm alone) may go through the provider.
    bool counts_toward_queue_depth(const WriteOp& w) const { return !(ipc_ && (w.rkey & kIpcKeyBit) && w.len > 0); }

    uint64_t insert_peer(const std::string& address) {
        size_t n = address.size();
        if (n < kTrailerBytes || std::memcmp(address.data() + n - sizeof(kTrailerMagic), kTrailerMagic,
                                             sizeof(kTrailerMagic)) != 0)
            return Inner::insert_peer(address);
        const char* t = address.data() + n - kTrailerBytes;
        Peer p;
        std::memcpy(&p.doorbell_addr, t, 8);
        std::memcpy(&p.doorbell_key, t + 8, 8);
        p.table_name.assign(t + 16, strnlen(t + 16, kNameBytes));
        uint16_t inner_len = 0;
        std::memcpy(&inner_len, t + 16 + kNameBytes, 2);
        if (inner_len != n - kTrailerBytes) return Inner::insert_peer(address);  // not ours after all
        uint64_t handle = Inner::insert_peer(address.substr(0, inner_len));
        if (ipc_) {
            inner_handles_[address.substr(0, inner_len)] = handle;
            handles_version_.fetch_add(1, std::memory_order_release);
            auto it = peers_.find(handle);
            if (it == peers_.end() || it->second.table_name != p.table_name) {
                if (it != peers_.end()) unmap(it->second);
                peers_[handle] = std::move(p);
            }
        }
        return handle;
    }

    void remove_peer(uint64_t peer) {
        Inner::remove_peer(peer);
        if (!ipc_) return;
        for (auto h = inner_handles_.begin(); h != inner_handles_.end();) {
            h = h->second == peer ? inner_handles_.erase(h) : std::next(h);
        }
        handles_version_.fetch_add(1, std::memory_order_release);
        auto it = peers_.find(peer);
        if (it == peers_.end()) return;
        unmap(it->second);
        peers_.erase(it);
    }

    Region* register_memory(void* ptr, size_t len, uint64_t requested_key, bool remote_write, uint64_t& key,
                            void*& desc) {
        auto r = std::make_unique<Region>();
        if (ipc_ && cuda::is_device_pointer(ptr)) {
            r->slot = export_region(ptr, len, remote_write, key);
            r->local = cuda::device_ordinal(ptr) == ordinal_;
            desc = r.get();
        } else {
            r->inner = Inner::register_memory(ptr, len, requested_key, remote_write, key, r->inner_desc);
            desc = ipc_ ? static_cast<void*>(r.get()) : r->inner_desc;
        }
        return r.release();
    }

    void deregister_memory(Region* r) {
        if (r->slot >= 0) {
            unexport(r->slot);
        } else {
            Inner::deregister_memory(r->inner);
        }
        delete r;
    }

    // ``w`` (a write to a host key of the peer) as the inner domain takes it: its source's
    // inner descriptor. False where its source is CUDA memory, which goes only into the peer's
    // CUDA memory: ``ctx`` is then failed (reported by the next poll).
    bool for_inner(const WriteOp& w, void* ctx, WriteOp& x) {
        const Region* src = static_cast<const Region*>(w.desc);
        if (src && src->slot >= 0 && w.len) {
            later(ctx, kRemoteAccess,
                  "CUDA IPC: a CUDA source is written only into the peer's CUDA memory (this key is "
                  "host memory there)");
            return false;
        }
        x = w;
        x.desc = src ? src->inner_desc : nullptr;
        return true;
    }

    int post_write(const WriteOp& w, void* ctx) {
        if (!ipc_) return Inner::post_write(w, ctx);
        const Region* src = static_cast<const Region*>(w.desc);
        if (!(w.rkey & kIpcKeyBit)) {
            WriteOp x;
            return for_inner(w, ctx, x) ? Inner::post_write(x, ctx) : 0;
        }
        Peer* pp = reachable(w.peer, ctx);
        if (pp == nullptr) return 0;
        Peer& p = *pp;
        int32_t status = kOk;
        std::string why;
        if (w.len == 0) {
            if (!w.has_imm || (p.lane && p.lane->push(w.imm, 1))) {
                later(ctx, kOk, std::string());
                return 0;
            }
            return notify(p.doorbell_addr, p.doorbell_key, w.peer, w.imm, ctx);
        }
        uint64_t dst = 0;
        bool direct = false;
        if (!target_of(p, w.rkey, w.raddr, w.len, dst, direct, status, why)) {
            later(ctx, status, why);
            return 0;
        }
        Copy copy{ctx, w.peer, p.doorbell_addr, p.doorbell_key, w.imm, w.has_imm,
                  p.same_process ? 0 : int(p.table->pid), 1};
        if (by_kernel(src, direct, w.len)) {
            queue_segments(uint64_t(reinterpret_cast<uintptr_t>(w.src)), dst, w.len, copy, true);
            busy_++;
            return 0;
        }
        ContextScope scope(ctx_);
        int rc = copy_now(src, direct, dst, w.src, w.len);
        if (rc != 0) {
            later(ctx, kTransport, "CUDA IPC: cuMemcpyAsync: " + cuda::Driver::get().error(rc));
            return 0;
        }
        // No event per copy: the next poll records one for every copy queued since (one
        // stream: when it completes, they all have).
        inflight_.push_back(copy);
        unmarked_++;
        busy_++;
        return 0;
    }

    // The most pages of a list (post_write_list) a paged request to ``rkey`` may come as:
    // kMaxListPages to the peer's CUDA memory, and as the inner domain takes them elsewhere.
    size_t list_pages(uint64_t rkey) const {
        if (ipc_ && (rkey & kIpcKeyBit)) return kMaxListPages;
        return domain_list_pages(static_cast<const Inner&>(*this), rkey, 0);
    }

    // ``n`` writes of ``w.len`` bytes, from ``srcs[i]`` to ``w.raddr + dsts[i]``, each carrying
    // ``w``'s imm, as one work request: every page is checked first (a refusal fails them all,
    // and nothing is copied), then copied as post_write copies it, and ``ctx`` is reported
    // once, after the last copy has completed and the n imms have been delivered (in one
    // inbox record where the peer has a lane).
    // A list to any other key is the inner domain's (list_pages said so).
    int post_write_list(const WriteOp& w, const uint64_t* srcs, const uint64_t* dsts, size_t n, void* ctx) {
        if (!ipc_) return domain_post_list(static_cast<Inner&>(*this), w, srcs, dsts, n, ctx, 0);
        if (!(w.rkey & kIpcKeyBit)) {
            WriteOp x;
            return for_inner(w, ctx, x) ? domain_post_list(static_cast<Inner&>(*this), x, srcs, dsts, n, ctx, 0) : 0;
        }
        if (n == 0 || n > 0xffffffffu) {
            later(ctx, kRemoteAccess, "CUDA IPC: an empty list of writes");
            return 0;
        }
        const Region* src = static_cast<const Region*>(w.desc);
        Peer* pp = reachable(w.peer, ctx);
        if (pp == nullptr) return 0;
        Peer& p = *pp;
        int32_t status = kOk;
        std::string why;
        const typename Peer::Cached* c = cached_of(p, w.rkey, status, why);
        if (c == nullptr) {
            later(ctx, status, why);
            return 0;
        }
        std::vector<uint64_t>& at = list_dst_;
        at.resize(n);
        for (size_t i = 0; i < n; i++) {
            if (!place(*c, w.raddr + dsts[i], w.len, at[i], status, why)) {
                later(ctx, status, why);
                return 0;
            }
        }
        Copy copy{ctx, w.peer, p.doorbell_addr, p.doorbell_key, w.imm, w.has_imm,
                  p.same_process ? 0 : int(p.table->pid), uint32_t(n)};
        if (by_kernel(src, c->direct, w.len)) {
            for (size_t i = 0; i < n; i++) queue_segments(srcs[i], at[i], w.len, copy, i + 1 == n);
            busy_++;
            return 0;
        }
        ContextScope scope(ctx_);
        for (size_t i = 0; i < n; i++) {
            int rc = copy_now(src, c->direct, at[i], reinterpret_cast<const void*>(uintptr_t(srcs[i])), w.len);
            if (rc != 0) {  // (the pages copied before it complete on the stream; nothing waits for them)
                later(ctx, kTransport, "CUDA IPC: cuMemcpyAsync: " + cuda::Driver::get().error(rc));
                return 0;
            }
        }
        inflight_.push_back(copy);
        unmarked_++;
        busy_++;
        return 0;
    }

    template <class Sink>
    size_t poll(Sink& sink) {
        size_t n;
        if (doorbells_.empty()) {
            n = Inner::poll(sink);
        } else {  // a list's doorbell writes are this domain's to count, not the engine's
            Catch<Sink> catching{this, sink};
            n = Inner::poll(catching);
        }
        if (!ipc_) return n;
        if (inbox_.is_open()) n += drain_inbox(sink);
        bool sweep = sweep_due();
        if (busy_ == 0 && !sweep) return n;
        return n + poll_ipc(sink, sweep);
    }

  private:
    struct Peer {
        uint64_t doorbell_addr = 0;
        uint64_t doorbell_key = 0;
        std::string table_name;
        const Table* table = nullptr;  // mapped on first use
        bool same_process = false;
        int64_t alive_checked = std::numeric_limits<int64_t>::min() / 2;  // its process, last checked (ns)
        std::unique_ptr<inbox::Sender> lane;  // this domain's lane in the peer's imm inbox
        struct Cached {
            uint64_t seq, va, len, offset;  // offset: of va in its allocation
            uint64_t base;                  // where the allocation starts in this process
            bool remote_write;
            std::string handle;  // "" for a peer in this process
            bool direct;         // the copy-list kernel (this domain's device) can write it
        };
        std::unordered_map<uint64_t, Cached> keys;
    };
    struct Copy {
        void* ctx;
        uint64_t peer, doorbell_addr, doorbell_key;
        uint32_t imm;
        bool has_imm;
        int pid;         // the peer's process (0: this one)
        uint32_t count;  // writes it stands for (a list: its pages), and so imms it delivers
    };
    struct Mark {  // an event recorded after the copies before it
        cuda::CUevent event;  // null: the stream was synchronized instead (no event to be had)
        size_t copies;
        uint64_t ring_head;   // the kernel's segment ring is free up to here once it completes
    };
    struct Pending {  // a segment of a copy for the next launch of the copy-list kernel
        Seg seg;
        Copy copy;
        bool last;  // the copy's last segment: it completes with it
    };
    struct Later {
        void* ctx;
        int32_t status;  // kOk: a completion
        std::string message;
    };
    struct Notify {
        void* ctx;
        uint64_t peer, doorbell_addr, doorbell_key;
        uint32_t imm;
    };
    // A list's imms that no lane took: ``count`` doorbell writes, each posted with this as
    // its context; the list's ``ctx`` is reported once all of them are (``failed``: the first
    // failure's status and reason, reported instead).
    struct Doorbells {
        void* ctx;
        uint64_t peer, doorbell_addr, doorbell_key;
        uint32_t imm;
        uint32_t unposted, outstanding;
        int32_t failed = kOk;
        std::string why;
    };
    struct Opened {
        cuda::CUdeviceptr base = 0;
        size_t users = 0;
        bool direct = false;  // this domain's device reaches it (its own, or a peer it can access)
    };

    // The peer a write to its CUDA memory goes to, its table mapped and its process alive;
    // null, with the write failed (reported at the next poll), where it is not.
    Peer* reachable(uint64_t peer, void* ctx) {
        auto it = peers_.find(peer);
        if (it == peers_.end()) {
            later(ctx, kRemoteAccess, "CUDA IPC: this key names CUDA memory, and the peer's address has no CUDA IPC");
            return nullptr;
        }
        Peer& p = it->second;
        int32_t status = kOk;
        std::string why;
        if (!((p.table || map(p, status, why)) && alive(p, status, why))) {
            later(ctx, status, why);
            return nullptr;
        }
        return &p;
    }

    // The inner domain's completions, with those of a list's doorbell writes (Doorbells)
    // taken out and counted.
    template <class Sink>
    struct Catch {
        CudaIpcDomain* self;
        Sink& sink;
        void on_write_done(void* ctx) {
            if (!self->doorbell_done(ctx, kOk, std::string())) sink.on_write_done(ctx);
        }
        void on_error(void* ctx, int32_t status, const std::string& message) {
            if (!self->doorbell_done(ctx, status, message)) sink.on_error(ctx, status, message);
        }
        void on_send_done(void* ctx) { sink.on_send_done(ctx); }
        void on_recv(void* ctx, size_t len) { sink.on_recv(ctx, len); }
        void on_recv_truncated(void* ctx) { sink.on_recv_truncated(ctx); }
        void on_imm(uint32_t imm, uint64_t src) { sink.on_imm(imm, src); }
        void on_imms(uint32_t imm, uint64_t src, uint32_t count) { sink.on_imms(imm, src, count); }
    };

    // Whether ``ctx`` is one of a list's doorbell writes (then counted: the list is reported
    // once the last is).
    bool doorbell_done(void* ctx, int32_t status, const std::string& message) {
        for (size_t i = 0; i < doorbells_.size(); i++) {
            Doorbells& g = *doorbells_[i];
            if (static_cast<void*>(&g) != ctx) continue;
            g.outstanding--;
            if (status != kOk && g.failed == kOk) {
                g.failed = status;
                g.why = "CUDA IPC: delivering the imm: " + message;
                g.unposted = 0;  // the rest are not sent
            }
            if (g.outstanding == 0 && g.unposted == 0) finish_doorbells(i);
            return true;
        }
        return false;
    }

    void finish_doorbells(size_t i) {
        Doorbells& g = *doorbells_[i];
        later(g.ctx, g.failed, std::move(g.why));
        busy_--;  // (its own, taken when it was made; later() took one for the report)
        doorbells_.erase(doorbells_.begin() + std::ptrdiff_t(i));
    }

    // Posts the lists' doorbell writes not yet posted (a full provider queue: the next poll
    // goes on).
    void post_doorbells() {
        for (size_t i = 0; i < doorbells_.size();) {
            Doorbells& g = *doorbells_[i];
            while (g.unposted > 0) {
                int rc = notify(g.doorbell_addr, g.doorbell_key, g.peer, g.imm, &g);
                if (rc == -EAGAIN) break;
                if (rc != 0) {
                    bool peer = rc == -EHOSTUNREACH || rc == -ECONNREFUSED || rc == -ENOTCONN || rc == -ECONNRESET;
                    g.failed = peer ? kPeerUnreachable : kTransport;
                    g.why = "CUDA IPC: delivering the imm: " + std::string(std::strerror(-rc));
                    g.unposted = 0;
                    break;
                }
                g.unposted--;
                g.outstanding++;
            }
            if (g.unposted == 0 && g.outstanding == 0) {
                finish_doorbells(i);
                continue;
            }
            i++;
        }
    }

    // Whether a copy of ``len`` bytes from ``src`` goes through the copy-list kernel.
    bool by_kernel(const Region* src, bool direct, uint64_t len) const {
        return kernel_fn_ && direct && src && src->slot >= 0 && src->local && len < kernel_max_;
    }

    // A copy for the next poll's launch, in segments; ``last``: its Copy completes with it.
    void queue_segments(uint64_t from, uint64_t dst, uint64_t len, const Copy& copy, bool last) {
        for (uint64_t off = 0; off < len; off += kSegBytes) {
            uint64_t n = std::min(kSegBytes, len - off);
            pending_.push_back(Pending{Seg{from + off, dst + off, n}, copy, last && off + n == len});
        }
    }

    // A copy on this domain's stream now (under ctx_): typed copies where both ends are this
    // device's (or host memory); the generic one, which finds each end's device by its
    // address, where either end is another GPU's. The driver's code, 0 if queued.
    int copy_now(const Region* src, bool direct, uint64_t dst, const void* from, uint64_t len) {
        const cuda::Driver& d = cuda::Driver::get();
        auto at = reinterpret_cast<cuda::CUdeviceptr>(from);
        if (src && src->slot >= 0 && src->local && direct && d.memcpy_dtod_async)
            return d.memcpy_dtod_async(dst, at, len, stream_);
        if (src && src->slot < 0 && direct && d.memcpy_htod_async) return d.memcpy_htod_async(dst, from, len, stream_);
        return d.memcpy_async(dst, at, len, stream_);
    }

    void open_ipc(int device) {
        const cuda::Driver& d = cuda::Driver::get();
        if (!d.ipc()) throw IpcError("CUDA IPC: the CUDA driver (libcuda.so.1) is not there or lacks IPC");
        auto check = [&](int rc, const char* what) {
            if (rc != 0) throw IpcError(std::string("CUDA IPC: ") + what + ": " + d.error(rc));
        };
        check(d.init(0), "cuInit");
        int dev = 0;
        check(d.device_get(&dev, device), "cuDeviceGet");
        check(d.primary_ctx_retain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
        device_ = dev;
        ordinal_ = device;
        {
            ContextScope scope(ctx_);
            check(d.stream_create(&stream_, cuda::kStreamNonBlocking), "cuStreamCreate");
            load_kernel();
        }
        remove_orphan_tables();
        std::random_device rd;
        char name[kNameBytes];
        std::snprintf(name, sizeof(name), "/fabric-ipc-%d-%08x", int(getpid()), unsigned(rd()));
        int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) throw IpcError(std::string("CUDA IPC: shm_open(") + name + "): " + std::strerror(errno));
        table_name_ = name;
        bool sized = ftruncate(fd, sizeof(Table)) == 0;
        void* m = sized ? mmap(nullptr, sizeof(Table), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
        int err = errno;
        ::close(fd);
        if (m == MAP_FAILED) throw IpcError(std::string("CUDA IPC: the handle table: ") + std::strerror(err));
        table_ = static_cast<Table*>(m);
        table_->pid = uint64_t(getpid());
        table_->closed.store(0, std::memory_order_relaxed);
        for (uint32_t i = 0; i < kSlots; i++) {
            table_->entries[i].seq.store(0, std::memory_order_relaxed);
            free_slots_.push_back(kSlots - 1 - i);
        }
        gens_.assign(kSlots, 0);
        std::atomic_thread_fence(std::memory_order_release);
        table_->magic = kTableMagic;
        uint64_t key = 0;
        doorbell_mr_ = Inner::register_memory(&doorbell_, sizeof(doorbell_), kDoorbellKey, true, key, doorbell_desc_);
        doorbell_key_ = key;
        has_doorbell_ = true;
        if (!inbox_.open(inbox::inbox_name(table_name_), inbox_why_) && inbox_why_.empty())
            inbox_why_ = "no inbox";
        ipc_ = true;
    }

    // The copy-list kernel and its segment ring; without them (kernel_why_ says why) every
    // copy is a cuMemcpy. Under ctx_.
    void load_kernel() {
        const cuda::Driver& d = cuda::Driver::get();
        if (const char* v = std::getenv("FABRIC_CUDA_LAUNCHES_AHEAD")) {  // 0: launch at every poll
            char* end = nullptr;
            unsigned long long n = std::strtoull(v, &end, 10);
            if (end != v && *end == '\0') launches_ahead_ = size_t(n);
        }
        if (const char* v = std::getenv("FABRIC_CUDA_COPY_KERNEL_MAX")) {
            char* end = nullptr;
            unsigned long long n = std::strtoull(v, &end, 10);
            if (end && *end == '\0' && end != v) kernel_max_ = n;
        }
        if (kernel_max_ == 0) {
            kernel_why_ = "FABRIC_CUDA_COPY_KERNEL_MAX=0";
            return;
        }
        if (!d.kernels()) {
            kernel_why_ = "the CUDA driver lacks the module, launch or pinned-memory calls";
            return;
        }
        int rc = d.module_load_data(&module_, cuda::kCopyKernelPtx);
        if (rc == 0) rc = d.module_get_function(&kernel_fn_, module_, cuda::kCopyKernelName);
        if (rc == 0) rc = d.mem_alloc_host(reinterpret_cast<void**>(&ring_host_), kRingSegs * sizeof(Seg));
        if (rc == 0) rc = d.mem_alloc(&ring_dev_, kRingSegs * sizeof(Seg));
        if (rc == 0) return;
        kernel_why_ = "the copy-list kernel: " + d.error(rc);
        unload_kernel();
    }

    void unload_kernel() {  // under ctx_, the stream idle
        const cuda::Driver& d = cuda::Driver::get();
        if (ring_dev_) d.mem_free(ring_dev_);
        if (ring_host_) d.mem_free_host(ring_host_);
        if (module_) d.module_unload(module_);
        ring_dev_ = 0;
        ring_host_ = nullptr;
        module_ = nullptr;
        kernel_fn_ = nullptr;
    }

    void close_ipc() {
        const cuda::Driver& d = cuda::Driver::get();
        for (auto& [h, p] : peers_) unmap(p);
        peers_.clear();
        if (stream_) {
            {
                ContextScope scope(ctx_);
                d.stream_synchronize(stream_);
                for (auto& m : marks_)
                    if (m.event) d.event_destroy(m.event);
                for (auto ev : events_) d.event_destroy(ev);
                for (auto& [handle, o] : opened_) d.ipc_close_mem_handle(o.base);
                for (auto base : closing_) d.ipc_close_mem_handle(base);
                unload_kernel();
                d.stream_destroy(stream_);
            }
            pending_.clear();
            inflight_.clear();
            marks_.clear();
            unmarked_ = 0;
            events_.clear();
            opened_.clear();
            closing_.clear();
            stream_ = nullptr;
        }
        if (ctx_) d.primary_ctx_release(device_);
        ctx_ = nullptr;
        for (auto& [ordinal, o] : others_) d.primary_ctx_release(o.dev);
        others_.clear();
        if (has_doorbell_) Inner::deregister_memory(doorbell_mr_);
        has_doorbell_ = false;
        if (table_) {
            table_->closed.store(1, std::memory_order_release);
            munmap(table_, sizeof(Table));
        }
        table_ = nullptr;
        if (!table_name_.empty()) shm_unlink(table_name_.c_str());
        table_name_.clear();
        inbox_.close();
        ipc_ = false;
    }

    std::string trailer() const {
        std::string t(kTrailerBytes, '\0');
        uint64_t addr = reinterpret_cast<uint64_t>(&doorbell_);
        std::memcpy(&t[0], &addr, 8);
        std::memcpy(&t[8], &doorbell_key_, 8);
        std::memcpy(&t[16], table_name_.data(), std::min(table_name_.size(), kNameBytes - 1));
        uint16_t inner_len = static_cast<uint16_t>(Inner::address().size());
        std::memcpy(&t[16 + kNameBytes], &inner_len, 2);
        std::memcpy(&t[18 + kNameBytes], kTrailerMagic, sizeof(kTrailerMagic));
        return t;
    }

    int export_region(void* ptr, size_t len, bool remote_write, uint64_t& key) {
        const cuda::Driver& d = cuda::Driver::get();
        // the allocation's own device's context: memory of any GPU registers, not only of the
        // one this domain's stream is on (the driver looks allocations up per context)
        ContextScope scope(context_of(cuda::device_ordinal(ptr)));
        cuda::CUdeviceptr base = 0;
        size_t size = 0;
        int rc = d.mem_get_address_range(&base, &size, reinterpret_cast<cuda::CUdeviceptr>(ptr));
        if (rc != 0) throw IpcError("CUDA IPC: cuMemGetAddressRange: " + d.error(rc));
        uint64_t offset = reinterpret_cast<cuda::CUdeviceptr>(ptr) - base;
        if (offset + len > size)
            throw IpcError("CUDA IPC: the region runs past its allocation (" + std::to_string(size - offset) +
                           " bytes left in it)");
        cuda::IpcMemHandle handle{};
        rc = d.ipc_get_mem_handle(&handle, base);
        if (rc != 0)
            throw IpcError("CUDA IPC: cuIpcGetMemHandle: " + d.error(rc) +
                           " (memory mapped with cuMemCreate, as PyTorch's expandable_segments allocates, has "
                           "no CUDA IPC handle)");
        std::lock_guard<std::mutex> lock(table_mu_);
        if (free_slots_.empty())
            throw IpcError("CUDA IPC: " + std::to_string(kSlots) + " CUDA regions are registered already");
        uint32_t slot = free_slots_.back();
        free_slots_.pop_back();
        uint32_t gen = ++gens_[slot] & 0x3fffffffu;
        key = kIpcKeyBit | (uint64_t(gen) << 16) | slot;
        Entry& e = table_->entries[slot];
        uint64_t s = e.seq.load(std::memory_order_relaxed);
        e.seq.store(s + 1, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        e.key = key;
        e.va = reinterpret_cast<uint64_t>(ptr);
        e.len = len;
        e.offset = offset;
        e.remote_write = remote_write ? 1 : 0;
        e.handle = handle;
        e.seq.store(s + 2, std::memory_order_release);
        return int(slot);
    }

    // Can this domain's device (its kernels) reach memory of device ``ordinal``? Its own, or a
    // peer it has P2P access to (NVLink, or PCIe P2P); the copy engines serve the rest.
    bool reaches(int ordinal) const {
        if (ordinal < 0) return false;
        if (ordinal == ordinal_) return true;
        const cuda::Driver& d = cuda::Driver::get();
        int dev = 0, can = 0;
        if (!d.device_can_access_peer || d.device_get(&dev, ordinal) != 0) return false;
        return d.device_can_access_peer(&can, device_, dev) == 0 && can == 1;
    }

    // The primary context of CUDA device ``ordinal``: this domain's own, or one retained on
    // first use (released at close). Falls back to ctx_ where the device cannot be had.
    cuda::CUcontext context_of(int ordinal) {
        if (ordinal < 0 || ordinal == ordinal_) return ctx_;
        std::lock_guard<std::mutex> lock(table_mu_);
        auto it = others_.find(ordinal);
        if (it != others_.end()) return it->second.ctx;
        const cuda::Driver& d = cuda::Driver::get();
        int dev = 0;
        cuda::CUcontext c = nullptr;
        if (d.device_get(&dev, ordinal) != 0 || d.primary_ctx_retain(&c, dev) != 0) return ctx_;
        others_[ordinal] = Other{c, dev};
        return c;
    }

    void unexport(int slot) {
        std::lock_guard<std::mutex> lock(table_mu_);
        Entry& e = table_->entries[slot];
        uint64_t s = e.seq.load(std::memory_order_relaxed);
        e.seq.store(s + 1, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        e.key = 0;
        e.seq.store(s + 2, std::memory_order_release);
        free_slots_.push_back(uint32_t(slot));
    }

    // Where [raddr, raddr+len) of the peer's region ``rkey`` is in this process (under the
    // engine's progress lock).
    bool target_of(Peer& p, uint64_t rkey, uint64_t raddr, uint64_t len, uint64_t& dst, bool& direct,
                   int32_t& status, std::string& why) {
        const typename Peer::Cached* c = cached_of(p, rkey, status, why);
        if (c == nullptr || !place(*c, raddr, len, dst, status, why)) return false;
        direct = c->direct;
        return true;
    }

    // The peer's region ``rkey`` as this process reaches it (looked up, opened and cached on
    // first use; dropped once the peer's slot changed); null with the reason where it cannot.
    const typename Peer::Cached* cached_of(Peer& p, uint64_t rkey, int32_t& status, std::string& why) {
        if (!p.table && !map(p, status, why)) return nullptr;
        uint32_t slot = uint32_t(rkey & 0xffff);
        if (slot >= kSlots) {
            status = kRemoteAccess;
            why = "CUDA IPC: no such key at the peer";
            return nullptr;
        }
        const Entry& e = p.table->entries[slot];
        auto it = p.keys.find(rkey);
        if (it != p.keys.end() && e.seq.load(std::memory_order_acquire) != it->second.seq) {
            forget(it->second);
            p.keys.erase(it);
            it = p.keys.end();
        }
        if (it == p.keys.end()) {
            Entry snap;
            uint64_t seq = 0;
            for (int tries = 0;; tries++) {
                seq = e.seq.load(std::memory_order_acquire);
                if (!(seq & 1)) {
                    snap.key = e.key;
                    snap.va = e.va;
                    snap.len = e.len;
                    snap.offset = e.offset;
                    snap.remote_write = e.remote_write;
                    snap.handle = e.handle;
                    std::atomic_thread_fence(std::memory_order_acquire);
                    if (e.seq.load(std::memory_order_relaxed) == seq) break;
                }
                if (tries > 1000) {
                    status = kTransport;
                    why = "CUDA IPC: the peer's table entry never settled";
                    return nullptr;
                }
            }
            if (snap.key != rkey) {
                status = kRemoteAccess;
                why = "CUDA IPC: no such key at the peer (deregistered?)";
                return nullptr;
            }
            typename Peer::Cached c{seq,          snap.va, snap.len, snap.offset, 0, snap.remote_write != 0,
                                    std::string(), true};
            if (p.same_process) {
                c.base = snap.va - snap.offset;
                // another engine's memory in this process: the kernel writes it only on this device
                c.direct = cuda::device_ordinal(reinterpret_cast<void*>(c.base)) == ordinal_;
            } else {  // opened in ctx_ (lazy peer access): kernels here reach it where P2P does
                c.handle.assign(snap.handle.reserved, sizeof(snap.handle.reserved));
                Opened& o = opened_[c.handle];
                if (o.base == 0) {
                    const cuda::Driver& d = cuda::Driver::get();
                    ContextScope scope(ctx_);
                    int rc = d.ipc_open_mem_handle(&o.base, snap.handle, cuda::kIpcLazyEnablePeerAccess);
                    if (rc != 0) {
                        opened_.erase(c.handle);
                        status = kTransport;
                        why = "CUDA IPC: cuIpcOpenMemHandle: " + d.error(rc) +
                              " (is the peer's GPU visible to this process?)";
                        return nullptr;
                    }
                    o.direct = reaches(cuda::device_ordinal(reinterpret_cast<void*>(o.base)));
                }
                o.users++;
                c.base = o.base;
                c.direct = o.direct;
            }
            it = p.keys.emplace(rkey, std::move(c)).first;
            cached_.fetch_add(1, std::memory_order_relaxed);
        }
        return &it->second;
    }

    // Where [raddr, raddr+len) of ``c`` is in this process, or the refusal's reason.
    bool place(const typename Peer::Cached& c, uint64_t raddr, uint64_t len, uint64_t& dst, int32_t& status,
               std::string& why) const {
        uint64_t off = this->virt_addr() ? raddr - c.va : raddr;
        if ((this->virt_addr() && raddr < c.va) || off > c.len || len > c.len - off) {
            status = kRemoteAccess;
            why = "CUDA IPC: the write runs outside the peer's region";
            return false;
        }
        if (!c.remote_write) {
            status = kRemoteAccess;
            why = "CUDA IPC: the peer's region takes no remote writes";
            return false;
        }
        dst = c.base + c.offset + off;
        return true;
    }

    static bool process_gone(int pid) { return pid > 0 && kill(pid, 0) == -1 && errno == ESRCH; }

    // Before a copy (under the engine's progress lock). The process check (a system call) runs
    // at most every kAliveCheckNs per peer: a copy into a dead process's memory lands in memory
    // this process's mapping keeps alive, and poll checks again before it reports the write or
    // sends its imm, so a loss is never reported as a success.
    bool alive(Peer& p, int32_t& status, std::string& why) {
        if (p.table->closed.load(std::memory_order_acquire)) {
            status = kPeerUnreachable;
            why = "CUDA IPC: the peer closed its engine";
            return false;
        }
        if (p.same_process) return true;
        int64_t now = coarse_now_ns();
        if (now - p.alive_checked < kAliveCheckNs) return true;
        p.alive_checked = now;
        if (process_gone(int(p.table->pid))) {
            status = kPeerUnreachable;
            why = "CUDA IPC: the peer's process (pid " + std::to_string(p.table->pid) + ") is gone";
            return false;
        }
        return true;
    }

    bool map(Peer& p, int32_t& status, std::string& why) {
        int fd = shm_open(p.table_name.c_str(), O_RDONLY, 0);
        if (fd < 0) {
            status = kPeerUnreachable;
            why = "CUDA IPC: the peer's handle table " + p.table_name + " is gone: " + std::strerror(errno);
            return false;
        }
        struct stat st{};
        void* m = fstat(fd, &st) == 0 && size_t(st.st_size) >= sizeof(Table)
                      ? mmap(nullptr, sizeof(Table), PROT_READ, MAP_SHARED, fd, 0)
                      : MAP_FAILED;
        ::close(fd);
        const Table* t = static_cast<const Table*>(m);
        if (m == MAP_FAILED || t->magic != kTableMagic) {
            if (m != MAP_FAILED) munmap(m, sizeof(Table));
            status = kPeerUnreachable;
            why = "CUDA IPC: the peer's handle table " + p.table_name + " is not one";
            return false;
        }
        p.table = t;
        p.same_process = t->pid == uint64_t(getpid());
        auto lane = std::make_unique<inbox::Sender>();
        std::string no_lane;  // without one, this peer's imms take the doorbell
        if (lane->open(inbox::inbox_name(p.table_name), Inner::address(), no_lane)) p.lane = std::move(lane);
        return true;
    }

    void unmap(Peer& p) {
        p.lane.reset();  // given back: the peer drains it and frees it
        for (auto& [k, c] : p.keys) forget(c);
        p.keys.clear();
        if (p.table) munmap(const_cast<Table*>(p.table), sizeof(Table));
        p.table = nullptr;
    }

    // A cached key let go: its allocation's mapping is closed once nothing uses it and no
    // copy is in flight (closing under a copy would fault it).
    void forget(typename Peer::Cached& c) {
        cached_.fetch_sub(1, std::memory_order_relaxed);
        if (c.handle.empty()) return;
        auto it = opened_.find(c.handle);
        if (it == opened_.end() || --it->second.users > 0) return;
        closing_.push_back(it->second.base);
        busy_++;
        opened_.erase(it);
    }

    cuda::CUevent take_event() {
        if (!events_.empty()) {
            cuda::CUevent ev = events_.back();
            events_.pop_back();
            return ev;
        }
        cuda::CUevent ev = nullptr;
        if (cuda::Driver::get().event_create(&ev, cuda::kEventDisableTiming) != 0) return nullptr;
        return ev;
    }

    void later(void* ctx, int32_t status, std::string message) {  // (the engine's progress lock held)
        later_.push_back(Later{ctx, status, std::move(message)});
        busy_++;
    }

    int notify(uint64_t doorbell_addr, uint64_t doorbell_key, uint64_t peer, uint32_t imm, void* ctx) {
        WriteOp n{};
        n.src = &doorbell_;
        n.len = 0;
        n.desc = doorbell_desc_;
        n.peer = peer;
        n.raddr = this->virt_addr() ? doorbell_addr : 0;
        n.rkey = doorbell_key;
        n.has_imm = true;
        n.imm = imm;
        return Inner::post_write(n, ctx);
    }

    // Poll only (the engine's progress lock): next_sweep_ is the poller's.
    bool sweep_due() {
        if (cached_.load(std::memory_order_relaxed) == 0) return false;
        int64_t now = coarse_now_ns();
        if (now < next_sweep_) return false;
        next_sweep_ = now + kSweepNs;
        return true;
    }

    template <class Sink>
    size_t poll_ipc(Sink& sink, bool sweep_now) {
        size_t n = 0;
        std::vector<Later> done;
        std::vector<Notify> retry;
        // per copy: kept between polls (their capacity; a poll runs under the engine's
        // progress lock, never inside another)
        std::vector<Copy>& finished = finished_;
        std::vector<Copy>& imms = imms_;
        std::vector<void*>& delivered = delivered_;
        finished.clear();
        imms.clear();
        delivered.clear();
        std::vector<std::pair<Copy, int>> failed;
        {
            done.swap(later_);
            retry.swap(retry_);
            busy_ -= int64_t(done.size() + retry.size());
            const cuda::Driver& d = cuda::Driver::get();
            if (!inflight_.empty() || !closing_.empty() || !pending_.empty()) {
                ContextScope scope(ctx_);
                while (!marks_.empty()) {
                    Mark m = marks_.front();
                    int q = m.event ? d.event_query(m.event) : 0;
                    if (q == cuda::kNotReady) break;
                    marks_.pop_front();
                    ring_tail_ = m.ring_head;
                    if (m.event) events_.push_back(m.event);
                    busy_ -= int64_t(m.copies);
                    for (size_t i = 0; i < m.copies; i++) {
                        Copy c = inflight_.front();
                        inflight_.pop_front();
                        if (q == 0) {
                            finished.push_back(c);
                        } else {
                            failed.emplace_back(c, q);
                        }
                    }
                }
                // The pending segments go in one launch once the stream has fewer than
                // launches_ahead_ marks of work ahead of them (FABRIC_CUDA_LAUNCHES_AHEAD,
                // default kLaunchesAhead; 0: at every poll), or once there are kMaxLaunch:
                // while the GPU is busy, the next batch grows instead of queueing a launch per
                // poll. Each launch costs the stream a few microseconds (the segment list's
                // copy, the launch) whatever its size, and a busy worker polls every few
                // microseconds: a paged request on two H200s moved 32 KiB pages at about
                // 0.25 us each that way, in launches of a few dozen segments.
                if (!pending_.empty() && (launches_ahead_ == 0 || marks_.size() < launches_ahead_ ||
                                          pending_.size() >= kMaxLaunch))
                    flush_pending();
                if (unmarked_ > 0) {
                    cuda::CUevent ev = take_event();
                    if (ev && d.event_record(ev, stream_) != 0) {
                        events_.push_back(ev);
                        ev = nullptr;
                    }
                    if (!ev) d.stream_synchronize(stream_);  // no event to be had: wait here
                    marks_.push_back(Mark{ev, unmarked_, ring_head_});
                    unmarked_ = 0;
                }
                if (inflight_.empty() && pending_.empty() && !closing_.empty()) {
                    for (auto base : closing_) d.ipc_close_mem_handle(base);
                    busy_ -= int64_t(closing_.size());
                    closing_.clear();
                }
            }
            if (sweep_now) sweep();
        }
        for (auto& l : done) {
            if (l.status == kOk) {
                sink.on_write_done(l.ctx);
            } else {
                sink.on_error(l.ctx, l.status, l.message);
            }
            n++;
        }
        for (auto& [c, q] : failed) {
            sink.on_error(c.ctx, kTransport, "CUDA IPC: the copy failed: " + cuda::Driver::get().error(q));
            n++;
        }
        int checked_pid = -1;  // one liveness check per peer process per poll, not per copy
        bool gone = false;
        for (auto& c : finished) {
            n++;
            if (c.pid != checked_pid) {
                checked_pid = c.pid;
                gone = process_gone(c.pid);
            }
            if (gone) {
                sink.on_error(c.ctx, kPeerUnreachable,
                              "CUDA IPC: the peer's process (pid " + std::to_string(c.pid) + ") is gone");
                continue;
            }
            if (!c.has_imm) {
                sink.on_write_done(c.ctx);
                continue;
            }
            imms.push_back(c);
        }
        if (!imms.empty()) {
            // through the peers' inboxes: one record per run of the same (peer, imm); what no
            // lane takes goes to the doorbell
            {
                for (size_t i = 0; i < imms.size();) {
                    size_t j = i + 1;
                    uint64_t total = imms[i].count;
                    while (j < imms.size() && imms[j].peer == imms[i].peer && imms[j].imm == imms[i].imm &&
                           total + imms[j].count <= 0xffffffffu)
                        total += imms[j++].count;
                    auto it = peers_.find(imms[i].peer);
                    bool took = it != peers_.end() && it->second.lane &&
                                it->second.lane->push(imms[i].imm, uint32_t(total));
                    for (size_t k = i; k < j; k++) {
                        const Copy& c = imms[k];
                        if (took) {
                            delivered.push_back(c.ctx);
                        } else if (c.count == 1) {
                            retry.push_back(Notify{c.ctx, c.peer, c.doorbell_addr, c.doorbell_key, c.imm});
                        } else {  // a list's: its count of doorbell writes, reported as one
                            doorbells_.push_back(std::make_unique<Doorbells>(Doorbells{
                                c.ctx, c.peer, c.doorbell_addr, c.doorbell_key, c.imm, c.count, 0, kOk, {}}));
                            busy_++;
                        }
                    }
                    i = j;
                }
            }
            for (void* ctx : delivered) sink.on_write_done(ctx);
        }
        if (!doorbells_.empty()) post_doorbells();
        for (auto& r : retry) {
            int rc = notify(r.doorbell_addr, r.doorbell_key, r.peer, r.imm, r.ctx);
            if (rc == -EAGAIN) {
                retry_.push_back(r);
                busy_++;
            } else if (rc != 0) {
                bool peer = rc == -EHOSTUNREACH || rc == -ECONNREFUSED || rc == -ENOTCONN || rc == -ECONNRESET;
                sink.on_error(r.ctx, peer ? kPeerUnreachable : kTransport,
                              "CUDA IPC: delivering the imm: " + std::string(std::strerror(-rc)));
            }
        }
        return n;
    }

    // Launches the copy-list kernel over the pending copies (under the engine's progress lock and
    // ctx_); a batch of fewer than kKernelMinBatch, one the segment ring has no room for, or one
    // whose launch fails is copied a cuMemcpy per segment.
    void flush_pending() {
        const cuda::Driver& d = cuda::Driver::get();
        int copy_error = 0;  // a failed segment of the copy being flushed (its segments are consecutive)
        for (size_t i = 0; i < pending_.size();) {
            size_t n = std::min(pending_.size() - i, kMaxLaunch);
            size_t at = 0;
            int rc = -1;
            if (n >= kKernelMinBatch && reserve(n, at)) {
                Seg* host = ring_host_ + at;
                for (size_t k = 0; k < n; k++) host[k] = pending_[i + k].seg;
                cuda::CUdeviceptr segs = ring_dev_ + at * sizeof(Seg);
                unsigned count = unsigned(n);
                rc = d.memcpy_htod_async(segs, host, n * sizeof(Seg), stream_);
                if (rc == 0) {
                    void* args[] = {&segs, &count};
                    unsigned blocks = unsigned(std::min<size_t>(n, kKernelBlocks));
                    rc = d.launch_kernel(kernel_fn_, blocks, 1, 1, kKernelThreads, 1, 1, 0, stream_, args, nullptr);
                }
            }
            for (size_t k = 0; k < n; k++) {
                Pending& p = pending_[i + k];
                int c = rc == 0 ? 0 : d.memcpy_dtod_async(p.seg.dst, p.seg.src, p.seg.len, stream_);
                if (c != 0 && copy_error == 0) copy_error = c;
                if (!p.last) continue;
                if (copy_error == 0) {
                    inflight_.push_back(p.copy);
                    unmarked_++;
                } else {  // (its busy_ count, taken when it was posted, goes with the later entry)
                    later_.push_back(
                        Later{p.copy.ctx, kTransport, "CUDA IPC: cuMemcpyDtoDAsync: " + d.error(copy_error)});
                }
                copy_error = 0;
            }
            i += n;
        }
        pending_.clear();
    }

    // ``n`` contiguous segments of the ring at ``at``; false when it has no room for them now.
    bool reserve(size_t n, size_t& at) {
        uint64_t used = ring_head_ - ring_tail_;
        size_t pos = size_t(ring_head_ % kRingSegs);
        if (pos + n > kRingSegs) {  // skip the ring's end
            uint64_t skip = kRingSegs - pos;
            if (used + skip + n > kRingSegs) return false;
            ring_head_ += skip;
            used += skip;
            pos = 0;
        }
        if (used + n > kRingSegs) return false;
        at = pos;
        ring_head_ += n;
        return true;
    }

    // This domain's inbox: every record is ``count`` imms from the lane's sender, attributed to
    // the peer handle of the sender's address where this domain knows it (kNoSource otherwise,
    // as a provider reports a source not in its address vector). Poll only.
    template <class Sink>
    size_t drain_inbox(Sink& sink) {
        int64_t now = coarse_now_ns();
        bool reap = now >= next_reap_;  // orphaned lanes (their sender's process gone)
        if (reap) next_reap_ = now + kSweepNs;
        uint64_t version = handles_version_.load(std::memory_order_acquire);
        return inbox_.drain(
            [&](uint32_t lane, uint64_t owner, const char* addr, size_t len, uint32_t imm, uint32_t count) {
                LaneSource& ls = lane_sources_[lane];
                if (ls.owner != owner || ls.version != version) {
                    auto it = inner_handles_.find(std::string(addr, len));
                    ls = LaneSource{owner, version, it == inner_handles_.end() ? kNoSource : it->second};
                }
                sink.on_imms(imm, ls.source, count);
            },
            reap);
    }

    // Drops cached keys whose slot changed at the peer (deregistered there).
    void sweep() {
        for (auto& [h, p] : peers_) {
            if (!p.table) continue;
            for (auto it = p.keys.begin(); it != p.keys.end();) {
                const Entry& e = p.table->entries[it->first & 0xffff];
                if (e.seq.load(std::memory_order_acquire) != it->second.seq) {
                    forget(it->second);
                    it = p.keys.erase(it);
                } else {
                    ++it;
                }
            }
        }
    }

    bool ipc_ = false;
    std::string address_;
    cuda::CUcontext ctx_ = nullptr;
    int device_ = 0;
    int ordinal_ = -1;  // the CUDA device index this domain's context is of
    cuda::CUstream stream_ = nullptr;
    // This domain's table (what peers read), its slots and their generations.
    std::string table_name_;
    Table* table_ = nullptr;
    std::mutex table_mu_;
    struct Other {  // another device's primary context, retained to export its memory
        cuda::CUcontext ctx;
        int dev;
    };
    std::unordered_map<int, Other> others_;  // (table_mu_)
    std::vector<uint32_t> free_slots_;
    std::vector<uint32_t> gens_;
    // The doorbell: the host bytes every imm of a CUDA IPC write is written to (zero bytes).
    alignas(64) char doorbell_[64] = {};
    typename Inner::Mr doorbell_mr_{};
    void* doorbell_desc_ = nullptr;
    uint64_t doorbell_key_ = 0;
    bool has_doorbell_ = false;
    // The initiator's side: peers, opened allocations, copies in flight, completions due.
    // Touched by insert_peer, remove_peer, post_write and poll only, which the engine calls
    // one at a time, under its progress lock (engine.hpp, "A Domain provides"): no lock of
    // its own. It had one, taken per work request: 9% of a busy worker's time in a paged
    // KvCache request (40,960 copies) on an H200 host.
    std::unordered_map<uint64_t, Peer> peers_;
    std::unordered_map<std::string, Opened> opened_;
    std::vector<cuda::CUdeviceptr> closing_;
    std::deque<Copy> inflight_;  // in stream order; the first ones covered by marks_
    std::vector<Copy> finished_, imms_;  // poll_ipc's scratch
    std::vector<uint64_t> list_dst_;     // post_write_list's scratch
    std::vector<std::unique_ptr<Doorbells>> doorbells_;  // lists' imms going by doorbell
    std::vector<void*> delivered_;
    std::deque<Mark> marks_;
    size_t unmarked_ = 0;        // copies at the back of inflight_ no mark covers yet
    std::vector<cuda::CUevent> events_;
    std::vector<Later> later_;
    std::vector<Notify> retry_;
    std::atomic<size_t> cached_{0};
    int64_t next_sweep_ = 0;
    // The copy-list kernel (as above): its module, the pinned and device segment rings (ring_head_
    // and ring_tail_ count segments handed out and freed), the copies waiting for a launch.
    cuda::CUmodule module_ = nullptr;
    cuda::CUfunction kernel_fn_ = nullptr;
    Seg* ring_host_ = nullptr;
    cuda::CUdeviceptr ring_dev_ = 0;
    uint64_t ring_head_ = 0, ring_tail_ = 0;
    uint64_t kernel_max_ = kKernelMaxBytes;  // copies below this size go through the kernel
    size_t launches_ahead_ = kLaunchesAhead;  // FABRIC_CUDA_LAUNCHES_AHEAD
    std::vector<Pending> pending_;
    std::string kernel_why_;
    // The imm inbox: this domain's (drained by poll), and the peer handles of the inner
    // addresses inserted (as above), by which its senders are attributed.
    inbox::Receiver inbox_;
    std::string inbox_why_;
    std::unordered_map<std::string, uint64_t> inner_handles_;
    std::atomic<uint64_t> handles_version_{0};
    struct LaneSource {
        uint64_t owner = 0, version = ~uint64_t(0), source = kNoSource;
    };
    LaneSource lane_sources_[inbox::kLanes];
    int64_t next_reap_ = 0;
    // Anything for poll_ipc to do (copies, completions, retries, mappings to close, cached keys).
    int64_t busy_ = 0;
};

}  // namespace fabric::cuda_ipc
