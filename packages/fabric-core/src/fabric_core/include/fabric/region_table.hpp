// Which writes a target takes, and a table of it that writers on the same host read before
// they post.
//
// refusal_text() is the one place that decides whether a target refuses a write (no region
// under the key, a region without remote write, a range outside the region) and says so. The
// engine uses it for the answer to an access check (Engine::got_access_answer, tcp), and the
// shm domain for the table below.
//
// RegionTable. libfabric 1.17's shm provider never completes a write the target refuses
// (a forged or stale key, a range outside the region, a region without remote write), and
// since its completions come back through one response queue per endpoint, read in order,
// no later write or send of the writer's endpoint completes either, to any peer. So on shm
// the writer must not post such a write at all. Writer and target share a host there, so
// each shm endpoint publishes its registrations in a small table of shared memory
// (/dev/shm/fabric-acl.<endpoint name>), which a writer maps when it first meets the
// endpoint and reads before each write: a write the target would refuse fails at the writer
// with kRemoteAccess and is never posted.
//
// Revocation is fenced. A writer takes a hold on the table entry before it reads it, and
// keeps it until its write has completed (delivery-complete: the target has processed it);
// deregistration clears the entry, then waits until no hold is left (at most kHoldWait: a
// writer killed while holding one leaves it behind), and only then closes the provider's
// registration. Both sides use sequentially consistent operations, so either the writer's
// hold is seen by the deregistering thread, which then waits for the write, or the writer
// sees the entry cleared and does not post. Without this a write checked just before the
// deregistration could reach the target just after it, and wedge the writer.
//
// Each entry is a seqlock (odd sequence: being written) of 64 bytes. Keys index the table
// (with linear probing over kProbe slots); a registration that finds no free slot (or has
// the key 0, which marks a free slot) sets the table's ``overflow`` flag, after which a writer that does not find a key posts the write
// unchecked (as before the table) rather than refusing a key the target holds.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace fabric {

inline std::string span_text(uint64_t at, uint64_t len) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "[%#llx, +%llu)", static_cast<unsigned long long>(at),
                  static_cast<unsigned long long>(len));
    return buf;
}

// Why a target with (known, writable, [base, base + rlen)) under ``key`` on its NIC ``nic``
// refuses a write of ``len`` bytes at ``raddr`` (addressed as writes address it), or "" if it
// takes it.
inline bool refuses(bool known, bool writable, uint64_t base, uint64_t rlen, uint64_t raddr, uint64_t len) {
    return !known || !writable || raddr < base || len > rlen || raddr - base > rlen - len;
}
inline std::string refusal_text(bool known, bool writable, uint64_t base, uint64_t rlen, uint64_t raddr,
                                uint64_t len, uint64_t key, uint32_t nic) {
    if (!refuses(known, writable, base, rlen, raddr, len)) return std::string();
    char k[24];
    std::snprintf(k, sizeof(k), "%#llx", static_cast<unsigned long long>(key));
    std::string where = " (key " + std::string(k) + " on its NIC " + std::to_string(nic) + ")";
    if (!known)
        return "the target refused the write: it has no region under that key" + where +
               " (never issued, or deregistered since)";
    if (!writable) return "the target refused the write: its region is registered without remote write" + where;
    if (raddr < base || len > rlen || raddr - base > rlen - len)
        return "the target refused the write: " + span_text(raddr, len) + " is outside its region " +
               span_text(base, rlen) + where;
    return std::string();
}

namespace region_table {

constexpr uint64_t kMagic = 0x3130'6c63'6162'6166ULL;  // "fabacl01"
constexpr uint32_t kSlots = 1u << 14;                   // live registrations per endpoint, about
constexpr uint32_t kProbe = 16;
constexpr auto kHoldWait = std::chrono::seconds(1);

struct alignas(64) Slot {
    std::atomic<uint64_t> seq;  // odd: being written
    std::atomic<uint64_t> key;  // 0: free
    std::atomic<uint64_t> base;
    std::atomic<uint64_t> len;
    std::atomic<uint64_t> writable;
    std::atomic<int64_t> holds;  // writers between their check and their write's completion
};

struct alignas(64) Header {
    std::atomic<uint64_t> magic;  // written last: a table is read only once it is whole
    uint32_t slots;
    int32_t owner;                 // its process
    std::atomic<uint64_t> overflow;  // a registration found no slot (see above)
};

static_assert(sizeof(Slot) == 64 && sizeof(Header) == 64, "table layout");
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "the table is shared between processes: its atomics must be lock-free");

