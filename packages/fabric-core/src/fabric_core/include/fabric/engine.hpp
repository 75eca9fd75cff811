// fabric's engine core: the hot path every compiled backend shares.
//
// Engine<Domain> owns one domain group (one Domain per NIC) and one worker thread. Requests
// arrive already planned (fabric_core.plan_request decides the work requests and the count
// rule) through a lock-free MPSC queue; the worker resolves peers, posts work requests in
// batches on every NIC, polls every CQ in batches, counts imms into the counter table
// (fabric/counters.hpp), and publishes completions in batches that the binding hands to
// Python on its own thread (GIL taken once per batch). A slow or raising Python callback
// therefore never stalls the NICs.
//
// Progress (intake, post, poll, publish: step()) runs under one mutex, so besides the worker
// two other threads may run it, never at once: a submit that finds the worker napping posts
// its (small) request itself instead of paying for a wake-up, and a thread blocked on a
// counter runs progress steps while it spins, so the imm it waits for is polled and counted
// by that very thread. Both matter most on hosts with fewer cores than busy threads.
//
// A Domain provides (see fabric_efa's LibfabricDomain for the libfabric one):
//   std::string address() const;                         // this NIC's address bytes
//   uint64_t insert_peer(const std::string& address);    // peer handle (fi_addr_t, ...)
//   bool virt_addr() const;                              // remote addresses are virtual
//   int post_write(const WriteOp&, void* ctx);           // 0, -EAGAIN (retry later), -errno
//                                                        // (-EHOSTUNREACH, -ECONNREFUSED,
//                                                        // -ENOTCONN: PeerUnreachable); a post
//                                                        // that returned 0 may still fail later
//                                                        // through the sink's on_error
//   int post_send(const void* buf, size_t len, void* desc, uint64_t peer, void* ctx);
//   int post_recv(void* buf, size_t len, void* desc, void* ctx);
//   void* local_desc(void* buf, size_t len);             // register engine-owned buffers
//                                                        // for local access; their descriptor
//   template <class Sink> size_t poll(Sink&);            // calls sink.on_*(...) per entry
// Sink callbacks: on_write_done(ctx), on_send_done(ctx), on_recv(ctx, len),
//                 on_imm(uint32_t imm), on_error(ctx, status, message).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#endif

#include "counters.hpp"
#include "mpsc_queue.hpp"

