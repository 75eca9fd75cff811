// fabric's imm counter table in C++: the semantics of fabric_core.counters.CounterTable (the
// reference implementation, which the simulator uses), kept where the imms arrive.
//
// The engine's worker adds the imms it polled straight into this table, so a thread blocked
// in wait() is woken by the worker itself: no Python thread sits between an imm's arrival and
// the waiter that needs it (the reference system's ImmCounter.wait spins on an atomic for the
// same reason). Semantics, as in the Python table:
//   * every imm value counts from engine start: an imm that arrives before anyone waits is
//     counted, never lost;
//   * waiters on one imm are served first come, first served and consume their counts; a
//     waiter that leaves the head (timeout, cancel) may unblock smaller ones behind it;
//   * a waiter may name the peer it depends on: fail_peer() fails it (and every later one
//     naming that peer, until revive_peer());
//   * fail_all() fails every waiter (the engine is closing).
// Two kinds of waiter share one FIFO: blocking waiters (a thread inside wait(), the latency
// path) and token waiters (asyncio waits and expect() callbacks, fired by handing their token
// to the binding, which runs them on a Python thread).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fabric {

enum CounterCode : int {
    kCountOk = 0,        // the counts were consumed
    kCountQueued = 1,    // armed, waiting
    kCountTimeout = 2,   // the deadline passed; nothing consumed
    kCountPeerLost = 3,  // the named peer is lost
    kCountFailed = 4,    // every waiter failed (the engine is closing)
};

class CounterTable {
  public:
    struct Waiter {
        uint64_t n = 0;
        std::string peer;                 // empty: depends on no particular peer
        uint64_t token = 0;               // token waiters: handed back when fired; 0: blocking
        std::atomic<int> state{kCountQueued};
    };
    using WaiterPtr = std::shared_ptr<Waiter>;
    using Tokens = std::vector<uint64_t>;

    // The engine's inline progress: one progress step, if no other thread is in one; returns
    // whether it did any work.
    using Progress = std::function<bool()>;

    explicit CounterTable(std::chrono::microseconds spin = std::chrono::microseconds(200)) : spin_(spin) {}

    // Installs (or, with nullptr, removes) the engine's progress hook. Removal waits until no
    // waiter is inside the hook, so the engine may be destroyed once it returns.
    void set_progress(Progress fn) {
        std::lock_guard<std::mutex> lock(hook_mu_);
        hook_on_.store(false, std::memory_order_seq_cst);
        while (in_hook_.load(std::memory_order_seq_cst) > 0) std::this_thread::yield();
        hook_ = std::move(fn);
        hook_on_.store(static_cast<bool>(hook_), std::memory_order_seq_cst);
    }
    CounterTable(const CounterTable&) = delete;
    CounterTable& operator=(const CounterTable&) = delete;