constexpr size_t kBytes = sizeof(Header) + size_t(kSlots) * sizeof(Slot);

// /dev/shm name of the table of the shm endpoint named ``address`` (fi_getname's bytes):
// "fabric-acl." and the endpoint's name without its "fi_shm://" prefix, or its bytes in hex
// where they hold anything but [A-Za-z0-9:._-].
inline std::string name_for(const std::string& address) {
    std::string a = address.substr(0, address.find('\0'));
    const std::string prefix = "fi_shm://";
    if (a.compare(0, prefix.size(), prefix) == 0) a = a.substr(prefix.size());
    bool plain = !a.empty() && a.size() <= 120;
    for (char c : a)
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == ':' || c == '.' || c == '_' || c == '-')) plain = false;
    if (!plain) {
        static const char* hex = "0123456789abcdef";
        std::string h;
        for (size_t i = 0; i < address.size() && i < 60; i++) {
            h += hex[uint8_t(address[i]) >> 4];
            h += hex[uint8_t(address[i]) & 15];
        }
        a = "x" + h;
    }
    return "/fabric-acl." + a;
}

struct Snapshot {
    uint64_t key, base, len, writable;
};

// A consistent read of a slot; false if none came within a bound (its writer died mid-way).
inline bool read_slot(const Slot& s, Snapshot& out) {
    for (int i = 0; i < 1000; i++) {
        uint64_t a = s.seq.load();
        if (a & 1) {
            std::this_thread::yield();
            continue;
        }
        out.key = s.key.load();
        out.base = s.base.load();
        out.len = s.len.load();
        out.writable = s.writable.load();
        if (s.seq.load() == a) return true;
    }
    return false;
}

inline void write_slot(Slot& s, uint64_t key, uint64_t base, uint64_t len, bool writable) {
    uint64_t a = s.seq.load();
    s.seq.store(a + 1);
    s.key.store(key);
    s.base.store(base);
    s.len.store(len);
    s.writable.store(writable ? 1 : 0);
    s.seq.store(a + 2);
}

// The target's side: its endpoint's table, created with the endpoint and removed with it.
class Owner {
  public:
    explicit Owner(const std::string& address) : name_(name_for(address)) {
        shm_unlink(name_.c_str());  // a dead process's of the same name: mappings of it stay valid
        int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) throw std::runtime_error("creating " + name_ + ": " + std::strerror(errno));
        if (ftruncate(fd, static_cast<off_t>(kBytes)) != 0) {
            int err = errno;
            close(fd);
            shm_unlink(name_.c_str());
            throw std::runtime_error("sizing " + name_ + ": " + std::strerror(err));
        }
        void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
            shm_unlink(name_.c_str());
            throw std::runtime_error("mapping " + name_ + ": " + std::strerror(errno));
        }
        base_ = static_cast<char*>(p);
        header()->slots = kSlots;
        header()->owner = static_cast<int32_t>(getpid());
        header()->magic.store(kMagic);
    }
    ~Owner() {
        munmap(base_, kBytes);
        shm_unlink(name_.c_str());
    }
    Owner(const Owner&) = delete;
    Owner& operator=(const Owner&) = delete;

    const std::string& name() const { return name_; }

    // A registration: from here on, writers through ``key`` are checked against it.
    void add(uint64_t key, uint64_t base, uint64_t len, bool writable) {
        std::lock_guard<std::mutex> lock(mu_);
        for (uint32_t i = 0; i < kProbe && key != 0; i++) {  // (0 marks a free slot: not placed)
            Slot& s = slot((key + i) & (kSlots - 1));
            if (s.key.load() == 0 && s.holds.load() == 0) {  // (holds left by a dead writer: skipped)
                write_slot(s, key, base, len, writable);
                return;
            }
        }
        header()->overflow.store(1);
    }

    // A deregistration, before the provider's registration is closed: from here on no writer
    // posts through ``key``, and the writes that checked it before have completed (or
    // kHoldWait passed). Returns false in that last case.
    bool revoke(uint64_t key) {
        Slot* found = nullptr;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (uint32_t i = 0; i < kProbe && !found; i++) {
                Slot& s = slot((key + i) & (kSlots - 1));
                if (s.key.load() == key) found = &s;
            }
            if (!found) return true;
            write_slot(*found, 0, 0, 0, false);
        }
        auto until = std::chrono::steady_clock::now() + kHoldWait;
        while (found->holds.load() > 0) {
            if (std::chrono::steady_clock::now() >= until) return false;
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        return true;
    }

  private:
    Header* header() { return reinterpret_cast<Header*>(base_); }
    Slot& slot(uint32_t i) { return reinterpret_cast<Slot*>(base_ + sizeof(Header))[i]; }
    std::string name_;
    char* base_ = nullptr;
    std::mutex mu_;
};

