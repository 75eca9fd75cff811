// An in-memory fabric for native tests of the engine core (tsan_engine.cpp, fuzz_frames.cpp):
// FakeNic honours engine.hpp's Domain concept. Writes land synchronously in the target's
// registered memory; completions and arrivals are queued per NIC and reported by poll(). Every
// NIC of the process is in one registry (FakeFabric); a NIC that is gone makes posts to it fail
// like an unreachable peer. FakeFabric::on_send, where set, sees every message sent (the fuzz
// target records frames with it). FakeNic::refuse_sends makes its next sends answer -EAGAIN;
// hold_write_done keeps landed writes unreported until release_writes(); silent_refusals and
// drop_writes fail writes as tcp does (kConnectionDropped, no reason given); posts_to_closed
// counts posts to an address in fabric::ClosedSet, reaped_after_free the write completions
// polled once the target's NIC is gone (on shm: both a use of freed memory).
#pragma once

#include <fabric/engine.hpp>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

namespace fabric_test {

class FakeNic;

struct FakeFabric {
    FakeFabric() = default;
    explicit FakeFabric(bool copying) : copies(copying) {}
    std::mutex mu;
    std::map<std::string, FakeNic*> nics;
    std::function<void(const std::string& to, const std::string& message)> on_send;  // (under mu)
    const bool copies = false;  // its NICs say target_copies(), as shm's do (Engine::run lingers)
    // > 0: its NICs allow eager writes of up to this many bytes (eager_write_max(), as
    // fabric-efa's domain on tcp does); set before the engines open
    size_t eager_max = 0;
};

class FakeNic {
  public:
    FakeNic(FakeFabric& fabric, std::string address) : fabric_(fabric), address_(std::move(address)) {
        std::lock_guard<std::mutex> lock(fabric_.mu);
        fabric_.nics[address_] = this;
    }
    ~FakeNic() {
        std::lock_guard<std::mutex> lock(fabric_.mu);
        fabric_.nics.erase(address_);
    }

    // Registers [base, base + len) for remote writes; returns its key.
    uint64_t register_remote(void* base, size_t len) {
        std::lock_guard<std::mutex> lock(mu_);
        regions_.push_back({reinterpret_cast<uint64_t>(base), len});
        return regions_.size();  // key k: regions_[k - 1]
    }

    std::string address() const { return address_; }
    bool target_copies() const { return fabric_.copies; }
    size_t eager_write_max() const { return fabric_.eager_max; }
    uint64_t insert_peer(const std::string& address) {
        {
            std::lock_guard<std::mutex> lock(fabric_.mu);
            if (!fabric_.nics.count(address)) throw std::runtime_error("no such address");
        }
        std::lock_guard<std::mutex> lock(mu_);
        peers_.push_back(address);
        return peers_.size() - 1;
    }
    void remove_peer(uint64_t peer) {
        std::lock_guard<std::mutex> lock(mu_);
        if (peer < peers_.size()) peers_[peer].clear();
    }
    bool virt_addr() const { return true; }
    bool stale_peers() const { return false; }
    void* local_desc(void*, size_t) { return this; }

    int post_write(const fabric::WriteOp& w, void* ctx) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            last_poster = std::this_thread::get_id();
        }
        if (hang_posts.load()) {  // as a post on shm to a peer killed holding its queue lock
            hanging.fetch_add(1);
            while (hang_posts.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            hanging.fetch_sub(1);
        }
        std::string to = peer_address(w.peer);
        if (to.empty()) return -EHOSTUNREACH;
        if (fabric::ClosedSet::instance().contains(to)) posts_to_closed.fetch_add(1);
        for (int c = write_credits.load(); c >= 0;) {  // a provider queue with room for ``c`` more
            if (c == 0) return -EAGAIN;                 // full
            if (write_credits.compare_exchange_weak(c, c - 1)) break;
        }
        if (record_writes.load()) {
            std::lock_guard<std::mutex> lock(mu_);
            accepted_to_.push_back(to);
        }
        bool landed = false, access = false;
        if (drop_writes.load() > 0) {  // a connection that went (the target lives): not landed
            drop_writes.fetch_sub(1);
            push({Event::kError, ctx, 0, 0, 0, fabric::kConnectionDropped, "Operation canceled (connection reset)"});
            return 0;
        }
        {
            std::lock_guard<std::mutex> reg(fabric_.mu);
            auto it = fabric_.nics.find(to);
            if (it != fabric_.nics.end()) {
                landed = true;
                access = !it->second->deliver_write(w, address_);
            }
        }
        if (!landed) {
            push({Event::kError, ctx, 0, 0, 0, fabric::kPeerUnreachable, "peer gone"});
        } else if (access && silent_refusals.load()) {  // as tcp: the target drops the connection
            push({Event::kError, ctx, 0, 0, 0, fabric::kConnectionDropped, "Operation canceled"});
        } else if (access) {
            push({Event::kError, ctx, 0, 0, 0, fabric::kRemoteAccess, "out of the registered region"});
        } else {
            writes_.fetch_add(1, std::memory_order_relaxed);
            if (hold_write_done.load()) {  // landed, but not reported until release_writes()
                std::lock_guard<std::mutex> lock(mu_);
                held_.push_back({Event::kWriteDone, ctx, 0, 0, 0, 0, {}, to});
            } else {
                push({Event::kWriteDone, ctx, 0, 0, 0, 0, {}, to});
            }
        }
        return 0;
    }