    // Counts n arrivals of imm for each (imm, n); tokens of the waiters this fires go to fired.
    // ``received`` says whether they count as arrivals (false: counts a cancelled waiter gives
    // back).
    template <class Counts>
    void add(const Counts& counts, Tokens& fired, bool received = true) {
        bool wake = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (const auto& [imm, n] : counts) {
                if (received) received_ += n;
                Slot& slot = slots_[imm];
                slot.count += n;
                wake |= settle(slot, fired);
            }
        }
        if (wake) cv_.notify_all();
    }

    void add_one(uint32_t imm, uint64_t n, Tokens& fired, bool received = true) {
        std::pair<uint32_t, uint64_t> one{imm, n};
        add(std::vector<std::pair<uint32_t, uint64_t>>{one}, fired, received);
    }

    uint64_t value(uint32_t imm) const {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = slots_.find(imm);
        return it == slots_.end() ? 0 : it->second.count;
    }

    // (imm, count) of every imm with unconsumed counts.
    std::vector<std::pair<uint32_t, uint64_t>> snapshot() const {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<std::pair<uint32_t, uint64_t>> out;
        for (const auto& [imm, slot] : slots_)
            if (slot.count) out.emplace_back(imm, slot.count);
        std::sort(out.begin(), out.end());
        return out;
    }

    uint64_t received() const {
        std::lock_guard<std::mutex> lock(mu_);
        return received_;
    }

    // Queues a waiter for n counts of imm: kCountOk (consumed at once), kCountQueued, or
    // kCountPeerLost (it names a peer already lost; nothing queued).
    int enqueue(uint32_t imm, const WaiterPtr& w) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!w->peer.empty() && lost_.count(w->peer)) {
            w->state.store(kCountPeerLost, std::memory_order_release);
            return kCountPeerLost;
        }
        Slot& slot = slots_[imm];
        if (slot.waiters.empty() && slot.count >= w->n) {
            slot.count -= w->n;
            w->state.store(kCountOk, std::memory_order_release);
            return kCountOk;
        }
        slot.waiters.push_back(w);
        return kCountQueued;
    }

    int arm(uint32_t imm, uint64_t n, const std::string& peer, uint64_t token) {
        auto w = std::make_shared<Waiter>();
        w->n = n;
        w->peer = peer;
        w->token = token;
        return enqueue(imm, w);
    }

    // Blocks until a queued blocking waiter settles or ``deadline`` passes; returns its state
    // (kCountQueued at the deadline). It spins first (yielding the CPU) for the table's spin
    // time: a worker about to count the imm wakes a spinning waiter in well under a
    // microsecond, a sleeping one in tens.
    int block(const WaiterPtr& w, std::chrono::steady_clock::time_point deadline) {
        using Clock = std::chrono::steady_clock;
        auto spin_end = std::min(deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(spin_));
        int state = w->state.load(std::memory_order_acquire);
        // Spin, driving the engine's progress meanwhile (the imm this waiter needs is then
        // polled and counted by this very thread), yielding the CPU after a run of idle steps.
        unsigned idle = 0;
        while ((state = w->state.load(std::memory_order_acquire)) == kCountQueued && Clock::now() < spin_end) {
            if (step()) {
                idle = 0;
            } else if (++idle % kStepsBeforeYield == 0) {
                std::this_thread::yield();
            }
        }
        if (state != kCountQueued) return state;
        std::unique_lock<std::mutex> lock(mu_);
        blocked_++;
        cv_.wait_until(lock, deadline, [&] { return w->state.load(std::memory_order_acquire) != kCountQueued; });
        blocked_--;
        return w->state.load(std::memory_order_acquire);
    }

    // Takes a waiter that has not settled out of its queue: true, with the count it saw, if
    // withdrawn; false if it had already fired or failed. Waiters it unblocks fire.
    bool withdraw(uint32_t imm, const WaiterPtr& w, uint64_t& seen, Tokens& fired) {
        bool wake = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (w->state.load(std::memory_order_relaxed) != kCountQueued) return false;
            Slot& slot = slots_[imm];
            seen = slot.count;
            auto it = std::find(slot.waiters.begin(), slot.waiters.end(), w);
            if (it != slot.waiters.end()) slot.waiters.erase(it);
            w->state.store(kCountTimeout, std::memory_order_release);
            wake = settle(slot, fired);
        }
        if (wake) cv_.notify_all();
        return true;
    }

    // withdraw() for a token waiter.
    bool withdraw_token(uint32_t imm, uint64_t token, uint64_t& seen, Tokens& fired) {
        WaiterPtr w;
        {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = slots_.find(imm);
            if (it == slots_.end()) return false;
            for (auto& q : it->second.waiters)
                if (q->token == token) w = q;
        }
        return w && withdraw(imm, w, seen, fired);
    }

    // Fails every waiter naming ``peer`` (and later ones, until revive_peer); their tokens go
    // to ``failed``.
    void fail_peer(const std::string& peer, Tokens& failed) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            lost_.insert(peer);
            for (auto& [imm, slot] : slots_) {
                std::deque<WaiterPtr> keep;
                for (auto& w : slot.waiters) {
                    if (w->peer == peer) {
                        fire(*w, kCountPeerLost, failed);
                    } else {
                        keep.push_back(std::move(w));
                    }
                }
                slot.waiters.swap(keep);
            }
        }
        cv_.notify_all();
    }

    void revive_peer(const std::string& peer) {
        std::lock_guard<std::mutex> lock(mu_);
        lost_.erase(peer);
    }

    bool peer_lost(const std::string& peer) const {
        std::lock_guard<std::mutex> lock(mu_);
        return lost_.count(peer) != 0;
    }

    // The peers that queued waiters name: the engine probes them for liveness, since an imm
    // names no sender and a dead sender's imms simply stop arriving.
    std::vector<std::string> watched_peers() const {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<std::string> out;
        for (const auto& [imm, slot] : slots_)
            for (const auto& w : slot.waiters)
                if (!w->peer.empty() && std::find(out.begin(), out.end(), w->peer) == out.end())
                    out.push_back(w->peer);
        return out;
    }

    struct WaiterView {
        uint32_t imm;
        uint64_t count;  // unconsumed counts of the imm
        uint64_t n;      // what the waiter needs
        std::string peer;
        bool blocking;
    };

    // Every queued waiter, in FIFO order per imm (for hang diagnostics).
    std::vector<WaiterView> pending() const {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<WaiterView> out;
        for (const auto& [imm, slot] : slots_)
            for (const auto& w : slot.waiters) out.push_back(WaiterView{imm, slot.count, w->n, w->peer, w->token == 0});
        std::stable_sort(out.begin(), out.end(), [](const WaiterView& a, const WaiterView& b) { return a.imm < b.imm; });
        return out;
    }

    std::vector<std::string> lost_peers() const {
        std::lock_guard<std::mutex> lock(mu_);
        return std::vector<std::string>(lost_.begin(), lost_.end());
    }

    // Fails every waiter (the engine is closing); their tokens go to ``failed``.
    void fail_all(Tokens& failed) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (auto& [imm, slot] : slots_) {
                for (auto& w : slot.waiters) fire(*w, kCountFailed, failed);
                slot.waiters.clear();
            }
        }
        cv_.notify_all();
    }

  private:
    static constexpr unsigned kStepsBeforeYield = 8;

    // One progress step through the hook, if one is installed; whether it did any work.
    bool step() {
        in_hook_.fetch_add(1, std::memory_order_seq_cst);
        bool out = hook_on_.load(std::memory_order_seq_cst) && hook_();
        in_hook_.fetch_sub(1, std::memory_order_seq_cst);
        return out;
    }

    struct Slot {
        uint64_t count = 0;
        std::deque<WaiterPtr> waiters;
    };

    // Fires head waiters the count now covers; true if a blocking waiter fired.
    bool settle(Slot& slot, Tokens& fired) {
        bool blocking = false;
        while (!slot.waiters.empty() && slot.count >= slot.waiters.front()->n) {
            WaiterPtr w = std::move(slot.waiters.front());
            slot.waiters.pop_front();
            slot.count -= w->n;
            blocking |= fire(*w, kCountOk, fired);
        }
        return blocking && blocked_ > 0;
    }

    static bool fire(Waiter& w, int state, Tokens& fired) {
        w.state.store(state, std::memory_order_release);
        if (w.token) {
            fired.push_back(w.token);
            return false;
        }
        return true;
    }

    std::chrono::microseconds spin_;
    std::mutex hook_mu_;
    Progress hook_;
    std::atomic<bool> hook_on_{false};
    std::atomic<int> in_hook_{0};
    mutable std::mutex mu_;
    std::condition_variable cv_;
    size_t blocked_ = 0;  // blocking waiters asleep on cv_ (guarded by mu_)
    uint64_t received_ = 0;
    std::unordered_map<uint32_t, Slot> slots_;
    std::unordered_set<std::string> lost_;
};

}  // namespace fabric
