// CudaIpcDomain<Inner>: CUDA memory between the processes of one host, over CUDA IPC (NVLink
// or the GPU's own copy engines), added to any Domain of the engine core (fabric/engine.hpp).
//
// The inner domain (libfabric's shm provider, say) keeps carrying everything it carries: host
// memory, control messages, and every imm. What it cannot carry (a libfabric built without
// CUDA refuses FI_HMEM_CUDA registrations) is CUDA memory; this layer carries it:
//
// - Registering CUDA memory exports the allocation's IPC handle (cuIpcGetMemHandle) into this
//   domain's handle table, a small POSIX shared-memory file named in the domain's address. The
//   key handed out (kIpcKeyBit set) names the table slot and the slot's generation. The
//   descriptor format is the engine's as ever: a key per NIC.
// - A write to such a key looks the key up in the peer's table (mapped read-only on first
//   use, entries read under a sequence lock and cached until the slot changes), opens the
//   allocation's handle once (cached; a peer in this same process is written directly), checks
//   the range, and copies (cuMemcpyDtoDAsync / HtoD) on this domain's own non-blocking
//   stream. Nothing of the caller's streams waits on it, or it on them. The next poll records
//   one event for every copy queued since: a driver call per copy, not three.
// - poll() finds the finished copies (events, in order: one stream) and only then delivers the
//   imm: a zero-length write-with-imm through the inner domain to the peer's doorbell (a tiny
//   host region registered at open and named in the address). The imm is counted by the
//   peer's counter table like any other, and it arrives after the bytes are in place: the
//   contract's "imm implies data". A write without imm completes when its copy has.
// - Errors are the contract's: an unknown or stale key, a range outside the region or a
//   region without remote write is kRemoteAccess; a peer whose table is gone is
//   kPeerUnreachable; a failed copy is kTransport. All are reported through poll, as the
//   inner domain reports its own.
// - A peer whose process is gone, or whose engine closed, is kPeerUnreachable, checked before
//   each copy and again before its imm is sent: the provider would take a write into a dead
//   process's shared memory and complete it (shm does), and the copy itself lands in memory
//   this process keeps alive by its IPC mapping, so neither would say so.
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
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fabric/cuda.hpp>
#include <fabric/engine.hpp>

namespace fabric::cuda_ipc {

constexpr uint64_t kIpcKeyBit = uint64_t(1) << 62;
constexpr uint32_t kSlots = 4096;
constexpr uint64_t kTableMagic = 0x3143504943424146ULL;  // "FABCIPC1"
constexpr uint64_t kDoorbellKey = uint64_t(1) << 47;    // apart from user and local keys
constexpr int64_t kSweepNs = 100'000'000;
constexpr char kTrailerMagic[8] = {'F', 'A', 'B', 'R', 'I', 'P', 'C', '1'};
constexpr size_t kNameBytes = 32;
// Appended to the inner address: doorbell address, doorbell key, table name, inner length,
// magic. A peer without it (no CUDA IPC there) is reached through the inner domain only.
constexpr size_t kTrailerBytes = 8 + 8 + kNameBytes + 2 + sizeof(kTrailerMagic);

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

// Removes the tables of processes that died without closing (kill -9): /dev/shm/fabric-ipc-<pid>-*.
inline void remove_orphan_tables() {
    DIR* dir = opendir("/dev/shm");
    if (!dir) return;
    while (dirent* e = readdir(dir)) {
        int pid = 0;
        if (std::sscanf(e->d_name, "fabric-ipc-%d-", &pid) != 1 || pid <= 0) continue;
        if (kill(pid, 0) == -1 && errno == ESRCH) shm_unlink((std::string("/") + e->d_name).c_str());
    }
    closedir(dir);
}

template <class Inner>
class CudaIpcDomain : public Inner {
  public:
    struct Region {
        typename Inner::Mr inner{};
        void* inner_desc = nullptr;
        int slot = -1;  // >= 0: CUDA memory in this domain's table
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
    const std::string& address() const { return address_; }

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
            std::lock_guard<std::mutex> lock(mu_);
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
        std::lock_guard<std::mutex> lock(mu_);
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