namespace fabric {

// Status codes handed to Python (mapped to the error tree there).
enum Status : int32_t {
    kOk = 0,
    kPeerUnreachable = 1,
    kRemoteAccess = 2,
    kTransport = 3,
    kClosed = 4,
};

struct WriteOp {
    const void* src;
    uint64_t len;
    void* desc;       // local MR descriptor on this NIC (may be null)
    uint64_t peer;    // peer handle from insert_peer
    uint64_t raddr;   // remote address (virtual or offset, per the domain)
    uint64_t rkey;
    bool has_imm;
    uint32_t imm;
};

// A destination region. Shared by every request to it; ``peers`` caches the resolved peer
// handle per NIC and is touched by the worker only.
struct Target {
    std::vector<std::string> addresses;  // per NIC
    std::vector<uint64_t> rkeys;         // per NIC
    uint64_t remote_base = 0;            // the descriptor's ptr
    std::vector<uint64_t> peers;         // per NIC, kUnresolved until the worker resolves it
    static constexpr uint64_t kUnresolved = ~uint64_t(0);
};

struct Request;

// Per work request context; the first 64 bytes are scratch for the provider (fi_context2).
struct OpCtx {
    alignas(16) unsigned char provider_scratch[64];
    Request* request = nullptr;
    uint32_t nic = 0;
    uint32_t target = 0;
    uint64_t src = 0;
    uint64_t dst_off = 0;
    uint64_t len = 0;
    int kind = 0;  // 0 write, 1 send, 2 recv
};

struct Request {
    uint64_t id = 0;
    bool has_imm = false;
    uint32_t imm = 0;
    std::shared_ptr<const std::vector<void*>> src_desc;  // per NIC; null: no source (imm-only)
    std::vector<std::shared_ptr<Target>> targets;
    std::vector<OpCtx> ops;
    // two-sided send: the payload is copied into a registered bounce slot when posted
    std::string payload;
    std::string send_to;
    bool resolve_only = false;  // complete once send_to resolves on NIC 0 (peer groups)
    // progress
    size_t left = 0;
    int32_t status = kOk;
    std::string message;
};

struct Completion {
    uint64_t id;
    int32_t status;
    std::string message;
};

struct Batch {
    std::vector<Completion> done;
    std::vector<uint64_t> fired;  // tokens of counter waiters (asyncio, expect) the imms fired
    std::vector<std::string> messages;
    bool empty() const { return done.empty() && fired.empty() && messages.empty(); }
};

struct EngineStats {
    uint64_t posted = 0;
    uint64_t completed_wrs = 0;  // writes that completed successfully
    uint64_t bytes_written = 0;  // their bytes
    uint64_t eagain = 0;
};

template <class Domain>
class Engine {
  public:
    Engine(std::vector<std::unique_ptr<Domain>> nics, std::shared_ptr<CounterTable> counters, uint64_t chaos_seed,
           bool chaos, int cpu, size_t recv_depth, size_t max_send)
        : nics_(std::move(nics)),
          counters_(std::move(counters)),
          chaos_(chaos),
          rng_(chaos_seed),
          pending_(nics_.size()),
          peers_(nics_.size()),
          recv_depth_(recv_depth),
          max_send_(max_send) {
        // Control messages move through registered buffers on NIC 0: receive buffers, and a
        // pool of send slots the payloads are copied into when posted (FI_MR_LOCAL).
        recv_arena_.resize(recv_depth_ * max_send_);
        send_arena_.resize(kSendSlots * max_send_);
        recv_desc_ = nics_[0]->local_desc(recv_arena_.data(), recv_arena_.size());
        send_desc_ = nics_[0]->local_desc(send_arena_.data(), send_arena_.size());
        for (uint32_t i = kSendSlots; i > 0; i--) free_slots_.push_back(i - 1);
        recv_ctx_.resize(recv_depth_);
        for (size_t i = 0; i < recv_depth_; i++) {
            recv_ctx_[i].kind = 2;
            recv_ctx_[i].src = i;
            int rc = nics_[0]->post_recv(recv_buf(i), max_send_, recv_desc_, &recv_ctx_[i]);
            if (rc != 0) throw std::runtime_error("posting control receive buffers failed: " + std::to_string(rc));
        }
        worker_ = std::thread([this, cpu] { run(cpu); });
        counters_->set_progress([this] { return help(); });
    }

    ~Engine() { close(); }

    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    size_t num_nics() const { return nics_.size(); }
    Domain& nic(size_t i) { return *nics_.at(i); }
    CounterTable& counters() { return *counters_; }

    void submit(std::unique_ptr<Request> req) {
        bool small = req->ops.size() <= kInlineOps;
        queue_.push(std::move(req));
        if (!sleeping_.load(std::memory_order_seq_cst)) return;  // the worker will take it
        if (small) {
            // The worker is napping: post from this thread rather than pay for waking it (it
            // comes back within a nap to poll what is now in flight).
            std::unique_lock<std::mutex> lock(progress_mu_, std::try_to_lock);
            if (lock.owns_lock() && !stop_.load(std::memory_order_acquire)) {
                intake();
                post_pending();
                return;
            }
        }
        std::lock_guard<std::mutex> lock(wake_mu_);
        wake_cv_.notify_one();
    }

