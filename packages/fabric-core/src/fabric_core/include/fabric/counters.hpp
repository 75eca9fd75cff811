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
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
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

// How long blocking waits took (fabric_core's ``EngineStats.counter_waits``): the waits that
// the binding settles in C++ alone (satisfied, no token fired, no signal) are tallied here,
// with no Python on their path; fabric_core's WaitLatency adds this tally to its own, which
// holds the waits that went through Python. Lock-free: relaxed atomics, read as a snapshot.
class WaitTally {
  public:
    static constexpr size_t kMaxBounds = 32;

    // The buckets' upper bounds in seconds, ascending (fabric_core.stats.WAIT_BUCKETS_S). Set
    // once, before the first record(); a wait of s seconds lands in the first bucket whose
    // bound is >= s (Python's bisect_left), or past the last bound.
    void set_bounds(const std::vector<double>& bounds) {
        if (bounds.empty() || bounds.size() > kMaxBounds || !std::is_sorted(bounds.begin(), bounds.end()))
            throw std::invalid_argument("wait buckets: 1 to 32 ascending bounds in seconds");
        size_t have = nbounds_.load(std::memory_order_acquire);
        if (have) {
            if (std::equal(bounds.begin(), bounds.end(), bounds_.begin(), bounds_.begin() + have)) return;
            throw std::invalid_argument("wait buckets are already set, to other bounds");
        }
        std::copy(bounds.begin(), bounds.end(), bounds_.begin());
        nbounds_.store(bounds.size(), std::memory_order_release);
    }