    // A list of ``n`` page writes (engine.hpp's post_write_list, for a key list_rkey names):
    // every page is checked first and a refusal fails them all (nothing lands); the pages land
    // in the order given (list_order() records their destinations, list after list), their imms arrive as one
    // count (on_imms), and the list is reported once.
    int post_write_list(const fabric::WriteOp& w, const uint64_t* src, const uint64_t* dst, size_t n, void* ctx) {
        std::string to = peer_address(w.peer);
        if (to.empty()) return -EHOSTUNREACH;
        lists_posted.fetch_add(1);
        bool landed = false, access = false;
        {
            std::lock_guard<std::mutex> reg(fabric_.mu);
            auto it = fabric_.nics.find(to);
            if (it != fabric_.nics.end()) {
                landed = true;
                access = !it->second->deliver_list(w, src, dst, n, address_);
            }
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            list_order_.insert(list_order_.end(), dst, dst + n);
        }
        if (!landed) {
            push({Event::kError, ctx, 0, 0, 0, fabric::kPeerUnreachable, "peer gone"});
        } else if (access) {
            push({Event::kError, ctx, 0, 0, 0, fabric::kRemoteAccess, "a page out of the registered region"});
        } else {
            writes_.fetch_add(n, std::memory_order_relaxed);
            if (hold_write_done.load()) {  // as a single write's (post_write)
                std::lock_guard<std::mutex> lock(mu_);
                held_.push_back({Event::kWriteDone, ctx, 0, 0, 0, 0, {}, to});
            } else {
                push({Event::kWriteDone, ctx, 0, 0, 0, 0, {}, to});
            }
        }
        return 0;
    }
    size_t list_pages(uint64_t rkey) const { return rkey != 0 && rkey == list_rkey.load() ? fabric::kMaxListPages : 0; }
    std::vector<uint64_t> list_order() {
        std::lock_guard<std::mutex> lock(mu_);
        return list_order_;
    }

    // Reports the writes held while hold_write_done was set; returns how many.
    size_t release_writes() {
        std::lock_guard<std::mutex> lock(mu_);
        size_t n = held_.size();
        for (auto& e : held_) events_.push_back(std::move(e));
        held_.clear();
        return n;
    }

    size_t held_writes() {
        std::lock_guard<std::mutex> lock(mu_);
        return held_.size();
    }

    int post_send(const void* buf, size_t len, void*, uint64_t peer, void* ctx) {
        if (refuse_sends.load() > 0) {  // a queue to the peer full of writes, as shm has it
            refuse_sends.fetch_sub(1);
            return -EAGAIN;
        }
        std::string to = peer_address(peer);
        if (to.empty()) return -EHOSTUNREACH;
        if (fabric::ClosedSet::instance().contains(to)) posts_to_closed.fetch_add(1);
        bool landed = false;
        {
            std::lock_guard<std::mutex> reg(fabric_.mu);
            auto it = fabric_.nics.find(to);
            if (it != fabric_.nics.end()) {
                landed = true;
                std::string m(static_cast<const char*>(buf), len);
                if (fabric_.on_send) fabric_.on_send(to, m);
                it->second->deliver_send(std::move(m));
            }
        }
        if (landed) {
            push({Event::kSendDone, ctx, 0, 0, 0, 0, {}});
        } else {
            push({Event::kError, ctx, 0, 0, 0, fabric::kPeerUnreachable, "peer gone"});
        }
        return 0;
    }