    // Inline progress for a thread that waits on a counter (the counter table calls it while
    // its waiter spins): one progress step if no other thread (the worker) is in one. An imm
    // the waiter polls itself is counted and seen by the thread that waits for it with no
    // thread switch in between: on a host with fewer cores than busy threads that is the
    // difference between a round trip of about 10 us and one of about 40 (shm, 2 cores).
    // Returns whether the step did any work.
    bool help() {
        if (stop_.load(std::memory_order_acquire)) return false;
        std::unique_lock<std::mutex> lock(progress_mu_, std::try_to_lock);
        if (!lock.owns_lock() || stop_.load(std::memory_order_acquire)) return false;
        return step();
    }

    // Blocks up to timeout_s for completions; returns whatever is ready (maybe nothing).
    // Under load (more work was in flight when the first completions were published) it lets
    // a small batch grow for a few microseconds: the caller pays one GIL acquisition and one
    // wake-up per batch, so fewer, larger batches are cheaper. An idle engine's completion is
    // handed over at once.
    Batch wait_batch(double timeout_s) {
        static thread_local bool tight_slack = [] {
#if defined(__linux__)
            prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
            return true;
        }();
        (void)tight_slack;
        std::unique_lock<std::mutex> lock(out_mu_);
        out_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                         [this] { return !out_.empty() || stopped_; });
        if (!stopped_ && out_.done.size() < kCoalesce && more_coming_.load(std::memory_order_relaxed)) {
            lock.unlock();
            std::this_thread::sleep_for(kCoalesceWait);
            lock.lock();
        }
        Batch b;
        std::swap(b, out_);
        return b;
    }

    // For a thread that waits on a transfer: run progress steps and take the completions that
    // are published, up to ``timeout_s``; returns them (maybe none). While a thread drains, the
    // completion thread is not woken for new completions: the drainer hands them to Python
    // itself, so a transfer's completion reaches the thread that waits on it with no thread
    // switch and no GIL hand-off in between. Whatever is published as it leaves goes to the
    // completion thread as usual.
    Batch drain(double timeout_s) {
        using Clock = std::chrono::steady_clock;
        auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::max(timeout_s, 0.0)));
        Batch b;
        drainers_.fetch_add(1, std::memory_order_seq_cst);
        unsigned idle = 0;
        while (true) {
            bool worked = help();
            {
                std::lock_guard<std::mutex> lock(out_mu_);
                if (!out_.empty()) {
                    std::swap(b, out_);
                    break;
                }
            }
            if (stop_.load(std::memory_order_acquire) || Clock::now() >= deadline) break;
            if (!worked && ++idle % 8 == 0) std::this_thread::yield();
        }
        drainers_.fetch_sub(1, std::memory_order_seq_cst);
        bool left;
        {
            std::lock_guard<std::mutex> lock(out_mu_);
            left = !out_.empty();
        }
        if (left) out_cv_.notify_one();
        return b;
    }

    void close() {
        counters_->set_progress(nullptr);  // waiters stop helping (and wait for those inside)
        if (stop_.exchange(true)) return;
        {
            std::lock_guard<std::mutex> lock(wake_mu_);
            wake_cv_.notify_all();
        }
        if (worker_.joinable()) worker_.join();
        {
            std::lock_guard<std::mutex> lock(out_mu_);
            stopped_ = true;
        }
        out_cv_.notify_all();
    }

    EngineStats stats() const {
        EngineStats s;
        s.posted = posted_.load();
        s.completed_wrs = completed_.load();
        s.bytes_written = bytes_.load();
        s.eagain = eagain_.load();
        return s;
    }

  private:
    // --- worker -------------------------------------------------------------------------
    void run(int cpu) {
#if defined(__linux__)
        if (cpu >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpu, &set);
            pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        }
#endif
        // Idle policy. With work in flight the worker polls without pause, yielding the CPU
        // after a run of empty polls (a provider with manual progress needs the polls, and a
        // host with fewer cores than busy threads needs the yields). Once nothing is in flight
        // it keeps polling for incoming imms and messages, yielding between polls, for
        // kIdleSpin; then it sleeps in short naps (kNap, with a tight timer slack so a nap is
        // not stretched to the kernel's default 50 us), and a submit wakes it at once.
        using clock = std::chrono::steady_clock;
        constexpr auto kIdleSpin = std::chrono::microseconds(200);
        constexpr auto kNap = std::chrono::microseconds(20);
        constexpr unsigned kPollsBeforeYield = 4;