    int post_write(const WriteOp& w, void* ctx) {
        if (!ipc_) return Inner::post_write(w, ctx);
        const Region* src = static_cast<const Region*>(w.desc);
        if (!(w.rkey & kIpcKeyBit)) {
            if (src && src->slot >= 0 && w.len) {
                std::lock_guard<std::mutex> lock(mu_);
                later(ctx, kRemoteAccess,
                      "CUDA IPC: a CUDA source is written only into the peer's CUDA memory (this key is "
                      "host memory there)");
                return 0;
            }
            WriteOp x = w;
            x.desc = src ? src->inner_desc : nullptr;
            return Inner::post_write(x, ctx);
        }
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peers_.find(w.peer);
        if (it == peers_.end()) {
            later(ctx, kRemoteAccess, "CUDA IPC: this key names CUDA memory, and the peer's address has no CUDA IPC");
            return 0;
        }
        Peer& p = it->second;
        int32_t status = kOk;
        std::string why;
        if (!((p.table || map(p, status, why)) && alive(p, status, why))) {
            later(ctx, status, why);
            return 0;
        }
        if (w.len == 0) {
            if (!w.has_imm) {
                later(ctx, kOk, std::string());
                return 0;
            }
            return notify(p.doorbell_addr, p.doorbell_key, w.peer, w.imm, ctx);
        }
        uint64_t dst = 0;
        if (!target_of(p, w.rkey, w.raddr, w.len, dst, status, why)) {
            later(ctx, status, why);
            return 0;
        }
        const cuda::Driver& d = cuda::Driver::get();
        ContextScope scope(ctx_);
        auto from = reinterpret_cast<cuda::CUdeviceptr>(w.src);
        int rc;
        if (src && src->slot >= 0 && d.memcpy_dtod_async) {
            rc = d.memcpy_dtod_async(dst, from, w.len, stream_);
        } else if (src && src->slot < 0 && d.memcpy_htod_async) {
            rc = d.memcpy_htod_async(dst, w.src, w.len, stream_);
        } else {
            rc = d.memcpy_async(dst, from, w.len, stream_);
        }
        if (rc != 0) {
            later(ctx, kTransport, "CUDA IPC: cuMemcpyAsync: " + d.error(rc));
            return 0;
        }
        // No event per copy: the next poll records one for every copy queued since (one
        // stream: when it completes, they all have).
        inflight_.push_back(Copy{ctx, w.peer, p.doorbell_addr, p.doorbell_key, w.imm, w.has_imm,
                                 p.same_process ? 0 : int(p.table->pid)});
        unmarked_++;
        busy_.fetch_add(1, std::memory_order_release);
        return 0;
    }

    template <class Sink>
    size_t poll(Sink& sink) {
        size_t n = Inner::poll(sink);
        if (!ipc_) return n;
        bool sweep = sweep_due();
        if (busy_.load(std::memory_order_acquire) == 0 && !sweep) return n;
        return n + poll_ipc(sink, sweep);
    }

  private:
    struct Peer {
        uint64_t doorbell_addr = 0;
        uint64_t doorbell_key = 0;
        std::string table_name;
        const Table* table = nullptr;  // mapped on first use
        bool same_process = false;
        struct Cached {
            uint64_t seq, va, len, offset;  // offset: of va in its allocation
            uint64_t base;                  // where the allocation starts in this process
            bool remote_write;
            std::string handle;  // "" for a peer in this process
        };
        std::unordered_map<uint64_t, Cached> keys;
    };
    struct Copy {
        void* ctx;
        uint64_t peer, doorbell_addr, doorbell_key;
        uint32_t imm;
        bool has_imm;
        int pid;  // the peer's process (0: this one)
    };
    struct Mark {  // an event recorded after the copies before it
        cuda::CUevent event;  // null: the stream was synchronized instead (no event to be had)
        size_t copies;
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
    struct Opened {
        cuda::CUdeviceptr base = 0;
        size_t users = 0;
    };

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
        {
            ContextScope scope(ctx_);
            check(d.stream_create(&stream_, cuda::kStreamNonBlocking), "cuStreamCreate");
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
        ipc_ = true;
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
                d.stream_destroy(stream_);
            }
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
        if (has_doorbell_) Inner::deregister_memory(doorbell_mr_);
        has_doorbell_ = false;
        if (table_) {
            table_->closed.store(1, std::memory_order_release);
            munmap(table_, sizeof(Table));
        }
        table_ = nullptr;
        if (!table_name_.empty()) shm_unlink(table_name_.c_str());
        table_name_.clear();
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
        ContextScope scope(ctx_);
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

    // Where [raddr, raddr+len) of the peer's region ``rkey`` is in this process (mu_ held).
    bool target_of(Peer& p, uint64_t rkey, uint64_t raddr, uint64_t len, uint64_t& dst, int32_t& status,
                   std::string& why) {
        if (!p.table && !map(p, status, why)) return false;
        uint32_t slot = uint32_t(rkey & 0xffff);
        if (slot >= kSlots) {
            status = kRemoteAccess;
            why = "CUDA IPC: no such key at the peer";
            return false;
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
                    return false;
                }
            }
            if (snap.key != rkey) {
                status = kRemoteAccess;
                why = "CUDA IPC: no such key at the peer (deregistered?)";
                return false;
            }
            typename Peer::Cached c{seq, snap.va, snap.len, snap.offset, 0, snap.remote_write != 0, std::string()};
            if (p.same_process) {
                c.base = snap.va - snap.offset;
            } else {
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
                        return false;
                    }
                }
                o.users++;
                c.base = o.base;
            }
            it = p.keys.emplace(rkey, std::move(c)).first;
            cached_.fetch_add(1, std::memory_order_relaxed);
        }
        const auto& c = it->second;
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