    void record(std::chrono::nanoseconds took) {
        size_t nb = nbounds_.load(std::memory_order_acquire);
        double s = std::chrono::duration<double>(took).count();
        size_t bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.begin() + nb, s) - bounds_.begin());
        buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
        total_ns_.fetch_add(static_cast<uint64_t>(std::max<int64_t>(took.count(), 0)), std::memory_order_relaxed);
        satisfied_.fetch_add(1, std::memory_order_relaxed);
    }

    struct View {
        uint64_t satisfied = 0;
        double total_s = 0;
        std::vector<uint64_t> buckets;  // one per bound, and one past the last
    };
    View view() const {
        View v;
        size_t nb = nbounds_.load(std::memory_order_acquire);
        v.buckets.resize(nb + 1);
        for (size_t i = 0; i <= nb; i++) v.buckets[i] = buckets_[i].load(std::memory_order_relaxed);
        v.total_s = static_cast<double>(total_ns_.load(std::memory_order_relaxed)) * 1e-9;
        v.satisfied = satisfied_.load(std::memory_order_relaxed);
        return v;
    }

  private:
    std::array<double, kMaxBounds> bounds_{};
    std::atomic<size_t> nbounds_{0};
    std::array<std::atomic<uint64_t>, kMaxBounds + 1> buckets_{};
    std::atomic<uint64_t> total_ns_{0};
    std::atomic<uint64_t> satisfied_{0};
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
    // Told when a waiter starts spinning through the progress hook (kSpinStart) and when it
    // stops: satisfied or failed (kSpinDone; such a thread is about to run Python, so the
    // engine holds completions back from its completion thread for a moment), or still
    // waiting, to sleep on the table's condition variable from now on (kSpinBlocks: nothing
    // drives the engine's progress for it any more). Engine::spinning.
    enum SpinEvent : int { kSpinStart = 1, kSpinDone = 0, kSpinBlocks = -1 };
    using Spin = std::function<void(SpinEvent)>;

    explicit CounterTable(std::chrono::microseconds spin = std::chrono::microseconds(200)) : spin_(spin) {}

    // Installs (or, with nullptr, removes) the engine's progress hook. Removal waits until no
    // waiter is inside the hook, so the engine may be destroyed once it returns. A waiter can
    // stay inside for good (a provider call that never returns: on shm, a post spinning on
    // the lock of a peer killed holding it); past ``deadline`` this gives up, leaves the hook
    // off but in place (never replaced under a thread that runs it) and returns false: the
    // engine must then outlive that thread, which the owner ensures by leaking it.
    //
    // ``spin`` (optional, removed with the hook) hears each waiter start and stop spinning. A
    // waiter told the engine it started is told it stopped only by the same installation of
    // the hooks (``hook_gen_``), so an engine never sees a stop without its start.
    bool set_progress(Progress fn,
                      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
                      Spin spin = nullptr) {
        std::lock_guard<std::mutex> lock(hook_mu_);
        hook_on_.store(false, std::memory_order_seq_cst);
        while (in_hook_.load(std::memory_order_seq_cst) > 0) {
            if (std::chrono::steady_clock::now() >= deadline) return false;
            std::this_thread::yield();
        }
        hook_ = std::move(fn);
        spin_hook_ = hook_ ? std::move(spin) : nullptr;
        hook_gen_.fetch_add(1, std::memory_order_seq_cst);
        hook_on_.store(static_cast<bool>(hook_), std::memory_order_seq_cst);
        return true;
    }
    CounterTable(const CounterTable&) = delete;
    CounterTable& operator=(const CounterTable&) = delete;

    WaitTally& waits() { return waits_; }

    // Counts n arrivals of imm for each (imm, n); tokens of the waiters this fires go to fired.
    // ``received`` says whether they count as arrivals (false: counts a cancelled waiter gives
    // back).
    template <class Counts>
    void add(const Counts& counts, Tokens& fired, bool received = true) {
        bool wake = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (const auto& [imm, n] : counts) {
                Slot& slot = slots_[imm];
                if (received) {
                    received_ += n;
                    slot.arrived += n;
                    if (slot.mirror) publish(slot);
                }
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

    // How many things in the table still need the engine's polls: queued waiters (blocking
    // or token) and live GPU mirrors. A hint, read without the lock (Engine::spinning: the
    // last spinner to stop wakes the worker while it is not 0).
    size_t watched() const { return watched_.load(std::memory_order_relaxed); }

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
        watched_.fetch_add(1, std::memory_order_relaxed);
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
    int block(const WaiterPtr& w, std::chrono::steady_clock::time_point deadline) { return block_all(&w, 1, deadline); }

    // block() for several waiters: until every one has fired (kCountOk), one has failed (its
    // state: the first failed one in order), or ``deadline`` passes (kCountQueued).
    int block_all(const WaiterPtr* ws, size_t n, std::chrono::steady_clock::time_point deadline) {
        using Clock = std::chrono::steady_clock;
        auto spin_end = std::min(deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(spin_));
        int state;
        // Spin, driving the engine's progress meanwhile (the imm this waiter needs is then
        // polled and counted by this very thread), yielding the CPU after a run of idle steps.
        unsigned idle = 0;
        uint64_t spun = 0;  // the hooks' installation told of this spin, or 0
        if ((state = joint_state(ws, n)) == kCountQueued && Clock::now() < spin_end) spun = spin(kSpinStart, 0);
        while ((state = joint_state(ws, n)) == kCountQueued && Clock::now() < spin_end) {
            if (step()) {
                idle = 0;
            } else if (++idle % kStepsBeforeYield == 0) {
                std::this_thread::yield();
            }
        }
        if (spun) spin(state == kCountQueued ? kSpinBlocks : kSpinDone, spun);
        if (state != kCountQueued) return state;
        std::unique_lock<std::mutex> lock(mu_);
        blocked_++;
        cv_.wait_until(lock, deadline, [&] { return joint_state(ws, n) != kCountQueued; });
        blocked_--;
        return joint_state(ws, n);
    }

    // What block_all() waits for: kCountOk once all fired, the first failure, else kCountQueued.
    static int joint_state(const WaiterPtr* ws, size_t n) {
        int out = kCountOk;
        for (size_t i = 0; i < n; i++) {
            int s = ws[i]->state.load(std::memory_order_acquire);
            if (s == kCountQueued) {
                out = kCountQueued;
            } else if (s != kCountOk) {
                return s;
            }
        }
        return out;
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
            if (it != slot.waiters.end()) {
                slot.waiters.erase(it);
                watched_.fetch_sub(1, std::memory_order_relaxed);
            }
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
                if (slot.mirror && slot.mirror_peer == peer && release(slot, kCountPeerLost))
                    watched_.fetch_sub(1, std::memory_order_relaxed);
                std::deque<WaiterPtr> keep;
                for (auto& w : slot.waiters) {
                    if (w->peer == peer) {
                        fire(*w, kCountPeerLost, failed);
                        watched_.fetch_sub(1, std::memory_order_relaxed);
                    } else {
                        keep.push_back(std::move(w));
                    }
                }
                slot.waiters.swap(keep);
            }
        }
        cv_.notify_all();
    }

    // --- GPU-side waits (fabric_core.device_counter) ----------------------------------------
    // A mirror publishes one imm's arrivals to a 32-bit word of host memory mapped into the
    // GPUs: base + arrivals since engine start (mod 2^32), stored by the thread that counts
    // them, so a CUDA stream waiting on the word (cuStreamWaitValue32, a cyclic >=) goes on
    // with no host thread in between. reserve() hands out targets, base + the arrivals asked
    // for so far; the device ledger is its own (host waiters consume counts, it does not).
    // A failed mirror (its peer lost, the engine closing, a host-side deadline, detached)
    // stores the highest target handed out, so that every GPU wait queued on it passes, and
    // refuses further reserves with the failure's code. The word itself only ever grows:
    // ``base`` starts from its current value, so a word can serve one mirror after another.

    // kCountOk; kCountPeerLost (``peer`` is lost); kCountFailed (the imm has a mirror).
    int attach_mirror(uint32_t imm, uint32_t* word, const std::string& peer) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!peer.empty() && lost_.count(peer)) return kCountPeerLost;
        Slot& slot = slots_[imm];
        if (slot.mirror) return kCountFailed;
        slot.mirror = word;
        slot.mirror_base = __atomic_load_n(word, __ATOMIC_ACQUIRE) - static_cast<uint32_t>(slot.arrived);
        slot.mirror_cursor = 0;
        slot.mirror_state = kCountQueued;
        slot.mirror_peer = peer;
        watched_.fetch_add(1, std::memory_order_relaxed);
        return kCountOk;
    }

    // The next target of n more arrivals: kCountOk, or the code the mirror failed with
    // (kCountFailed: no mirror).
    int reserve(uint32_t imm, uint64_t n, uint32_t& target) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = slots_.find(imm);
        if (it == slots_.end() || !it->second.mirror) return kCountFailed;
        Slot& slot = it->second;
        if (slot.mirror_state != kCountQueued) return slot.mirror_state;
        slot.mirror_cursor += n;
        target = slot.mirror_base + static_cast<uint32_t>(slot.mirror_cursor);
        return kCountOk;
    }

    // Fails the imm's mirror with ``code`` (releasing its GPU waits); false if it has none or
    // it had failed already. ``detach``: the mirror goes (its word is free for another).
    bool fail_mirror(uint32_t imm, int code, bool detach) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = slots_.find(imm);
        if (it == slots_.end() || !it->second.mirror) return false;
        bool fresh = release(it->second, code);
        if (fresh) watched_.fetch_sub(1, std::memory_order_relaxed);
        if (detach) it->second.mirror = nullptr;
        return fresh;
    }

    // (arrivals since engine start, arrivals reserved by GPU waits, mirror state)
    std::tuple<uint64_t, uint64_t, int> mirror_state(uint32_t imm) const {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = slots_.find(imm);
        if (it == slots_.end()) return {0, 0, kCountFailed};
        const Slot& slot = it->second;
        if (!slot.mirror) return {slot.arrived, 0, kCountFailed};
        return {slot.arrived, slot.mirror_cursor, slot.mirror_state};
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
        auto watch = [&out](const std::string& peer) {
            if (!peer.empty() && std::find(out.begin(), out.end(), peer) == out.end()) out.push_back(peer);
        };
        for (const auto& [imm, slot] : slots_) {
            for (const auto& w : slot.waiters) watch(w->peer);
            if (slot.mirror && slot.mirror_state == kCountQueued) watch(slot.mirror_peer);  // a GPU waits on it
        }
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
                watched_.fetch_sub(slot.waiters.size(), std::memory_order_relaxed);
                slot.waiters.clear();
                if (slot.mirror && release(slot, kCountFailed)) watched_.fetch_sub(1, std::memory_order_relaxed);
            }
        }
        cv_.notify_all();
    }

  private:
    static constexpr unsigned kStepsBeforeYield = 8;

    // One progress step through the hook, if one is installed; whether it did any work.
    bool step() {
        // off: not counted either, so set_progress sees in_hook_ drain at once however many
        // waiters spin (a waiter between the two loads below is counted, and re-checks)
        if (!hook_on_.load(std::memory_order_seq_cst)) return false;
        in_hook_.fetch_add(1, std::memory_order_seq_cst);
        bool out = hook_on_.load(std::memory_order_seq_cst) && hook_();
        in_hook_.fetch_sub(1, std::memory_order_seq_cst);
        return out;
    }

    // Tells the spin hook that this waiter starts (returns the hooks' installation, 0 if none
    // heard it) or stops (``gen``: what the start returned; told only to that installation).
    uint64_t spin(SpinEvent event, uint64_t gen) {
        if (!hook_on_.load(std::memory_order_seq_cst)) return 0;
        in_hook_.fetch_add(1, std::memory_order_seq_cst);
        uint64_t now = hook_gen_.load(std::memory_order_seq_cst);
        bool on = hook_on_.load(std::memory_order_seq_cst) && spin_hook_ && (event == kSpinStart || now == gen);
        if (on) spin_hook_(event);
        in_hook_.fetch_sub(1, std::memory_order_seq_cst);
        return on ? now : 0;
    }

    struct Slot {
        uint64_t count = 0;
        std::deque<WaiterPtr> waiters;
        uint64_t arrived = 0;  // arrivals since engine start (refunds excluded)
        // a GPU-side wait's mirror (attach_mirror), or none
        uint32_t* mirror = nullptr;
        uint32_t mirror_base = 0;
        uint64_t mirror_cursor = 0;  // arrivals reserved by GPU waits
        int mirror_state = kCountQueued;
        std::string mirror_peer;
    };

    static void publish(Slot& slot) {
        // a failed mirror's word was set past every target: it never moves back from there
        uint64_t top = slot.mirror_state == kCountQueued ? slot.arrived : std::max(slot.arrived, slot.mirror_cursor);
        __atomic_store_n(slot.mirror, slot.mirror_base + static_cast<uint32_t>(top), __ATOMIC_RELEASE);
    }

    // Fails a live mirror with ``code`` and lets its queued GPU waits pass; false if it had failed.
    static bool release(Slot& slot, int code) {
        if (slot.mirror_state != kCountQueued) return false;
        slot.mirror_state = code;
        uint64_t top = std::max(slot.arrived, slot.mirror_cursor);
        __atomic_store_n(slot.mirror, slot.mirror_base + static_cast<uint32_t>(top), __ATOMIC_RELEASE);
        return true;
    }

    // Fires head waiters the count now covers; true if a blocking waiter fired.
    bool settle(Slot& slot, Tokens& fired) {
        bool blocking = false;
        while (!slot.waiters.empty() && slot.count >= slot.waiters.front()->n) {
            WaiterPtr w = std::move(slot.waiters.front());
            slot.waiters.pop_front();
            watched_.fetch_sub(1, std::memory_order_relaxed);
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
    Spin spin_hook_;
    std::atomic<uint64_t> hook_gen_{0};
    std::atomic<bool> hook_on_{false};
    std::atomic<int> in_hook_{0};
    mutable std::mutex mu_;
    std::condition_variable cv_;
    size_t blocked_ = 0;  // blocking waiters asleep on cv_ (guarded by mu_)
    // queued waiters plus live mirrors (written under mu_; read as a hint: watched())
    std::atomic<size_t> watched_{0};
    uint64_t received_ = 0;
    std::unordered_map<uint32_t, Slot> slots_;
    std::unordered_set<std::string> lost_;
    WaitTally waits_;
};

}  // namespace fabric