    int post_recv(void* buf, size_t len, void*, void* ctx) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!unexpected_.empty()) {
            std::string m = std::move(unexpected_.front());
            unexpected_.pop_front();
            receive(static_cast<char*>(buf), len, ctx, m);
            return 0;
        }
        recvs_.push_back({static_cast<char*>(buf), len, ctx});
        return 0;
    }

    template <class Sink>
    size_t poll(Sink& sink) {
        if (int us = poll_work_us.load(); us > 0) {  // as tcp reading a write's bytes: busy, nothing done
            for (auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
                 std::chrono::steady_clock::now() < until;) {
            }
        }
        std::deque<Event> batch;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (record_pollers.load()) pollers_.insert(std::this_thread::get_id());
            int none = 0;  // a full queue frees one slot per poll (as a provider's progress does)
            if (refill_on_poll.load()) write_credits.compare_exchange_strong(none, 1);
            for (int i = 0; i < 16 && !events_.empty(); i++) {
                batch.push_back(std::move(events_.front()));
                events_.pop_front();
            }
        }
        for (auto& e : batch) {
            switch (e.kind) {
                case Event::kWriteDone:
                    if (!e.to.empty()) {  // reaped: on shm the sender's provider touches the target's memory
                        std::lock_guard<std::mutex> reg(fabric_.mu);
                        if (!fabric_.nics.count(e.to)) reaped_after_free.fetch_add(1);
                    }
                    sink.on_write_done(e.ctx);
                    break;
                case Event::kSendDone: sink.on_send_done(e.ctx); break;
                case Event::kRecv: sink.on_recv(e.ctx, e.len); break;
                case Event::kTruncated: sink.on_recv_truncated(e.ctx); break;
                case Event::kImm:
                    if (e.len > 1) {
                        sink.on_imms(e.imm, e.src, static_cast<uint32_t>(e.len));
                    } else {
                        sink.on_imm(e.imm, e.src);
                    }
                    break;
                case Event::kError: sink.on_error(e.ctx, e.status, e.message); break;
            }
        }
        return batch.size();
    }

    uint64_t writes() const { return writes_.load(std::memory_order_relaxed); }

    // Forgets what arrived and what completed (a NIC no engine drives: the fuzz target's).
    void drain() {
        std::lock_guard<std::mutex> lock(mu_);
        unexpected_.clear();
        events_.clear();
    }

  private:
    struct Event {
        enum Kind { kWriteDone, kSendDone, kRecv, kTruncated, kImm, kError } kind;
        void* ctx;
        size_t len;
        uint32_t imm;
        uint64_t src;
        int32_t status;
        std::string message;
        std::string to;  // a write's target (its completion: see reaped_after_free)
    };
    struct Recv {
        char* buf;
        size_t len;
        void* ctx;
    };

    std::string peer_address(uint64_t peer) {
        std::lock_guard<std::mutex> lock(mu_);
        return peer < peers_.size() ? peers_[peer] : std::string();
    }

    void push(Event e) {
        std::lock_guard<std::mutex> lock(mu_);
        events_.push_back(std::move(e));
    }

    // The target side of a write (the fabric registry is locked: this NIC stays alive).
    bool deliver_write(const fabric::WriteOp& w, const std::string& from) {
        std::lock_guard<std::mutex> lock(mu_);
        if (w.len > 0) {
            if (w.rkey == 0 || w.rkey > regions_.size()) return false;
            const Region& r = regions_[w.rkey - 1];
            if (w.raddr < r.base || w.raddr + w.len > r.base + r.len) return false;
            std::memcpy(reinterpret_cast<void*>(w.raddr), w.src, w.len);
        }
        if (w.has_imm) {
            uint64_t src = fabric::kNoSource;
            for (size_t i = 0; i < peers_.size(); i++)
                if (peers_[i] == from) src = i;
            events_.push_back({Event::kImm, nullptr, 0, w.imm, src, 0, {}});
        }
        return true;
    }

    // The target side of a list (as above): all pages or none.
    bool deliver_list(const fabric::WriteOp& w, const uint64_t* src, const uint64_t* dst, size_t n,
                      const std::string& from) {
        std::lock_guard<std::mutex> lock(mu_);
        if (w.rkey == 0 || w.rkey > regions_.size()) return false;
        const Region& r = regions_[w.rkey - 1];
        for (size_t i = 0; i < n; i++) {
            uint64_t at = w.raddr + dst[i];
            if (at < r.base || at + w.len > r.base + r.len) return false;
        }
        for (size_t i = 0; i < n; i++)
            std::memcpy(reinterpret_cast<void*>(w.raddr + dst[i]), reinterpret_cast<const void*>(src[i]), w.len);
        if (w.has_imm) {
            uint64_t s = fabric::kNoSource;
            for (size_t i = 0; i < peers_.size(); i++)
                if (peers_[i] == from) s = i;
            events_.push_back({Event::kImm, nullptr, n, w.imm, s, 0, {}});
        }
        return true;
    }

    void deliver_send(std::string m) {
        std::lock_guard<std::mutex> lock(mu_);
        if (recvs_.empty()) {
            unexpected_.push_back(std::move(m));
            return;
        }
        Recv r = recvs_.front();
        recvs_.pop_front();
        receive(r.buf, r.len, r.ctx, m);
    }

    // A message into a receive buffer (under mu_). One larger than the buffer is truncated as
    // tcp truncates it: nothing of it kept, reported as such (the sink's on_recv_truncated).
    void receive(char* buf, size_t len, void* ctx, const std::string& m) {
        if (m.size() > len) {
            events_.push_back({Event::kTruncated, ctx, 0, 0, 0, 0, {}});
            return;
        }
        std::memcpy(buf, m.data(), m.size());
        events_.push_back({Event::kRecv, ctx, m.size(), 0, 0, 0, {}});
    }

    struct Region {
        uint64_t base;
        size_t len;
    };

    FakeFabric& fabric_;
    const std::string address_;
    std::mutex mu_;
    std::set<std::thread::id> pollers_;  // (record_pollers)
    std::vector<std::string> peers_;
    std::vector<std::string> accepted_to_;  // under mu_
    std::vector<Region> regions_;
    std::deque<Event> events_;
    std::deque<Event> held_;  // completions of writes that landed while hold_write_done was set
    std::deque<Recv> recvs_;
    std::deque<std::string> unexpected_;
    std::atomic<uint64_t> writes_{0};
    std::vector<uint64_t> list_order_;  // the lists' destinations, as posted (under mu_)

  public:
    std::atomic<int> refuse_sends{0};  // the next N sends answer -EAGAIN
    // a write outside the target's regions fails as kConnectionDropped, not kRemoteAccess (as
    // on tcp, where the target drops the connection and the writer's work on it is cancelled)
    std::atomic<bool> silent_refusals{false};
    std::atomic<int> drop_writes{0};  // the next N writes fail as kConnectionDropped, not landed
    std::thread::id last_poster;        // the thread of the last post_write (under mu_)
    std::atomic<bool> hang_posts{false};  // while set, post_write does not return
    std::atomic<int> write_credits{-1};   // >= 0: post_write takes one, none left: -EAGAIN
    std::atomic<bool> refill_on_poll{false};  // with no credits left: each poll gives one back
    std::atomic<int> poll_work_us{0};  // > 0: every poll busies itself this long first
    std::atomic<bool> record_writes{false};  // while set, accepted_to() lists where writes went
    std::atomic<bool> hold_write_done{false};  // while set, landed writes are not reported
    std::atomic<int> hanging{0};          // threads inside such a post_write
    // writes with this key do not count towards the engine's queue depth (as the CUDA IPC
    // domain's copies into a peer's GPU memory do not); 0: every write counts
    std::atomic<uint64_t> uncapped_rkey{0};
    std::atomic<uint64_t> list_rkey{0};  // a paged request to this key may come as lists (0: none)
    std::atomic<uint64_t> lists_posted{0};
    bool counts_toward_queue_depth(const fabric::WriteOp& w) const { return w.rkey != uncapped_rkey.load(); }
    // posts (writes, sends) to an address in fabric::ClosedSet: an endpoint of this process
    // that was closed, whose memory a real shm post would touch after it was freed (SIGSEGV)
    std::atomic<int> posts_to_closed{0};
    // write completions polled after the target's NIC was destroyed: on shm, a sender reaping
    // a write through the memory of a target of this process that has closed (SIGSEGV)
    std::atomic<int> reaped_after_free{0};

    std::atomic<bool> record_pollers{false};  // while set, pollers() gathers the threads that poll

    std::set<std::thread::id> pollers() {
        std::lock_guard<std::mutex> lock(mu_);
        return pollers_;
    }

    void clear_pollers() {
        std::lock_guard<std::mutex> lock(mu_);
        pollers_.clear();
    }

    std::thread::id poster() {
        std::lock_guard<std::mutex> lock(mu_);
        return last_poster;
    }

    // The peer addresses of the writes posted while record_writes was set, in order.
    std::vector<std::string> accepted_to() {
        std::lock_guard<std::mutex> lock(mu_);
        return accepted_to_;
    }
};


using FakeEngine = fabric::Engine<FakeNic>;

// An engine of ``nics`` FakeNics named "<name>/nic<k>".
inline std::unique_ptr<FakeEngine> open_engine(FakeFabric& fabric, const std::string& name, int nics,
                                               std::shared_ptr<fabric::CounterTable> counters, bool chaos) {
    std::vector<std::unique_ptr<FakeNic>> domains;
    for (int n = 0; n < nics; n++)
        domains.push_back(std::make_unique<FakeNic>(fabric, name + "/nic" + std::to_string(n)));
    return std::make_unique<FakeEngine>(std::move(domains), std::move(counters), /*chaos_seed=*/7, chaos,
                                        /*cpu=*/-1, /*recv_depth=*/16, /*max_send=*/256);
}

}  // namespace fabric_test