#if defined(__linux__)
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us
#endif
        unsigned empty = 0;
        auto last_work = clock::now();
        while (!stop_.load(std::memory_order_acquire)) {
            bool busy, inflight, full;
            {
                std::lock_guard<std::mutex> lock(progress_mu_);
                busy = step();
                inflight = inflight_ > 0;
                full = full_;
            }
            if (busy) {
                empty = 0;
                continue;
            }
            // A full NIC that completed nothing waits on the peer (on shm, on the peer's own
            // progress): give the CPU away at once rather than spin against it.
            if (++empty < kPollsBeforeYield && !full) continue;
            if (inflight) {
                std::this_thread::yield();
                last_work = clock::now();
                continue;
            }
            if (empty == kPollsBeforeYield) last_work = clock::now();
            if (clock::now() - last_work < kIdleSpin) {
                std::this_thread::yield();
                continue;
            }
            nap(kNap);
        }
        std::lock_guard<std::mutex> lock(progress_mu_);
        // Fail whatever is still in flight: the engine is closing.
        drain_on_close();
    }

    // One progress step: take new requests, post, poll every CQ, publish. Whoever holds
    // progress_mu_ runs it: the worker, or a thread that help()s while it waits on a counter.
    bool step() {
        bool busy = intake();
        busy |= post_pending();
        busy |= poll_all();
        publish();
        return busy;
    }

    // Sleeps up to ``d`` unless a submit is queued; submit() wakes a sleeping worker at once.
    void nap(std::chrono::microseconds d) {
        sleeping_.store(true, std::memory_order_seq_cst);
        if (queue_.empty()) {
            std::unique_lock<std::mutex> lock(wake_mu_);
            wake_cv_.wait_for(lock, d);
        }
        sleeping_.store(false, std::memory_order_release);
    }

    bool intake() {
        bool any = false;
        while (auto req = queue_.pop()) {
            any = true;
            Request* r = req.release();
            live_.emplace(r->id, std::unique_ptr<Request>(r));
            if (r->resolve_only) {
                uint64_t peer = 0;
                bool ok = resolve(0, r->send_to, peer);
                ready_.push_back(Completion{r->id, ok ? kOk : kPeerUnreachable,
                                            ok ? std::string() : "the provider refused the peer's address"});
                live_.erase(r->id);
                continue;
            }
            if (!r->send_to.empty()) {
                r->left = 1;
                inflight_++;
                OpCtx& op = r->ops.emplace_back();
                op.request = r;
                op.kind = 1;
                uint64_t peer = 0;
                if (!resolve(0, r->send_to, peer)) {
                    fail_op(op, kPeerUnreachable, "cannot resolve the peer's address");
                    continue;
                }
                op.dst_off = peer;
                pending_[0].push_back(&op);
                continue;
            }
            r->left = r->ops.size();
            inflight_ += r->ops.size();
            std::vector<size_t> order(r->ops.size());
            for (size_t i = 0; i < order.size(); i++) order[i] = i;
            if (chaos_) std::shuffle(order.begin(), order.end(), rng_);
            for (size_t i : order) {
                OpCtx& op = r->ops[i];
                op.request = r;
                pending_[op.nic].push_back(&op);
            }
        }
        return any;
    }

    bool resolve(uint32_t nic, const std::string& address, uint64_t& out) {
        auto& cache = peers_[nic];
        auto it = cache.find(address);
        if (it != cache.end()) {
            out = it->second;
            return true;
        }
        try {
            out = nics_[nic]->insert_peer(address);
        } catch (...) {
            return false;
        }
        cache.emplace(address, out);
        return true;
    }

    bool post_pending() {
        bool any = false;
        full_ = false;
        for (uint32_t n = 0; n < nics_.size(); n++) {
            auto& q = pending_[n];
            unsigned budget = 256;
            while (!q.empty() && budget--) {
                OpCtx* op = q.front();
                int rc = post(n, *op);
                if (rc == -EAGAIN) {
                    eagain_++;
                    full_ = true;
                    break;  // the NIC is full: poll, then retry
                }
                q.pop_front();
                any = true;
                if (rc != 0) {
                    bool unreachable = rc == -EHOSTUNREACH || rc == -ECONNREFUSED || rc == -ENOTCONN;
                    fail_op(*op, unreachable ? kPeerUnreachable : kTransport,
                            std::string("posting failed: ") + std::strerror(-rc));
                } else {
                    posted_++;
                }
            }
        }
        return any;
    }

    int post(uint32_t n, OpCtx& op) {
        Request& r = *op.request;
        if (op.kind == 1) {
            if (op.src == 0) {  // first attempt: take a bounce slot (none free: retry later)
                if (free_slots_.empty()) return -EAGAIN;
                op.src = uint64_t(free_slots_.back()) + 1;
                free_slots_.pop_back();
                std::memcpy(send_slot(op.src - 1), r.payload.data(), r.payload.size());
            }
            return nics_[n]->post_send(send_slot(op.src - 1), r.payload.size(), send_desc_, op.dst_off, &op);
        }
        Target& t = *r.targets[op.target];
        if (t.peers.size() != nics_.size()) t.peers.assign(nics_.size(), Target::kUnresolved);
        uint64_t& peer = t.peers[n];
        if (peer == Target::kUnresolved && !resolve(n, t.addresses[n], peer)) {
            peer = Target::kUnresolved;
            return -EHOSTUNREACH;
        }
        WriteOp w;
        w.src = reinterpret_cast<const void*>(op.src);
        w.len = op.len;
        w.desc = r.src_desc ? (*r.src_desc)[n] : nullptr;
        w.peer = peer;
        w.raddr = (nics_[n]->virt_addr() ? t.remote_base : 0) + op.dst_off;
        w.rkey = t.rkeys[n];
        w.has_imm = r.has_imm;
        w.imm = r.imm;
        return nics_[n]->post_write(w, &op);
    }

    struct Sink {
        Engine* self;
        uint32_t nic;
        void on_write_done(void* ctx) { self->finish_op(*static_cast<OpCtx*>(ctx)); }
        void on_send_done(void* ctx) { self->finish_op(*static_cast<OpCtx*>(ctx)); }
        void on_recv(void* ctx, size_t len) { self->got_message(*static_cast<OpCtx*>(ctx), len); }
        void on_imm(uint32_t imm) { self->imm_counts_[imm]++; }
        void on_error(void* ctx, int32_t status, const std::string& message) {
            if (ctx == nullptr) return;
            auto* op = static_cast<OpCtx*>(ctx);
            if (op->kind == 2) return;  // a receive flushed at close
            self->fail_op(*op, status, message);
        }
    };

    bool poll_all() {
        bool any = false;
        for (uint32_t n = 0; n < nics_.size(); n++) {
            Sink sink{this, n};
            if (nics_[n]->poll(sink) > 0) any = true;
        }
        return any;
    }

    void finish_op(OpCtx& op) {
        if (op.kind == 0) {
            completed_.fetch_add(1, std::memory_order_relaxed);
            bytes_.fetch_add(op.len, std::memory_order_relaxed);
        }
        settle(op);
    }

    void fail_op(OpCtx& op, int32_t status, const std::string& message) {
        Request& r = *op.request;
        if (r.status == kOk) {
            r.status = status;
            r.message = message;
        }
        settle(op);
    }

    void settle(OpCtx& op) {
        if (op.kind == 1 && op.src != 0) {  // the send's bounce slot is free again
            free_slots_.push_back(static_cast<uint32_t>(op.src - 1));
            op.src = 0;
        }
        Request& r = *op.request;
        inflight_--;
        if (--r.left == 0) {
            ready_.push_back(Completion{r.id, r.status, r.message});
            live_.erase(r.id);
        }
    }

    void got_message(OpCtx& op, size_t len) {
        messages_.emplace_back(recv_buf(op.src), len);
        nics_[0]->post_recv(recv_buf(op.src), max_send_, recv_desc_, &op);
    }

    void publish() {
        // Imms first, straight into the counter table: a thread blocked on a counter wakes
        // now, from this thread, not after a hand-off through Python.
        if (!imm_counts_.empty()) {
            counters_->add(imm_counts_, fired_);
            imm_counts_.clear();
        }
        if (ready_.empty() && fired_.empty() && messages_.empty()) return;
        more_coming_.store(inflight_ > 0, std::memory_order_relaxed);
        if (chaos_) {
            std::shuffle(ready_.begin(), ready_.end(), rng_);
            std::shuffle(fired_.begin(), fired_.end(), rng_);
        }
        {
            std::lock_guard<std::mutex> lock(out_mu_);
            for (auto& c : ready_) out_.done.push_back(std::move(c));
            out_.fired.insert(out_.fired.end(), fired_.begin(), fired_.end());
            for (auto& m : messages_) out_.messages.push_back(std::move(m));
        }
        if (drainers_.load(std::memory_order_seq_cst) == 0) out_cv_.notify_one();
        ready_.clear();
        fired_.clear();
        messages_.clear();
    }

    void drain_on_close() {
        // Give posted work a short grace period, then fail everything left.
        auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
        while (inflight_ > 0 && std::chrono::steady_clock::now() < deadline) {
            post_pending();
            poll_all();
        }
        for (auto& q : pending_) q.clear();
        for (auto& [id, r] : live_) ready_.push_back(Completion{id, kClosed, "engine closed with this transfer in flight"});
        live_.clear();
        inflight_ = 0;
        publish();
    }

    std::vector<std::unique_ptr<Domain>> nics_;
    std::shared_ptr<CounterTable> counters_;
    bool chaos_;
    std::mt19937_64 rng_;
    MpscQueue<Request> queue_;
    std::vector<std::deque<OpCtx*>> pending_;
    std::vector<std::unordered_map<std::string, uint64_t>> peers_;
    std::unordered_map<uint64_t, std::unique_ptr<Request>> live_;
    static constexpr size_t kCoalesce = 32;
    static constexpr size_t kInlineOps = 8;  // a submit posts at most this many WRs itself
    static constexpr std::chrono::microseconds kCoalesceWait{10};
    std::atomic<bool> more_coming_{false};  // work was in flight at the last publication
    size_t inflight_ = 0;
    bool full_ = false;  // the last posting pass met EAGAIN
    std::vector<Completion> ready_;
    std::unordered_map<uint32_t, uint64_t> imm_counts_;  // polled, not yet in counters_
    CounterTable::Tokens fired_;
    std::vector<std::string> messages_;
    size_t recv_depth_;
    size_t max_send_;
    char* recv_buf(size_t i) { return recv_arena_.data() + i * max_send_; }
    char* send_slot(size_t i) { return send_arena_.data() + i * max_send_; }
    static constexpr uint32_t kSendSlots = 64;
    std::vector<char> recv_arena_;
    std::vector<char> send_arena_;
    void* recv_desc_ = nullptr;
    void* send_desc_ = nullptr;
    std::vector<uint32_t> free_slots_;  // worker only
    std::vector<OpCtx> recv_ctx_;

    std::mutex out_mu_;
    std::condition_variable out_cv_;
    Batch out_;
    bool stopped_ = false;

    std::mutex wake_mu_;
    std::condition_variable wake_cv_;
    std::atomic<bool> sleeping_{false};
    std::mutex progress_mu_;      // held by whoever runs step(): the worker or a helper
    std::atomic<int> drainers_{0};  // threads in drain(): the completion thread is not woken
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> posted_{0}, completed_{0}, bytes_{0}, eagain_{0};
    std::thread worker_;
};

}  // namespace fabric