// A writer's view of a target endpoint's table.
class View {
  public:
    // Maps the table of the endpoint named ``address``; an empty view (every write posted
    // unchecked) if it has none (a peer of another kind, a table not whole).
    explicit View(const std::string& address) {
        std::string name = name_for(address);
        int fd = shm_open(name.c_str(), O_RDWR, 0);
        if (fd < 0) return;
        struct stat st{};
        if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kBytes) {
            close(fd);
            return;
        }
        void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED) return;
        base_ = static_cast<char*>(p);
        const Header* h = reinterpret_cast<const Header*>(base_);
        if (h->magic.load() != kMagic || h->slots != kSlots) {
            munmap(base_, kBytes);
            base_ = nullptr;
        }
    }
    ~View() {
        if (base_) munmap(base_, kBytes);
    }
    View(const View&) = delete;
    View& operator=(const View&) = delete;

    bool mapped() const { return base_ != nullptr; }

    enum Verdict { kUnchecked, kHeld, kRefused };

    // Before a write of ``len`` bytes at ``raddr`` through ``key``: kHeld (post it; ``hold``
    // is taken, and the caller gives it back with release() once the write completed or was
    // not posted after all), kRefused (``why`` says why; nothing taken), or kUnchecked (the
    // table cannot tell: post it as it is).
    Verdict check(uint64_t key, uint64_t raddr, uint64_t len, uint32_t nic, std::atomic<int64_t>*& hold,
                  std::string& why) {
        hold = nullptr;
        if (!base_) return kUnchecked;
        for (uint32_t i = 0; i < kProbe; i++) {
            Slot& s = slot((key + i) & (kSlots - 1));
            Snapshot snap{};
            if (!read_slot(s, snap)) return kUnchecked;
            if (snap.key != key || key == 0) continue;
            s.holds.fetch_add(1);
            if (!read_slot(s, snap)) {
                s.holds.fetch_sub(1);
                return kUnchecked;
            }
            if (snap.key != key) {  // revoked (or replaced) meanwhile: not this key's any more
                s.holds.fetch_sub(1);
                break;
            }
            if (refuses(true, snap.writable != 0, snap.base, snap.len, raddr, len)) {
                s.holds.fetch_sub(1);
                why = refusal_text(true, snap.writable != 0, snap.base, snap.len, raddr, len, key, nic);
                return kRefused;
            }
            hold = &s.holds;
            return kHeld;
        }
        if (header()->overflow.load()) return kUnchecked;
        why = refusal_text(false, false, 0, 0, raddr, len, key, nic);
        return kRefused;
    }

    static void release(std::atomic<int64_t>* hold) {
        if (hold) hold->fetch_sub(1);
    }

  private:
    Header* header() { return reinterpret_cast<Header*>(base_); }
    Slot& slot(uint32_t i) { return reinterpret_cast<Slot*>(base_ + sizeof(Header))[i]; }
    char* base_ = nullptr;
};

}  // namespace region_table
}  // namespace fabric