    bool alive(const Peer& p, int32_t& status, std::string& why) {
        if (p.table->closed.load(std::memory_order_acquire)) {
            status = kPeerUnreachable;
            why = "CUDA IPC: the peer closed its engine";
            return false;
        }
        if (!p.same_process && process_gone(int(p.table->pid))) {
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
        return true;
    }

    void unmap(Peer& p) {
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
        busy_.fetch_add(1, std::memory_order_release);
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

    void later(void* ctx, int32_t status, std::string message) {  // mu_ held
        later_.push_back(Later{ctx, status, std::move(message)});
        busy_.fetch_add(1, std::memory_order_release);
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
        int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
        if (now < next_sweep_) return false;
        next_sweep_ = now + kSweepNs;
        return true;
    }

    template <class Sink>
    size_t poll_ipc(Sink& sink, bool sweep_now) {
        size_t n = 0;
        std::vector<Later> done;
        std::vector<Notify> retry;
        std::vector<Copy> finished;
        std::vector<std::pair<Copy, int>> failed;
        {
            std::lock_guard<std::mutex> lock(mu_);
            done.swap(later_);
            retry.swap(retry_);
            busy_.fetch_sub(done.size() + retry.size(), std::memory_order_release);
            const cuda::Driver& d = cuda::Driver::get();
            if (!inflight_.empty() || !closing_.empty()) {
                ContextScope scope(ctx_);
                if (unmarked_ > 0) {
                    cuda::CUevent ev = take_event();
                    if (ev && d.event_record(ev, stream_) != 0) {
                        events_.push_back(ev);
                        ev = nullptr;
                    }
                    if (!ev) d.stream_synchronize(stream_);  // no event to be had: wait here
                    marks_.push_back(Mark{ev, unmarked_});
                    unmarked_ = 0;
                }
                while (!marks_.empty()) {
                    Mark m = marks_.front();
                    int q = m.event ? d.event_query(m.event) : 0;
                    if (q == cuda::kNotReady) break;
                    marks_.pop_front();
                    if (m.event) events_.push_back(m.event);
                    for (size_t i = 0; i < m.copies; i++) {
                        Copy c = inflight_.front();
                        inflight_.pop_front();
                        busy_.fetch_sub(1, std::memory_order_release);
                        if (q == 0) {
                            finished.push_back(c);
                        } else {
                            failed.emplace_back(c, q);
                        }
                    }
                }
                if (inflight_.empty() && !closing_.empty()) {
                    for (auto base : closing_) d.ipc_close_mem_handle(base);
                    busy_.fetch_sub(closing_.size(), std::memory_order_release);
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
            retry.push_back(Notify{c.ctx, c.peer, c.doorbell_addr, c.doorbell_key, c.imm});
        }
        for (auto& r : retry) {
            int rc = notify(r.doorbell_addr, r.doorbell_key, r.peer, r.imm, r.ctx);
            if (rc == -EAGAIN) {
                std::lock_guard<std::mutex> lock(mu_);
                retry_.push_back(r);
                busy_.fetch_add(1, std::memory_order_release);
            } else if (rc != 0) {
                bool peer = rc == -EHOSTUNREACH || rc == -ECONNREFUSED || rc == -ENOTCONN || rc == -ECONNRESET;
                sink.on_error(r.ctx, peer ? kPeerUnreachable : kTransport,
                              "CUDA IPC: delivering the imm: " + std::string(std::strerror(-rc)));
            }
        }
        return n;
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
    cuda::CUstream stream_ = nullptr;
    // This domain's table (what peers read), its slots and their generations.
    std::string table_name_;
    Table* table_ = nullptr;
    std::mutex table_mu_;
    std::vector<uint32_t> free_slots_;
    std::vector<uint32_t> gens_;
    // The doorbell: the host bytes every imm of a CUDA IPC write is written to (zero bytes).
    alignas(64) char doorbell_[64] = {};
    typename Inner::Mr doorbell_mr_{};
    void* doorbell_desc_ = nullptr;
    uint64_t doorbell_key_ = 0;
    bool has_doorbell_ = false;
    // The initiator's side (mu_): peers, opened allocations, copies in flight, completions due.
    std::mutex mu_;
    std::unordered_map<uint64_t, Peer> peers_;
    std::unordered_map<std::string, Opened> opened_;
    std::vector<cuda::CUdeviceptr> closing_;
    std::deque<Copy> inflight_;  // in stream order; the first ones covered by marks_
    std::deque<Mark> marks_;
    size_t unmarked_ = 0;        // copies at the back of inflight_ no mark covers yet
    std::vector<cuda::CUevent> events_;
    std::vector<Later> later_;
    std::vector<Notify> retry_;
    std::atomic<size_t> cached_{0};
    int64_t next_sweep_ = 0;
    // Anything for poll_ipc to do (copies, completions, retries, mappings to close, cached keys).
    std::atomic<int64_t> busy_{0};
};

}  // namespace fabric::cuda_ipc
