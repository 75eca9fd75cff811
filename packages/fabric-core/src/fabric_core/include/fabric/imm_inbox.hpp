// ImmInbox: imms between the processes of one host through shared memory, with no provider
// in between. The CUDA IPC domain (fabric/cuda_ipc.hpp) delivers the imms of its copies this
// way: one record per (imm, count) instead of one provider write per work request.
//
// A target owns one inbox, a POSIX shared-memory file named after its CUDA IPC handle table
// (the table's name + "-in"), made at open and unlinked at close. It holds kLanes lanes; a
// lane is a single-producer single-consumer ring of (imm, count) records that one sender
// claims for itself (an atomic owner tag: the sender's pid and a nonce) and writes its own
// inner address into, so that the target can attribute what it counts (the engine's NIC-loss
// reconciliation needs the source, as FI_SOURCE gives it for provider writes).
//
// - push: the sender writes the record and then publishes the lane's tail (release); a full
//   lane refuses (the caller falls back to the provider's doorbell).
// - drain: the target reads each claimed lane's tail (acquire), hands every record over,
//   and publishes the head. Only the target writes head; only the owner writes tail.
// - A lane is given back by its sender (release(), at unmap or close) or found orphaned (its
//   owner's process is gone). Either way the target drains what is left first and only then
//   frees it, so no imm a sender was told is delivered is ever dropped.
// - A sender that dies mid-push leaves at most an unpublished record: the tail is published
//   after the record, so nothing half-written is ever read. Lanes are per sender, so a dead
//   sender can stall nobody else.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>

namespace fabric::inbox {

constexpr uint64_t kInboxMagic = 0x31584e4942414246ULL;  // "FABINBX1"
constexpr uint32_t kLanes = 64;
constexpr uint32_t kLaneRecords = 1024;  // a power of two
constexpr size_t kAddrBytes = 240;

struct Record {
    uint32_t imm;
    uint32_t count;
};

struct alignas(64) Lane {
    std::atomic<uint64_t> owner;     // 0: free; else the sender's tag (pid << 32 | nonce)
    std::atomic<uint64_t> ready;     // the owner's tag once addr is written
    std::atomic<uint64_t> released;  // the owner's tag once it let go (the target frees it)
    uint64_t addr_len;
    char addr[kAddrBytes];           // the sender's inner address (attribution)
    alignas(64) std::atomic<uint64_t> tail;  // written by the sender only
    alignas(64) std::atomic<uint64_t> head;  // written by the target only
    alignas(64) Record records[kLaneRecords];
};

struct Inbox {
    uint64_t magic;
    uint64_t pid;
    std::atomic<uint32_t> hwm;  // lanes ever claimed: the target scans [0, hwm)
    uint32_t pad0;
    uint64_t pad[12];
    Lane lanes[kLanes];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the inbox is shared between processes");

inline bool process_gone(uint64_t pid) { return pid > 0 && kill(pid_t(pid), 0) == -1 && errno == ESRCH; }

inline std::string inbox_name(const std::string& table_name) { return table_name + "-in"; }

// The target's side.
class Receiver {
  public:
    Receiver() = default;
    Receiver(const Receiver&) = delete;
    Receiver& operator=(const Receiver&) = delete;
    ~Receiver() { close(); }

    // Makes the inbox; false (and ``why``) where shared memory cannot be had.
    bool open(const std::string& name, std::string& why) {
        int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) {
            why = "shm_open(" + name + "): " + std::strerror(errno);
            return false;
        }
        bool sized = ftruncate(fd, sizeof(Inbox)) == 0;
        void* m = sized ? mmap(nullptr, sizeof(Inbox), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
        int err = errno;
        ::close(fd);
        if (m == MAP_FAILED) {
            shm_unlink(name.c_str());
            why = "the imm inbox: " + std::string(std::strerror(err));
            return false;
        }
        name_ = name;
        box_ = static_cast<Inbox*>(m);  // a fresh file is zeros: every lane free
        box_->pid = uint64_t(getpid());
        box_->hwm.store(0, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        box_->magic = kInboxMagic;
        return true;
    }

    void close() {
        if (box_) munmap(box_, sizeof(Inbox));
        box_ = nullptr;
        if (!name_.empty()) shm_unlink(name_.c_str());
        name_.clear();
    }

    bool is_open() const { return box_ != nullptr; }

    // Hands every published record to fn(lane, owner_tag, addr, imm, count) and returns how
    // many records it took. Lanes given back, or whose sender's process is gone (checked when
    // ``reap``), are freed once drained.
    template <class Fn>
    size_t drain(Fn&& fn, bool reap = false) {
        if (!box_) return 0;
        size_t n = 0;
        uint32_t hwm = box_->hwm.load(std::memory_order_acquire);
        for (uint32_t i = 0; i < hwm && i < kLanes; i++) {
            Lane& l = box_->lanes[i];
            uint64_t owner = l.owner.load(std::memory_order_acquire);
            if (owner == 0 || l.ready.load(std::memory_order_acquire) != owner) continue;
            // whether the owner let go (or is gone) is read before the tail: a sender publishes
            // its last records before it lets go, so a lane drained here is then empty for good
            bool let_go = l.released.load(std::memory_order_acquire) == owner ||
                          (reap && process_gone(owner >> 32));
            uint64_t head = l.head.load(std::memory_order_relaxed);
            uint64_t tail = l.tail.load(std::memory_order_acquire);
            for (uint64_t k = head; k != tail; k++) {
                const Record& r = l.records[k & (kLaneRecords - 1)];
                fn(i, owner, l.addr, size_t(l.addr_len), r.imm, r.count);
                n++;
            }
            if (tail != head) l.head.store(tail, std::memory_order_release);
            if (!let_go) continue;
            // free the lane for another sender
            l.ready.store(0, std::memory_order_relaxed);
            l.released.store(0, std::memory_order_relaxed);
            l.tail.store(0, std::memory_order_relaxed);
            l.head.store(0, std::memory_order_relaxed);
            l.owner.store(0, std::memory_order_release);
        }
        return n;
    }

  private:
    std::string name_;
    Inbox* box_ = nullptr;
};

// A sender's lane in one target's inbox.
class Sender {
  public:
    Sender() = default;
    Sender(const Sender&) = delete;
    Sender& operator=(const Sender&) = delete;
    ~Sender() { close(); }

    // Maps the target's inbox and claims a lane, writing ``addr`` into it; false (and ``why``)
    // where there is no inbox or no free lane: the caller then uses its other path.
    bool open(const std::string& name, const std::string& addr, std::string& why) {
        if (addr.size() > kAddrBytes) {
            why = "the sender's address is too long for an inbox lane";
            return false;
        }
        int fd = shm_open(name.c_str(), O_RDWR, 0);
        if (fd < 0) {
            why = "shm_open(" + name + "): " + std::strerror(errno);
            return false;
        }
        struct stat st{};
        void* m = fstat(fd, &st) == 0 && size_t(st.st_size) >= sizeof(Inbox)
                      ? mmap(nullptr, sizeof(Inbox), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                      : MAP_FAILED;
        ::close(fd);
        if (m == MAP_FAILED) {
            why = "the target's inbox " + name + " cannot be mapped";
            return false;
        }
        box_ = static_cast<Inbox*>(m);
        if (box_->magic != kInboxMagic) {
            close();
            why = "the target's inbox " + name + " is not one";
            return false;
        }
        std::random_device rd;
        tag_ = (uint64_t(uint32_t(getpid())) << 32) | (uint64_t(rd()) | 1);
        for (uint32_t i = 0; i < kLanes; i++) {
            uint64_t free = 0;
            Lane& l = box_->lanes[i];
            if (!l.owner.compare_exchange_strong(free, tag_, std::memory_order_acq_rel)) continue;
            lane_ = &l;
            tail_ = l.tail.load(std::memory_order_relaxed);
            std::memcpy(l.addr, addr.data(), addr.size());
            l.addr_len = addr.size();
            l.ready.store(tag_, std::memory_order_release);
            uint32_t hwm = box_->hwm.load(std::memory_order_relaxed);
            while (hwm < i + 1 && !box_->hwm.compare_exchange_weak(hwm, i + 1, std::memory_order_release)) {
            }
            return true;
        }
        close();
        why = "all " + std::to_string(kLanes) + " lanes of the target's inbox are taken";
        return false;
    }

    // Publishes (imm, count); false when the lane is full (nothing written).
    bool push(uint32_t imm, uint32_t count) {
        if (!lane_) return false;
        uint64_t head = lane_->head.load(std::memory_order_acquire);
        if (tail_ - head >= kLaneRecords) return false;
        lane_->records[tail_ & (kLaneRecords - 1)] = Record{imm, count};
        lane_->tail.store(++tail_, std::memory_order_release);
        return true;
    }

    bool is_open() const { return lane_ != nullptr; }

    // Lets go of the lane (the target frees it once drained) and unmaps the inbox.
    void close() {
        if (lane_) lane_->released.store(tag_, std::memory_order_release);
        lane_ = nullptr;
        if (box_) munmap(box_, sizeof(Inbox));
        box_ = nullptr;
    }

  private:
    Inbox* box_ = nullptr;
    Lane* lane_ = nullptr;
    uint64_t tag_ = 0;
    uint64_t tail_ = 0;
};

}  // namespace fabric::inbox
