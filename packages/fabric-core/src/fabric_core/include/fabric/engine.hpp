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
//   void remove_peer(uint64_t peer);                     // forget a lost peer (its connection
//                                                        // state), so a restarted process at
//                                                        // the same address is reached anew
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
//   bool stale_peers() const;                            // a connection the peer dropped may
//                                                        // look alive here until this side
//                                                        // sends on it (pokes, reset_path)
// Optionally:
//   size_t abort_path(const std::string& address);      // reset this NIC's connections to the
//                                                        // peer NIC at ``address``, so that the
//                                                        // provider fails what it holds for
//                                                        // them; how many (PathState::cut_until)
//   bool target_copies() const;                          // the target's own polls move the
//                                                        // bytes of writes to it (shm), so
//                                                        // its idle worker lingers (run())
//   size_t eager_write_max() const;                      // NIC 0: lone writes of up to this
//                                                        // many bytes go as eager frames
//                                                        // (Engine::post_eager); 0: none
//   bool nic_down() const;                               // a fault injected (tests): eager
//                                                        // writes are not sent, and their
//                                                        // acknowledgements are taken as lost
// Optionally, lists (OpCtx::pages; the CUDA IPC domain and fabric-efa's tcp domain have them):
//   size_t list_pages(uint64_t rkey) const;              // a paged request to rkey may come
//                                                        // as lists of at most this many pages
//                                                        // (0: not as lists; asked from any
//                                                        // thread)
//   int post_write_list(const WriteOp& w, const uint64_t* src, const uint64_t* dst, size_t n,
//                       void* ctx);                       // n writes of w.len bytes, src[i] to
//                                                        // w.raddr + dst[i], each with w's imm;
//                                                        // ctx reported once, for all of them
//                                                        // (-EAGAIN: none of them was posted)
// Sink callbacks: on_write_done(ctx), on_send_done(ctx), on_recv(ctx, len),
//                 on_imm(uint32_t imm, uint64_t src), on_imms(imm, src, count) (count of one
//                 imm), on_error(ctx, status, message);
//                 ``src`` is the sender's handle from insert_peer, or kNoSource.
// The engine calls insert_peer, remove_peer, post_*, and poll under its progress lock, one
// at a time (from the worker, a helping waiter or an inline submitter): a Domain needs no
// lock of its own between them. Only memory registration comes from other threads.
//
// Failure (docs/concepts/failures.md). Every request has a deadline (its own, or the engine
// default): past it, the request completes with kTimeout. A peer is lost when it leaves a
// liveness probe unanswered (or the provider refuses the probe outright): the worker pings,
// over the control channel, every peer that in-flight work or a counter waiter depends on and
// that has shown no sign of life for an interval, and at once a peer the transport failed a
// work request to (whose connection state it first resets: one bad key drops a tcp
// connection, and a peer is not dead for that). The peer's worker answers in C++ (no Python
// on either side). A lost peer fails every request to it with kPeerUnreachable, its counter
// waiters are failed (through Python: Batch::lost), and its address-vector entries are
// removed, so a restarted process at the same address is resolved anew. Hearing from a lost
// peer again (an answer, a message, a completed write) revives it. A request failed early
// (deadline, lost peer) stays in the live table, out of sight, until the provider has
// reported each of its posted work requests: their contexts live in it.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <map>
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

#include "closed.hpp"
#include "counters.hpp"
#include "cuda.hpp"
#include "mpsc_queue.hpp"
#include "reconcile.hpp"
#include "region_table.hpp"

#ifndef FABRIC_IDLE_SPIN_US
#define FABRIC_IDLE_SPIN_US 200  // the worker's idle polling before it naps (see Engine::run)
#endif
#ifndef FABRIC_STALL_SPIN_US
#define FABRIC_STALL_SPIN_US 200
#endif
#ifndef FABRIC_NAP_US
#define FABRIC_NAP_US 20
#endif
#ifndef FABRIC_STALL_NAP_US
#define FABRIC_STALL_NAP_US 160
#endif
#ifndef FABRIC_LINGER_US
#define FABRIC_LINGER_US 3  // an idle worker of a copying target polls on after work (Engine::run)
#endif
#ifndef FABRIC_SPINNER_NAP_US
#define FABRIC_SPINNER_NAP_US 500  // the worker's nap while a thread spins on a counter (Engine::defer)
#endif

namespace fabric {

// Every control frame starts [wire byte][type][address length][sender's NIC 0 address]. That
// prefix is the same in every fabric release, so that an engine can tell a frame it cannot
// read, and who sent it (got_message, got_foreign). The wire byte is 0x80 | the wire protocol
// version, which changes whenever the layout of any frame does, or the meaning of what a
// write carries (version 2: the upper 32 bits of a write's 64-bit remote CQ data count the
// pages it stands for, fabric-efa's lists on tcp; an engine of version 1 would count one);
// frames of fabric builds from before the wire byte start with their type, below 0x80.
inline constexpr uint8_t kWireVersion = 2;
inline constexpr char kWireByte = static_cast<char>(0x80 | kWireVersion);

// The type of a control frame that a domain, not the engine, sends to a peer engine's NIC 0
// (its only receives): fabric-efa's shm domain confirms the delivery of small writes with one
// (LibfabricDomain::post_markers). Three bytes: the wire byte, the type and an empty address.
// The engine takes it as it takes any frame of a type it does not know: it ignores it.
inline constexpr char kFrameDeliveryMarker = 11;
// The type of the answer to a frame of another wire version, fixed for every release like
// the prefix: [wire byte][kFrameForeign][address length][address][nonce: 0][the wire byte it
// could not read]. Its receiver learns from the prefix alone that the sender speaks another
// version; a frame of this type is never answered (Engine::got_foreign).
inline constexpr char kFrameForeign = 0x7f;

// A wire byte as people read it: "wire protocol 1", or a build from before the wire byte.
inline std::string wire_text(uint8_t byte) {
    if (byte & 0x80) return "wire protocol " + std::to_string(byte & 0x7f);
    return "no wire protocol version (a fabric build from before it, or not fabric)";
}

// Status codes handed to Python (mapped to the error tree there).
enum Status : int32_t {
    kOk = 0,
    kPeerUnreachable = 1,
    kRemoteAccess = 2,
    kTransport = 3,
    kClosed = 4,
    kTimeout = 5,
    kCancelled = 6,
    // From a domain only, never handed to Python: the provider cancelled the work request
    // because its connection went (libfabric's FI_ECANCELED). The engine takes it as
    // kPeerUnreachable, but first asks the target whether it refused the write (tcp drops
    // the connection over a refused key: Engine::check_access).
    kConnectionDropped = 7,
    // The peer speaks another wire protocol (kWireVersion): it does not answer this engine's
    // control frames, nor this engine its (PeerIncompatible in Python).
    kIncompatible = 8,
};

using Clock = std::chrono::steady_clock;

// A timed mutex taken by ``deadline`` (within ``wait``), or false. GCC 12's ThreadSanitizer
// does not intercept pthread_mutex_clocklock, which libstdc++'s try_lock_until / try_lock_for
// use on the steady clock: it would miss the acquisition and report races that are not. Built
// with TSan, the lock is taken by polling try_lock instead (which it sees).
template <class Lock>
bool lock_by(Lock& lock, Clock::time_point deadline) {
#if defined(__SANITIZE_THREAD__)
    while (!lock.try_lock()) {
        if (Clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
#else
    return lock.try_lock_until(deadline);
#endif
}

// A domain's poll reports an imm's source as the peer handle insert_peer gave for it, or
// this where it cannot tell (no FI_SOURCE, a source not in the address vector).
constexpr uint64_t kNoSource = ~uint64_t(0);

struct OpCtx;

// One path: this engine's NIC k to a peer's NIC k (k > 0: NIC 0's path carries the control
// channel and its failures are the peer's, see suspect()). Losing a path fails only its work
// requests, which are retried on the other NICs with the imms the target already counted
// reconciled first (docs/concepts/failures.md, "Losing a NIC"; fabric/reconcile.hpp).
struct PathState {
    Clock::time_point down_until{};  // avoided until then (its NIC failed work requests)
    size_t imm_busy = 0;             // WriteImms posted on it and not yet reported
    size_t busy = 0;                 // work requests posted on it and not yet reported
    uint32_t fails = 0;              // times it went down with no success since: each doubles
                                     // how long it is avoided, and a path that failed is given
                                     // up on sooner when tried again (stall_limit)
    Clock::time_point progress{};    // its last completion (or when it last became busy)
    std::vector<OpCtx*> failed;      // WriteImms lost with it, awaiting reconciliation
    // imm -> how many WriteImms of ended requests (cancelled, past their deadline) failed on
    // it after they were posted: not retried, but they may have landed and been counted, so
    // the next reconciliation counts them among the failed ones (or nothing else fits)
    std::map<uint32_t, uint64_t> ghosts;
    bool querying = false;           // a count query is out (nonces query_first .. query_nonce)
    uint64_t query_first = 0, query_nonce = 0;
    Clock::time_point query_sent{};
    PowerSums tx;  // as a sender: imms of this session's WriteImms that completed on it
    PowerSums rx;  // as a target: imms counted from this peer on it (FI_SOURCE)
    uint64_t unattributed_at_hello = 0;  // the NIC's unattributed imms when the peer said hello
    // Lost in silence (nic_loss_tick): until cut_until (while it is avoided), as long as work
    // requests are outstanding on it, its connections are reset every kCutEvery (the domain's
    // abort_path), so that a provider that holds them while TCP retransmits gives them up.
    Clock::time_point cut_until{};
    Clock::time_point cut_last{};
};

// What the worker knows of one remote engine (keyed by its NIC 0 address).
struct PeerState {
    std::string address;                 // NIC 0's address
    std::vector<std::string> nic_addrs;  // per NIC, as learned from targets ("" unknown)
    Clock::time_point heard{};           // last sign of life (answer, message, completed write)
    Clock::time_point probe_sent{};      // the outstanding probe's send time (epoch: none)
    bool probe_posted = false;           // the probe due since probe_sent is on the wire
    Clock::time_point probe_again{};     // when it was last asked (asked again every interval)
    Clock::time_point last_wanted{};     // the last liveness tick that some work depended on it
    uint64_t probes = 0;                 // probes sent
    bool lost = false;
    bool wanted = false;                 // scratch of the liveness tick
    bool touched = false;                // probe_peer() asked for a probe
    uint64_t answered = 0;               // the highest probe nonce it answered
    // NIC-loss bookkeeping (several NICs). A session starts with a hello telling the peer
    // this engine's NIC addresses, so that it attributes every imm it counts from them to
    // this engine; WriteImms to the peer use NICs > 0 only once the hello is answered.
    std::vector<PathState> paths;        // per NIC
    uint64_t session = 0;                // as a sender: the hello's nonce (0: none yet)
    bool session_ok = false;             // its answer came
    uint64_t peer_incarnation = 0;       // from the answer: a restart shows as a new one
    // Its receive buffers: the largest frame it takes, as its answers to pings say (0: not
    // known yet), and when this engine last asked (a message larger than kFrameFloor waits
    // for it: Engine::sized).
    uint64_t frame = 0;
    Clock::time_point frame_asked{};
    Clock::time_point hello_sent{};
    uint64_t rx_session = 0;             // as a target: the session its rx sums belong to
    // traffic to it (stats): writes completed, their bytes, writes failed, writes posted and
    // not reported yet
    uint64_t wrs = 0, bytes = 0, errors = 0, inflight = 0;
    // writes posted and not reported since it was last evicted: what the queue-depth cap
    // (configure_queue) holds down. Kept apart from ``inflight`` (a stat), and zeroed when the
    // peer is evicted, so writes a lost peer never reports cannot cap its next incarnation.
    uint64_t queued = 0;
    uint64_t queued_bytes = 0;  // their bytes (the queue depth's byte allowance)
    uint64_t queued_lists = 0;  // list ops among them (they leave no room for the allowance)
    // The same writes counted for the process (fabric/closed.hpp, InboundWrites: a peer of
    // this process that closes waits until they are reaped), never zeroed by an eviction, and
    // the process-wide counter of the peer's address they are part of.
    uint64_t posted_here = 0;
    std::shared_ptr<std::atomic<int64_t>> inbound;
    // whether the address is an engine's of this process (LocalEndpoints), as of local_epoch:
    // only writes to those are counted in ``inbound``
    bool local = false;
    uint64_t local_epoch = 0;
};

// One NIC's traffic (stats): bumped by whoever runs progress (one thread at a time, under
// the progress lock), read by any thread without stopping it.
struct NicTraffic {
    std::atomic<uint64_t> wrs{0}, bytes{0}, errors{0}, retries{0}, inflight{0}, imms{0};
    static void bump(std::atomic<uint64_t>& c, uint64_t n = 1) { c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
    static void drop(std::atomic<uint64_t>& c) {
        uint64_t v = c.load(std::memory_order_relaxed);
        if (v > 0) c.store(v - 1, std::memory_order_relaxed);
    }
};
struct NicTrafficView {
    uint64_t wrs, bytes, errors, retries, inflight, imms;
};
struct PeerTrafficView {
    std::string address;
    uint64_t wrs, bytes, errors, inflight;
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
    // one of several work requests of its request (a domain may post it otherwise: fabric-efa
    // puts such small writes on shm under delivery markers, and a lone one not)
    bool batch = false;
};

// A destination region. Shared by every request to it; ``peers`` caches the resolved peer
// handle per NIC and is touched by the worker only.
struct Target {
    std::vector<std::string> addresses;  // per NIC
    std::vector<uint64_t> rkeys;         // per NIC
    uint64_t remote_base = 0;            // the descriptor's ptr
    std::vector<uint64_t> peers;         // per NIC, kUnresolved until the worker resolves it
    PeerState* state = nullptr;          // the peer's liveness state (worker only)
    uint64_t epoch = 0;                  // the engine's peer epoch ``peers`` was resolved in
    uint64_t closed_epoch = 0;           // the ClosedSet epoch ``closed`` was read at (worker only)
    bool closed = false;                 // addresses[0] is an endpoint closed in this process
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
    int kind = 0;  // 0 write, 1 send, 2 recv, 3 probe or answer (no request)
    enum : uint8_t { kQueued = 0, kPosted = 1, kSettled = 2 };
    uint8_t state = kQueued;  // for diagnostics (Engine::dump)
    // a retry after a lost NIC: kAsPlanned, kBytesOnly (the bytes again, no imm), kImmOnly
    // (a make-up imm once the bytes are in place)
    enum : uint8_t { kAsPlanned = 0, kBytesOnly = 1, kImmOnly = 2 };
    uint8_t mode = kAsPlanned;
    bool carrier = false;             // a bytes-only retry that then carries a make-up imm
    struct RetryBatch* retry = nullptr;  // the reconciliation it is a bytes-only retry of
    uint32_t posts = 0;               // times posted (fence(): which posting it waits for)
    bool queued = false;              // posted and counted in its peer's ``queued`` (queue depth)
    bool inbound = false;             // posted and counted in its peer's ``posted_here``
    // The domain's own, from post_write of a write until its poll reports it (the engine never
    // touches them): fabric-efa's shm domain keeps the region-table hold the write took there.
    void* domain_word = nullptr;
    size_t domain_index = 0;
    // The domain's own too: fabric-efa's shm domain marks a small write whose completion it
    // holds back until a delivery marker posted after it completes (kFrameDeliveryMarker).
    uint64_t domain_peer = 0;
    // A list op (pages > 0): ``pages`` writes of ``len`` bytes each, from the request's
    // list_src[first_page + i] to list_dst[first_page + i], handed to the domain in one
    // post_write_list and reported once, as one work request of the engine (see Request). Made
    // only where the domain takes lists for the target (list_pages: the CUDA IPC domain's
    // copies, whose pages one kernel launch moves and whose imms one inbox record counts; tcp's
    // writes of several pages, one imm standing for them all) and
    // only on NIC 0, whose work requests are never retried on another NIC one by one.
    uint32_t pages = 0;
    uint32_t first_page = 0;
};

// The most pages of one list op (OpCtx::pages), whatever the domain takes.
inline constexpr size_t kMaxListPages = 2048;

// A domain's lists, where it has them (list_pages, post_write_list: see the top of this file);
// shared by the engine and by domains that wrap another (fabric/cuda_ipc.hpp).
template <class D>
auto domain_list_pages(const D& d, uint64_t rkey, int) -> decltype(size_t(d.list_pages(rkey))) {
    return d.list_pages(rkey);
}
template <class D>
size_t domain_list_pages(const D&, uint64_t, long) {
    return 0;
}
template <class D>
auto domain_post_list(D& d, const WriteOp& w, const uint64_t* src, const uint64_t* dst, size_t n, void* ctx, int)
    -> decltype(int(d.post_write_list(w, src, dst, n, ctx))) {
    return d.post_write_list(w, src, dst, n, ctx);
}
template <class D>
int domain_post_list(D&, const WriteOp&, const uint64_t*, const uint64_t*, size_t, void*, long) {
    return -ENOSYS;  // (the domain's list_pages said 0: never asked)
}

// Work requests an op stands for (a list op: its pages) and the bytes it moves.
inline uint64_t op_wrs(const OpCtx& op) { return op.pages ? op.pages : 1; }
inline uint64_t op_bytes(const OpCtx& op) { return op.mode == OpCtx::kImmOnly ? 0 : op.len * op_wrs(op); }

// The bytes-only retries of one reconciliation: the make-up imms go once all have landed.
struct RetryBatch {
    size_t left = 0;
    std::vector<OpCtx*> carriers;
};

struct Request {
    uint64_t id = 0;
    bool has_imm = false;
    uint32_t imm = 0;
    std::shared_ptr<const std::vector<void*>> src_desc;  // per NIC; null: no source (imm-only)
    std::vector<std::shared_ptr<Target>> targets;
    std::vector<OpCtx> ops;
    // The pages of its list ops (OpCtx::pages): source addresses and destination offsets.
    std::vector<uint64_t> list_src, list_dst;
    // Work requests it stands for: ops.size(), plus each list op's pages beyond the first.
    size_t list_extra = 0;
    size_t wrs() const { return ops.size() + list_extra; }
    // two-sided send: the payload is copied into a registered bounce slot when posted
    std::string payload;
    std::string send_to;
    bool resolve_only = false;  // complete once send_to resolves on NIC 0 (peer groups)
    double timeout_s = -1;      // deadline after intake; negative: the engine default
    // progress
    size_t left = 0;
    int32_t status = kOk;
    std::string message;
    Clock::time_point started{}, deadline{};
    bool abandoned = false;  // completed early (deadline, lost peer): its WRs are still out
    int32_t fail_nic = -1;   // the NIC of the first failed WR
};

struct Completion {
    uint64_t id;
    int32_t status;
    std::string message;
    std::string peer;  // failures: the peer involved (NIC 0 address), if known
    int32_t nic = -1;  // failures: the local NIC involved, if one
};

// A peer the engine declared lost: its counter waiters fail (through Python) with ``status``,
// kPeerUnreachable, or kIncompatible for one that speaks another wire protocol.
struct LostPeer {
    std::string peer;  // NIC 0 address
    std::string why;
    int32_t status;
};

struct Batch {
    std::vector<Completion> done;
    std::vector<uint64_t> fired;  // tokens of counter waiters (asyncio, expect) the imms fired
    std::vector<std::string> messages;
    std::vector<LostPeer> lost;                              // fail its waiters
    std::vector<std::string> revived;                        // lost peers heard from again
    bool empty() const {
        return done.empty() && fired.empty() && messages.empty() && lost.empty() && revived.empty();
    }
};

// Hang diagnostics (Engine::dump).
struct RequestView {
    uint64_t id;
    double age_s;
    double deadline_in_s;
    size_t ops, left, unposted;
    std::vector<size_t> left_per_nic;
    std::vector<std::string> peers;  // NIC 0 addresses of its targets (or the send's peer)
    bool has_imm;
    uint32_t imm;
    bool abandoned;
};
struct PeerView {
    std::string address;
    double heard_s_ago;  // negative: never
    double probe_out_s;  // negative: no probe outstanding
    uint64_t probes;
    bool lost;
    std::string session;           // NIC-loss session: none, hello sent, reconcilable (answered)
    std::vector<size_t> down_nics;  // NICs whose path to it is avoided now
};
struct AccessCheckView {  // a question out to a target (Engine::check_access)
    std::string peer;       // its NIC 0 address
    uint32_t nic;
    uint64_t key;
    double age_s;           // since the first write it holds failed
    size_t writes;          // the failed writes held on its answer
};
struct EngineDump {
    std::vector<RequestView> requests;
    std::vector<PeerView> peers;
    std::vector<AccessCheckView> access_checks;
    // senders heard speaking another wire protocol (Engine::got_foreign): address, wire byte
    std::vector<std::pair<std::string, uint8_t>> foreign;
    size_t inflight_wrs = 0;
    std::vector<size_t> unposted_per_nic;
    uint64_t pokes_sent = 0;  // see Engine::poke
    uint64_t paths_cut = 0;   // connections reset on paths lost in silence (PathState::cut_until)
    size_t eager_waiting = 0;  // eager writes sent and waiting for their acknowledgement
    size_t acks_due = 0;       // as a target: eager writes applied, their acknowledgements not yet sent
    // per NIC (0 for NIC 0): imms its domain reported without a source, and imms no sender's
    // counts took (Engine::attribute)
    std::vector<uint64_t> imms_without_source, imms_unattributed;
    int counter_spinners = 0;  // threads spinning on a counter now (Engine::spinning)
    int drainers = 0;          // threads draining their transfers now (Engine::drain)
    bool worker_deferring = false;  // the worker naps while a spinner runs the steps (Engine::defer)
    uint64_t spinner_wakes = 0;     // times the last spinner to stop handed progress back to it
                                    // (work in flight, or a waiter gone to sleep: Engine::spinning)
    uint64_t worker_naps = 0;     // naps the worker took, idle or on stalled work (Engine::run)
    uint64_t provider_steps = 0;  // steps that completed nothing but moved bytes in the
                                  // provider, so counted as work (Engine::provider_worked)
    uint64_t worker_yields = 0;   // yields of the CPU the worker made (Engine::run)
    uint64_t lone_yields = 0;     // of them, those no other thread took the CPU in (yield_alone)
    // >= 0: the progress lock stayed taken (a provider call that does not return, see
    // Engine::close) and the rest is empty; how long the step holding it has run, in seconds
    double progress_stuck_s = -1.0;
};

struct EngineStats {
    uint64_t posted = 0;
    uint64_t completed_wrs = 0;  // writes that completed successfully
    uint64_t bytes_written = 0;  // their bytes
    uint64_t eagain = 0;
    uint64_t probes = 0;       // liveness probes sent
    uint64_t peers_lost = 0;
    uint64_t timeouts = 0;     // requests failed at their deadline
    uint64_t retries = 0;      // work requests retried on another NIC after theirs was lost
    uint64_t reconciled = 0;   // lost WriteImms settled by the target's counts
    uint64_t landed_unacked = 0;  // of those: counted at the target although they failed here
    uint64_t makeups = 0;      // imm-only writes posted for lost WriteImms that had not landed
    uint64_t unreconciled = 0;    // lost WriteImms failed: the counts could not tell
    uint64_t eager_writes = 0;    // writes sent as eager frames (Engine::post_eager)
    uint64_t eager_landed = 0;    // as a target: eager writes it applied
    uint64_t frames_truncated = 0;  // control frames larger than this engine's receive buffers
    uint64_t frames_foreign = 0;    // control frames of another wire protocol, dropped (got_foreign)
    uint64_t list_ops = 0;          // list ops posted (OpCtx::pages: several pages a work request)
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
          parked_(nics_.size()),
          park_served_(nics_.size(), 0),
          peers_(nics_.size()),
          recv_depth_(recv_depth),
          max_send_(max_send),
          frame_(std::max(max_send + kUserHead, kFrameFloor)) {
        // Control messages move through registered buffers on NIC 0: receive buffers, and a
        // pool of send slots the payloads are copied into when posted (FI_MR_LOCAL).
        // Every control frame starts with the wire byte and a type byte (kWireByte, kFrameUser...).
        recv_arena_.resize(recv_depth_ * frame_);
        send_arena_.resize(kSendSlots * frame_);
        recv_desc_ = nics_[0]->local_desc(recv_arena_.data(), recv_arena_.size());
        send_desc_ = nics_[0]->local_desc(send_arena_.data(), send_arena_.size());
        for (uint32_t i = kSendSlots; i > 0; i--) free_slots_.push_back(i - 1);
        recv_ctx_.resize(recv_depth_);
        for (size_t i = 0; i < recv_depth_; i++) {
            recv_ctx_[i].kind = 2;
            recv_ctx_[i].src = i;
            int rc = nics_[0]->post_recv(recv_buf(i), frame_, recv_desc_, &recv_ctx_[i]);
            if (rc != 0) throw std::runtime_error("posting control receive buffers failed: " + std::to_string(rc));
        }
        traffic_.reset(new NicTraffic[nics_.size()]);
        poke_frame_.assign(nics_.size(), kFramePoke);  // registered at a NIC's first poke
        poke_desc_.assign(nics_.size(), nullptr);
        poke_ready_.assign(nics_.size(), 0);
        self_address_ = nics_[0]->address();
        LocalEndpoints::instance().add(self_address_);
        {  // eager writes: what NIC 0's domain allows, as far as a frame holds it
            const size_t head = frame_head() + kEagerHead;
            eager_max_ = std::min({eager_max_of(*nics_[0], 0), frame_ - head, kEagerLimit});
        }
        attrib_.resize(nics_.size());
        unattributed_.assign(nics_.size(), 0);
        nic_sender_.assign(nics_.size(), nullptr);
        sourceless_.assign(nics_.size(), 0);
        nic_shared_.assign(nics_.size(), 0);
        incarnation_ = std::random_device{}() | (uint64_t(std::random_device{}()) << 32) | 1;
        worker_ = std::thread([this, cpu] { run(cpu); });
        counters_->set_progress([this] { return help(); }, Clock::time_point::max(),
                                [this](CounterTable::SpinEvent e) { spinning(e); });
    }

    // The domains go first: a provider may still hold the contexts of work requests that never
    // completed (FI_CONTEXT2: its own bookkeeping lives in them), inside requests of live_ and
    // probe_ctx_, so those must outlive every fi_close.
    //
    // A wedged engine (close() returned false) must not be destroyed while the thread stuck in
    // the provider can still return into it: owners leak it (PyEngine does). Destroying one
    // anyway waits here until its worker has left.
    ~Engine() {
        close();
        if (wedged_.load()) {
            std::unique_lock<std::mutex> lock(exit_mu_);
            exit_cv_.wait(lock, [this] { return exited_; });
        }
        if (worker_.joinable()) worker_.join();
        nics_.clear();
        LocalEndpoints::instance().remove(self_address_);
    }

    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    size_t num_nics() const { return nics_.size(); }
    // The largest write sent as an eager frame (post_eager; 0: none): NIC 0's domain's limit,
    // as far as this engine's frames hold it.
    size_t eager_max() const { return eager_max_; }
    Domain& nic(size_t i) { return *nics_.at(i); }
    CounterTable& counters() { return *counters_; }

    // The regions this engine's registrations open to remote writes, per NIC key, addressed as
    // writes to them address them (from the region's start where the NIC addresses remote
    // memory virtually, else from 0). A writer whose write a transport failed without saying
    // why (tcp drops the connection on a refused key) asks whether this engine would have
    // taken it (check_access). Registration calls these, from any thread.
    void note_region(uint32_t nic, uint64_t key, uint64_t ptr, uint64_t len, bool writable) {
        if (nic >= nics_.size()) return;
        uint64_t base = nics_[nic]->virt_addr() ? ptr : 0;
        // (NIC 0: eager writes to it are copied by this engine, into host memory only)
        bool host = nic != 0 || !cuda::is_device_pointer(reinterpret_cast<const void*>(ptr));
        std::lock_guard<std::mutex> lock(access_mu_);
        if (access_.size() < nics_.size()) access_.resize(nics_.size());
        access_[nic][key] = AccessEntry{base, len, writable, ptr, host};
    }

    void forget_region(uint32_t nic, uint64_t key) {
        std::lock_guard<std::mutex> lock(access_mu_);
        if (nic < access_.size()) access_[nic].erase(key);
    }

    // Whether a submit of ``ops`` work requests would now post them from the calling thread
    // (the worker naps). A post is a provider call, and on shm one can spin on the peer's
    // queue lock for as long as the peer holds it: forever if the peer was killed holding it.
    // A caller holding a lock that others need meanwhile (Python's GIL) releases it first,
    // or passes ``inline_ok = false`` to have the worker woken instead.
    bool would_post_inline(size_t ops) const {
        return ops <= kInlineOps && sleeping_.load(std::memory_order_seq_cst);
    }

    void submit(std::unique_ptr<Request> req, bool inline_ok = true) {
        bool small = req->wrs() <= kInlineOps;
        queue_.push(std::move(req));
        if (!sleeping_.load(std::memory_order_seq_cst)) return;  // the worker will take it
        if (small && inline_ok) {
            // The worker is napping: post from this thread rather than pay for waking it (it
            // comes back within a nap to poll what is now in flight).
            std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
            if (lock.owns_lock() && !stop_.load(std::memory_order_acquire)) {
                InProgress timed(progress_since_ns_);
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
        std::unique_lock<std::timed_mutex> lock(progress_mu_, std::try_to_lock);
        if (!lock.owns_lock() || stop_.load(std::memory_order_acquire)) return false;
        return step();
    }

    // A thread that waits on a counter starts (true) or stops spinning through help(). While
    // one spins, completions are not handed to the completion thread at once: that thread
    // would take the GIL for them just as the waiter returns to Python and needs it, and the
    // waiter would sleep until it is given back (a wake-up: tens of microseconds on a host
    // with idle cores; the imm round trip on shm on a 16-core host went from a median of
    // about 28 us to 15-18 us without it). The waiter usually goes on to wait on the
    // transfer whose completion that was, and drain() hands it over on its own thread.
    // Otherwise the worker hands them to the completion thread kHandOffGrace after they were
    // published once no thread spins, and after kHandOffMax whatever spins (hand_off_held).
    //
    // While one spins, the worker also steps aside (Engine::run): the spinner runs progress
    // steps itself, and a second thread polling the same queues only takes the progress lock
    // from it, and on a host with fewer cores than busy threads its CPU too (each of its
    // yields there is a context switch between it and the spinner). The last spinner to stop
    // wakes it where something is left for it: work in flight, a waiter that now sleeps
    // (kSpinBlocks), or any other waiter or GPU mirror in the counter table, whose imms need
    // polling. One that stops satisfied with none of those does not: it is on its way back to
    // Python, and a wake-up would cost it a system call and, on a busy host, its CPU; the
    // worker comes back from its nap (kSpinnerNap) on its own.
    void spinning(CounterTable::SpinEvent event) {
        if (event == CounterTable::kSpinStart) {
            spinners_.fetch_add(1, std::memory_order_seq_cst);
            return;
        }
        if (spinners_.fetch_sub(1, std::memory_order_seq_cst) != 1) return;
        if (event != CounterTable::kSpinBlocks && !work_left_.load(std::memory_order_relaxed) && queue_.empty() &&
            counters_->watched() == 0)
            return;
        spinner_wakes_.fetch_add(1, std::memory_order_relaxed);  // (handed back: dump)
        if (!deferring_.load(std::memory_order_seq_cst)) return;
        std::lock_guard<std::mutex> lock(wake_mu_);
        wake_cv_.notify_one();
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
        if (!b.empty()) in_hand_.fetch_add(1, std::memory_order_seq_cst);
        return b;
    }

    // The completion thread has handed a non-empty batch of wait_batch() to Python.
    void batch_done() { in_hand_.fetch_sub(1, std::memory_order_seq_cst); }

    // For a thread that waits on a transfer: run progress steps and take the completions that
    // are published, up to ``timeout_s``; returns them (maybe none). While a thread drains, the
    // completion thread is not woken for new completions: the drainer hands them to Python
    // itself, so a transfer's completion reaches the thread that waits on it with no thread
    // switch and no GIL hand-off in between. Whatever is published as it leaves goes to the
    // completion thread as usual. It returns (empty) at once while the completion thread holds
    // a batch it has not handed to Python yet, which may hold the very completion the drainer
    // waits for (that thread was awake already, or took it just before): the caller then
    // waits for that thread to hand it over, instead of draining on until its timeout (up to
    // 2 ms per wait, seen in the MoE steps on an H200 host).
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
            if (stop_.load(std::memory_order_acquire) || Clock::now() >= deadline ||
                in_hand_.load(std::memory_order_seq_cst) > 0)
                break;
            if (!worked && ++idle % 8 == 0) std::this_thread::yield();
        }
        drainers_.fetch_sub(1, std::memory_order_seq_cst);
        wake_for_leftovers();
        return b;
    }

    // Wakes the completion thread if completions wait in out_: those a drainer left as it
    // went, or those held back for a spinner (hand_off_held).
    void wake_for_leftovers() {
        bool left;
        {
            std::lock_guard<std::mutex> lock(out_mu_);
            left = !out_.empty();
        }
        if (left) out_cv_.notify_one();
    }

    // Stops the worker and waits for it (and for waiters inside progress) at most
    // ``join_timeout_s`` (negative: for ever). Returns true once they have left; false if one
    // is still inside a provider call past the bound: the engine is then *wedged*. On shm a
    // post spins on the peer's queue lock, for good if that peer was killed holding it, and
    // nothing in this process can make it return. A wedged engine's worker is detached; it
    // stops for good, publishes nothing more, and wait_batch() returns at once, so the
    // caller fails what was in flight itself. Its endpoints and registrations must stay as
    // they are (the stuck call may use them) and the engine must not be destroyed: its owner
    // leaks it, and the process can still exit.
    // Idempotent; a second caller (the destructor, another thread) returns only once the
    // first is done, so the engine is never destroyed under a closing thread.
    bool close(double join_timeout_s = -1.0) {
        std::lock_guard<std::mutex> closing(close_mu_);
        auto deadline = join_timeout_s < 0 ? Clock::time_point::max()
                                           : Clock::now() + to_duration(std::min(join_timeout_s, 1e6));
        // waiters stop helping (and those inside are waited for, up to the bound)
        bool helpers_out = counters_->set_progress(nullptr, deadline);
        if (stop_.exchange(true)) return !wedged_.load();
        {
            std::lock_guard<std::mutex> lock(wake_mu_);
            wake_cv_.notify_all();
        }
        bool exited;
        {
            std::unique_lock<std::mutex> lock(exit_mu_);
            if (join_timeout_s < 0) {
                exit_cv_.wait(lock, [this] { return exited_; });
            } else {
                exit_cv_.wait_until(lock, deadline, [this] { return exited_; });
            }
            exited = exited_;
        }
        if (exited) {
            worker_.join();
        } else if (worker_.joinable()) {
            worker_.detach();  // still inside the provider: it may never come back
        }
        if (!exited || !helpers_out) wedged_.store(true);
        {
            std::lock_guard<std::mutex> lock(out_mu_);
            stopped_ = true;
        }
        out_cv_.notify_all();
        return !wedged_.load();
    }

    // close() found a thread stuck inside the provider (see close()).
    bool wedged() const { return wedged_.load(); }

    EngineStats stats() const {
        EngineStats s;
        s.posted = posted_.load();
        s.completed_wrs = completed_.load();
        s.bytes_written = bytes_.load();
        s.eagain = eagain_.load();
        s.probes = probes_.load();
        s.peers_lost = peers_lost_.load();
        s.timeouts = timeouts_.load();
        s.retries = retries_.load();
        s.reconciled = reconciled_.load();
        s.landed_unacked = landed_unacked_.load();
        s.makeups = makeups_.load();
        s.unreconciled = unreconciled_.load();
        s.eager_writes = eager_writes_.load();
        s.eager_landed = eager_landed_.load();
        s.frames_truncated = frames_truncated_.load();
        s.frames_foreign = frames_foreign_.load();
        s.list_ops = list_ops_.load();
        return s;
    }

    // Per NIC: writes completed, bytes, writes failed, of those retried, writes in flight,
    // imms counted that arrived on it. Lock-free.
    std::vector<NicTrafficView> nic_traffic() const {
        std::vector<NicTrafficView> out;
        for (size_t n = 0; n < nics_.size(); n++) {
            const NicTraffic& t = traffic_[n];
            out.push_back(NicTrafficView{t.wrs.load(), t.bytes.load(), t.errors.load(), t.retries.load(),
                                         t.inflight.load(), t.imms.load()});
        }
        return out;
    }

    // Per peer written to (by its NIC 0 address). Takes the progress lock (briefly); empty if
    // it stays taken (a wedged worker: see dump()).
    std::vector<PeerTrafficView> peer_traffic() {
        std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
        std::vector<PeerTrafficView> out;
        if (!take_progress(lock, Clock::now() + kDiagnosticWait)) return out;
        for (const auto& [addr, p] : peer_state_)
            if (p.wrs + p.errors + p.inflight > 0) out.push_back(PeerTrafficView{addr, p.wrs, p.bytes, p.errors, p.inflight});
        return out;
    }

    // Failure detection: probe a peer that work depends on after ``interval_s`` without a sign
    // of life (0: never probe), declare it lost when a probe stays unanswered ``timeout_s``;
    // requests with no deadline of their own complete with kTimeout ``transfer_timeout_s``
    // after intake (infinite: never).
    void configure_liveness(double interval_s, double timeout_s, double transfer_timeout_s) {
        std::lock_guard<std::timed_mutex> lock(progress_mu_);
        probe_interval_ = interval_s > 0 ? to_duration(interval_s) : Clock::duration::max();
        probe_timeout_ = to_duration(timeout_s);
        default_timeout_s_ = transfer_timeout_s;
    }

    // Queue depth: at most ``per_peer_and_nic`` writes posted and not yet reported per peer
    // and NIC (a peer reached over k NICs: k times that), 0 for as many as the provider takes.
    // Writes past it wait in the engine, parked per peer like those a full provider queue
    // refuses, so the other peers' traffic goes on. On shm a sender that keeps the target's
    // whole queue (1,024 commands) full spins on the target's lock for every post while the
    // target copies: a KV transfer of 64 KiB writes ran 6.5% faster held to 256, an RL
    // update ~40% faster held to 2 (docs/backends/efa.md, "Queue depth").
    //
    // ``bytes_per_peer_and_nic`` (0: none) lets small writes go deeper than that: past the
    // depth, a write is posted still while the peer's posted writes and it come to at most that
    // many bytes, and no other peer has writes posted (over_queue_depth). What the depth holds
    // down on shm is the time a post spins on a target copying its queue, which is the
    // queue's bytes, not its count: 2 writes of an RL update's megabytes, but 64 of 64 KiB. A
    // single 64 KiB stream held to 2 left the target idle between refills (4.2-5.0 GB/s
    // against 8.9-13.4 at a depth of 64, 2-core host).
    void configure_queue(uint64_t per_peer_and_nic, uint64_t bytes_per_peer_and_nic = 0) {
        std::lock_guard<std::timed_mutex> lock(progress_mu_);
        queue_cap_ = per_peer_and_nic;
        queue_bytes_ = bytes_per_peer_and_nic;
    }

    // Cancels request ``id``: it completes now with kCancelled and none of its queued work
    // requests is posted (those posted are reaped as the provider reports them). Returns
    // whether it was still running, and the peers (NIC 0 addresses) it was writing to: the
    // caller fences them (fence()) to know that nothing of it can land any more. Any thread.
    // Waits for the progress lock at most ``timeout_s`` (negative: for ever), then throws
    // std::runtime_error having cancelled nothing: a worker holding it that long is stuck
    // inside the provider (wedged, see close()).
    bool cancel(uint64_t id, std::vector<std::string>& peers, double timeout_s = -1.0) {
        std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
        if (timeout_s < 0) {
            lock.lock();
        } else if (!take_progress(lock, Clock::now() + to_duration(std::min(timeout_s, 1e6)))) {
            throw std::runtime_error("the engine's progress has been inside a provider call for " +
                                     std::to_string(stalled_for()).substr(0, 6) +
                                     " s (a wedged engine); nothing was cancelled");
        }
        now_ = Clock::now();
        intake();  // it may still be in the submission queue
        auto it = live_.find(id);
        if (it == live_.end() || it->second->abandoned) return false;
        Request& r = *it->second;
        if (!r.send_to.empty()) {
            peers.push_back(r.send_to);
        } else {
            for (const auto& t : r.targets)
                if (!t->addresses.empty() && std::find(peers.begin(), peers.end(), t->addresses[0]) == peers.end())
                    peers.push_back(t->addresses[0]);
        }
        abandon(r, kCancelled, "cancelled");
        publish();
        return true;
    }

    // Waits until each peer (NIC 0 address) has answered a probe sent now, and every write
    // this engine had posted to it, on any NIC, has been reported. The answer travels behind
    // every byte that peer posted to this engine before it on NIC 0's stream; a write on
    // another NIC has its own stream, but a write is reported only once it has landed
    // (delivery complete) or failed. So once both are in, each write this engine had under
    // way to the peer has been processed there (landed, or refused by the keys), and with a
    // key revoked first, nothing of those writes can land after this returns (a write
    // retried after a lost NIC is posted anew: the revoked key refuses it). Returns the peers
    // that did not confirm within ``timeout_s``, or sooner: once kForeignGrace has passed and
    // every peer left is one heard speaking another wire protocol (got_foreign), which never
    // answers. Any thread but the worker.
    std::vector<std::string> fence(const std::vector<std::string>& addresses, double timeout_s) {
        const auto began = Clock::now();
        auto deadline = began + to_duration(std::min(std::max(timeout_s, 0.0), 1e6));
        uint64_t nonce;
        std::vector<std::string> left(addresses);
        std::vector<Posting> posted;  // the writes under way now, to any of ``addresses``
        {
            // bounded: a wedged worker (see close()) holds this lock for good
            std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
            if (!take_progress(lock, deadline)) return left;
            nonce = ++fence_nonce_;
            now_ = Clock::now();
            for (const auto& a : addresses) {
                state_for(a);  // its answer is recorded there
                fences_.push_back(Fence{a, nonce});
            }
            posted = postings_to(addresses, 0);
        }
        bool stuck = false;
        while (true) {
            {
                std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
                if (!take_progress(lock, deadline)) {
                    stuck = true;
                    break;
                }
                now_ = Clock::now();
                step();
                posted.erase(std::remove_if(posted.begin(), posted.end(),
                                            [&](const Posting& w) { return reported(w); }),
                             posted.end());
                std::vector<std::string> still;
                for (const auto& a : left) {
                    auto it = peer_state_.find(a);
                    bool writing = std::any_of(posted.begin(), posted.end(),
                                               [&](const Posting& w) { return w.peer == a; });
                    if (it == peer_state_.end() || it->second.answered < nonce || writing) still.push_back(a);
                }
                left.swap(still);
                if (!left.empty() && now_ - began >= kForeignGrace &&
                    std::all_of(left.begin(), left.end(), [&](const std::string& a) { return foreign_wire(a) != 0; }))
                    break;
            }
            if (left.empty() || Clock::now() >= deadline || stop_.load()) break;
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
        if (stuck && !take_progress(lock, Clock::now() + kDiagnosticWait)) {  // the worker drops its entry at its next tick
            std::lock_guard<std::mutex> dropped(dropped_mu_);
            dropped_fences_.push_back(nonce);
            return left;
        }
        if (!lock.owns_lock()) lock.lock();
        fences_.erase(std::remove_if(fences_.begin(), fences_.end(), [&](const Fence& f) { return f.nonce == nonce; }),
                      fences_.end());
        return left;
    }

    // Someone wants to know whether ``address`` is alive again (a wait named it while it was
    // lost): probe it at the next tick, so that an answer revives it. Any thread.
    void probe_peer(const std::string& address) {
        std::lock_guard<std::mutex> lock(touch_mu_);
        touched_.push_back(address);
    }

    // Makes this engine write ``byte`` as its wire byte, and read only frames that carry it:
    // an engine of another fabric release, for tests of mixed releases. Any thread.
    void speak_wire(uint8_t byte) { wire_.store(static_cast<char>(byte), std::memory_order_relaxed); }

    // Seconds the progress now running (a step, or a submit posting inline) has been at it;
    // 0 when none runs: how long a wedged worker has been stuck (dump(), cancel()). Read
    // without the progress lock, so a thread that watches the engine can tell a worker stuck
    // inside a provider call (on shm, a post to a peer killed while it held its queue lock
    // never returns) from an idle one. The Python side closes an
    // engine whose progress it sees inside one step for liveness_timeout_s (EngineWedged),
    // counting only time it was awake to watch (progress_since()): a process stopped as a
    // whole (SIGSTOP, a debugger) comes back mid-step without being stuck.
    double stalled_for() const {
        int64_t since = progress_since();
        if (since == 0) return 0.0;
        auto began = Clock::time_point(Clock::duration(since));
        return std::max(0.0, std::chrono::duration<double>(Clock::now() - began).count());
    }

    // When the progress now running began (steady-clock ticks; 0: none runs). Two reads that
    // give the same nonzero value saw one step (or inline post) run all along between them.
    int64_t progress_since() const { return progress_since_ns_.load(std::memory_order_relaxed); }

    // What is outstanding, for hang diagnostics: live requests (oldest first), known peers.
    // A wedged worker (see close()) holds the progress lock for good: the dump then says for
    // how long, instead of waiting for it.
    EngineDump dump() {
        std::unique_lock<std::timed_mutex> lock(progress_mu_, std::defer_lock);
        EngineDump out;
        // The worker's and the spinners' atomics first: a dump that cannot take the lock (a
        // thread spinning on a counter holds it for most of each of its steps) still tells
        // them. Before, such a dump said the worker was not stepping aside while it was.
        out.counter_spinners = spinners_.load(std::memory_order_seq_cst);
        out.worker_deferring = deferring_.load(std::memory_order_seq_cst);
        out.spinner_wakes = spinner_wakes_.load(std::memory_order_relaxed);
        out.worker_naps = worker_naps_.load(std::memory_order_relaxed);
        out.provider_steps = provider_steps_.load(std::memory_order_relaxed);
        out.worker_yields = worker_yields_.load(std::memory_order_relaxed);
        out.lone_yields = lone_yields_.load(std::memory_order_relaxed);
        out.drainers = drainers_.load(std::memory_order_seq_cst);
        if (!take_progress(lock, Clock::now() + kDiagnosticWait)) {
            out.progress_stuck_s = stalled_for();
            return out;
        }
        auto now = Clock::now();
        auto secs = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
        out.inflight_wrs = inflight_;
        for (size_t n = 0; n < pending_.size(); n++) {
            size_t waiting = pending_[n].size();
            for (const auto& [key, pk] : parked_[n]) waiting += pk.ops.size();
            out.unposted_per_nic.push_back(waiting);
        }
        out.pokes_sent = pokes_sent_;
        out.paths_cut = paths_cut_;
        out.eager_waiting = eager_out_.size();
        out.acks_due = 0;
        for (const auto& [to, due] : acks_) out.acks_due += due.size() / kAckEntry;
        out.imms_without_source = sourceless_;
        out.imms_unattributed = unattributed_;
        for (const auto& c : access_checks_) out.access_checks.push_back({c.to, c.nic, c.key, secs(now - c.asked), c.ops.size()});
        for (const auto& [id, r] : live_) {
            RequestView v{};
            v.id = id;
            v.age_s = secs(now - r->started);
            v.deadline_in_s = r->deadline == Clock::time_point::max() ? -1.0 : secs(r->deadline - now);
            v.ops = r->wrs();  // work requests (a list op's pages each)
            v.left = 0;
            v.unposted = 0;
            v.left_per_nic.assign(nics_.size(), 0);
            for (const OpCtx& op : r->ops) {
                if (op.state == OpCtx::kSettled) continue;
                v.left += op_wrs(op);
                if (op.state == OpCtx::kQueued) v.unposted += op_wrs(op);
                if (op.nic < nics_.size()) v.left_per_nic[op.nic] += op_wrs(op);
            }
            if (!r->send_to.empty()) {
                v.peers.push_back(r->send_to);
            } else {
                for (const auto& t : r->targets)
                    if (!t->addresses.empty() &&
                        std::find(v.peers.begin(), v.peers.end(), t->addresses[0]) == v.peers.end())
                        v.peers.push_back(t->addresses[0]);
            }
            v.has_imm = r->has_imm;
            v.imm = r->imm;
            v.abandoned = r->abandoned;
            out.requests.push_back(std::move(v));
        }
        std::sort(out.requests.begin(), out.requests.end(),
                  [](const RequestView& a, const RequestView& b) { return a.age_s > b.age_s; });
        for (const auto& [addr, p] : peer_state_) {
            PeerView v;
            v.address = addr;
            v.heard_s_ago = p.heard == Clock::time_point{} ? -1.0 : secs(now - p.heard);
            v.probe_out_s = p.probe_sent == Clock::time_point{} ? -1.0 : secs(now - p.probe_sent);
            v.probes = p.probes;
            v.lost = p.lost;
            v.session = p.session_ok ? "reconcilable" : p.session != 0 ? "hello sent" : "none";
            for (size_t k = 1; k < p.paths.size(); k++)
                if (now < p.paths[k].down_until || !p.paths[k].failed.empty()) v.down_nics.push_back(k);
            out.peers.push_back(std::move(v));
        }
        for (const auto& [addr, f] : foreign_) out.foreign.emplace_back(addr, f.wire);
        return out;
    }

  private:
    // --- worker -------------------------------------------------------------------------
    void run(int cpu) {
#if defined(__linux__)
        pthread_setname_np(pthread_self(), "fabric-worker");  // as top -H and /proc show it
        if (cpu >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpu, &set);
            pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        }
#endif
        // Idle policy. With work in flight the worker polls without pause, yielding the CPU
        // after a run of empty polls (a provider with manual progress needs the polls, and a
        // host with fewer cores than busy threads needs the yields). Work in flight that has
        // made no progress for kStallSpin (a peer slow to take or copy large writes: on shm
        // the target copies them, and every poll here takes the provider's spin locks that
        // the target needs) is polled between naps that grow from kNap to kStallNap: on a
        // 2-core host, four trainers' workers spinning on them took 56% of the CPU from the
        // two inference ranks copying their weights (fabric bench rl). Once nothing is in
        // flight it keeps polling for incoming imms and messages, yielding between polls, for
        // kIdleSpin; then it sleeps in short naps (kNap, with a tight timer slack so a nap is
        // not stretched to the kernel's default 50 us), and a submit wakes it at once.
        // A step that completed nothing but took far longer than an empty poll moved bytes in
        // the provider (provider_worked): it starts the stall and idle spins afresh, so no nap
        // comes while such steps go on.
        // Where the target's own polls move the bytes of writes to it (target_copies: shm), an
        // idle worker that just worked keeps polling for kLinger before its first yield, as
        // long as its yields find no other thread waiting for the CPU (yield_alone): the next
        // write is usually there by then, and a yield per write cost a 4 KiB paged stream on
        // the 2-core machine 0.85 against 1.2 M pages/s (the writer's worker lingering, or
        // a tcp target, gained nothing there, and a tcp target lingering cost 8-byte writes).
        using clock = std::chrono::steady_clock;
        // Build-time overrides (FABRIC_IDLE_SPIN_US etc.) are for measuring this policy.
        constexpr auto kIdleSpin = std::chrono::microseconds(FABRIC_IDLE_SPIN_US);
        constexpr auto kStallSpin = std::chrono::microseconds(FABRIC_STALL_SPIN_US);
        constexpr auto kNap = std::chrono::microseconds(FABRIC_NAP_US);
        constexpr auto kStallNap = std::chrono::microseconds(FABRIC_STALL_NAP_US);
        constexpr unsigned kPollsBeforeYield = 4;
        constexpr auto kLinger = std::chrono::microseconds(FABRIC_LINGER_US);
        const bool copies = !nics_.empty() && target_copies_of(*nics_[0], 0);
#if defined(__linux__)
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us
#endif
        unsigned empty = 0;
        bool alone = false;
        auto last_work = clock::now();
        auto stall_nap = kNap;
        auto stalled_since = last_work;  // the first empty poll since the last progress
        while (!stop_.load(std::memory_order_acquire)) {
            // A thread spinning on a counter runs the steps (spinning()): step aside meanwhile.
            if (spinners_.load(std::memory_order_seq_cst) > 0 && queue_.empty()) {
                defer(kSpinnerNap);
                empty = 0;
                continue;
            }
            bool busy, inflight, full, chores;
            clock::time_point started;
            if (progress_wanted_.load(std::memory_order_relaxed) > 0) let_in();
            {
                std::lock_guard<std::timed_mutex> lock(progress_mu_);
                busy = step();
                inflight = inflight_ > 0;
                full = full_;
                started = now_;
                chores = chores_;
            }
            if (busy) {
                empty = 0;
                stall_nap = kNap;
                continue;
            }
            const auto now = clock::now();
            // A step that moved bytes in the provider puts off the naps, not the yields. (The
            // spins below are timed to the start of this step: a step that ran the tick takes
            // the provider's time too, and is not a nap's reason.)
            const bool worked = provider_worked(now - started, chores);
            if (worked) stall_nap = kNap;
            // A full NIC that completed nothing waits on the peer (on shm, on the peer's own
            // progress): give the CPU away at once rather than spin against it.
            if (++empty == 1 || worked) stalled_since = last_work = now;
            // An idle worker of a target that copies the writes itself lingers after work,
            // while its yields find no other thread waiting for the CPU.
            const bool linger = copies && alone && !inflight && now - stalled_since < kLinger;
            if ((empty < kPollsBeforeYield || linger) && !full) continue;
            if (inflight) {
                if (started - stalled_since < kStallSpin) {
                    alone = yield_alone();
                } else {
                    nap(stall_nap);
                    stall_nap = std::min(stall_nap * 2, kStallNap);
                }
                continue;
            }
            if (started - last_work < kIdleSpin) {
                alone = yield_alone();
                continue;
            }
            nap(kNap);
        }
        {
            std::lock_guard<std::timed_mutex> lock(progress_mu_);
            // Fail whatever is still in flight: the engine is closing.
            drain_on_close();
        }
        std::lock_guard<std::mutex> lock(exit_mu_);
        exited_ = true;
        exit_cv_.notify_all();  // under the lock: close() may be gone with the engine once it sees exited_
    }

    // One progress step: take new requests, post, poll every CQ, publish. Whoever holds
    // progress_mu_ runs it: the worker, or a thread that help()s while it waits on a counter.
    bool step() {
        now_ = Clock::now();
        InProgress timed(progress_since_ns_, now_);
        bool busy = intake();
        busy |= post_pending();
        if (!acks_.empty()) busy |= flush_acks();
        busy |= poll_all();
        if (!eager_dropped_.empty()) busy |= fail_dropped_eager();
        chores_ = !pongs_.empty();
        if (chores_) answer_fences();
        if (now_ - last_tick_ >= kTick || !fences_.empty()) {
            chores_ = true;
            tick();
        }
        publish();
        // (eager writes waiting for their acknowledgement are not work for the worker: the
        // target sends it at its next step, and whoever polls here next reads it)
        work_left_.store(inflight_ > eager_out_.size(), std::memory_order_relaxed);
        return busy;
    }

    // The progress lock for a thread other than the worker, by ``deadline``: such a thread
    // says it waits (progress_wanted_), and the worker lets it in (let_in()) rather than take
    // the lock again the moment its step ends, which it does while its steps find work. A
    // thread the lock's release woke would otherwise find it taken again, step after step: a
    // dump() waited out its 200 ms against a worker whose every poll was busy.
    bool take_progress(std::unique_lock<std::timed_mutex>& lock, Clock::time_point deadline) {
        progress_wanted_.fetch_add(1, std::memory_order_seq_cst);
        const bool taken = lock_by(lock, deadline);
        progress_wanted_.fetch_sub(1, std::memory_order_seq_cst);
        return taken;
    }

    // The worker, between steps, while another thread waits for the progress lock: gives it
    // up to kLetIn to take it.
    void let_in() {
        const auto until = Clock::now() + kLetIn;
        while (progress_wanted_.load(std::memory_order_seq_cst) > 0 && Clock::now() < until)
            std::this_thread::yield();
    }

    // Whether the worker's last step, which completed nothing, still moved bytes: with manual
    // data progress (tcp;ofi_rxm; on EFA, writes the device does not do in hardware) the
    // provider reads a write's bytes off its sockets in the target's polls, and sends a large
    // write's in the writer's, and only the poll that ends the write completes anything. Such a
    // poll takes many times as long as an empty one (on tcp on the 2-core machine an empty
    // step takes 0.5-1 us and one that reads or sends 4-100+ us; on shm, whose target copies
    // a whole write in the poll that completes it, non-busy steps are nearly all under
    // 0.5 us), so a step that takes kWorkedFactor times the quickest non-busy step yet (an
    // empty one: how fast this host and provider poll), and at least kWorkedMin, counts as
    // work: no nap (idle or stalled) comes while such steps go on. Otherwise a target napping
    // between the polls of one 16 MiB write on tcp held the writer's sends back (4.6-4.9 GB/s
    // against 6.0-6.6 with this rule, alternated pairs; docs/backends/efa.md, "A poll that
    // moved bytes, measured"). Steps that ran the tick or
    // answered fences do not count (``chores``): that work is the engine's own. ``took``: the
    // step's time. The worker's alone.
    bool provider_worked(Clock::duration took, bool chores) {
        if (chores) return false;
        if (took < empty_step_) empty_step_ = took;
        if (took < std::max<Clock::duration>(kWorkedMin, empty_step_ * kWorkedFactor)) return false;
        provider_steps_.fetch_add(1, std::memory_order_relaxed);
        return true;
    }

    // Yields the CPU; whether no other thread took it meanwhile: the yield returned within
    // kAloneFactor times the quickest yield yet (on the 2-core machine a yield nobody takes
    // costs 0.44 us, and one that hands the CPU to another yielding thread and back 2.4 us).
    // The worker's alone.
    bool yield_alone() {
        const auto before = Clock::now();
        std::this_thread::yield();
        const auto took = Clock::now() - before;
        worker_yields_.fetch_add(1, std::memory_order_relaxed);
        if (took < quickest_yield_) quickest_yield_ = took;
        if (took >= quickest_yield_ * kAloneFactor) return false;
        lone_yields_.fetch_add(1, std::memory_order_relaxed);
        return true;
    }

    // Sleeps up to ``d`` while a thread spins on a counter (it runs the steps); the last
    // spinner to stop wakes it where there is work for it (spinning()), and a submit does as it
    // does for any nap (a small one is posted by the submitter itself).
    void defer(std::chrono::microseconds d) {
        std::unique_lock<std::mutex> lock(wake_mu_);
        deferring_.store(true, std::memory_order_seq_cst);
        sleeping_.store(true, std::memory_order_seq_cst);
        // (seq_cst against spinning(): either the last spinner sees deferring_, or this sees it gone)
        if (spinners_.load(std::memory_order_seq_cst) > 0 && queue_.empty() && !stop_.load(std::memory_order_acquire))
            wake_cv_.wait_for(lock, d);
        sleeping_.store(false, std::memory_order_release);
        deferring_.store(false, std::memory_order_seq_cst);
    }

    // Sleeps up to ``d`` unless a submit is queued; submit() wakes a sleeping worker at once.
    void nap(std::chrono::microseconds d) {
        worker_naps_.fetch_add(1, std::memory_order_relaxed);
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
            r->started = now_;
            double limit = r->timeout_s >= 0 ? r->timeout_s : default_timeout_s_;
            r->deadline = std::isfinite(limit) && limit < 1e9
                              ? now_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit))
                              : Clock::time_point::max();
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
                if (r->payload.size() + kUserHead > kFrameFloor && !sized(op)) continue;  // waits, or failed
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
                if (chaos_ && op.pages > 1) {  // a list's pages in any order too
                    for (uint32_t k = op.pages - 1; k > 0; k--) {
                        uint32_t j = std::uniform_int_distribution<uint32_t>(0, k)(rng_);
                        std::swap(r->list_src[op.first_page + k], r->list_src[op.first_page + j]);
                        std::swap(r->list_dst[op.first_page + k], r->list_dst[op.first_page + j]);
                    }
                }
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

    // Which queue an op waits in once its peer's provider queue is full: the peer's address
    // handle on NIC ``n`` (resolved by post() before it can answer -EAGAIN), or, for a send
    // that found no free bounce slot (a local shortage), every send.
    static constexpr uint64_t kNoSendSlot = ~uint64_t(0) - 1;
    uint64_t park_key(uint32_t n, const OpCtx& op) const {
        if (op.kind == 1) return op.src == 0 ? kNoSendSlot : op.dst_off;
        if (op.kind != 0 || op.target >= op.request->targets.size()) return Target::kUnresolved;
        const Target& t = *op.request->targets[op.target];
        return n < t.peers.size() ? t.peers[n] : Target::kUnresolved;
    }

    // Work requests go out per NIC in queue order, except that a peer whose provider queue
    // is full (-EAGAIN: on shm, a peer that stopped draining its queue, e.g. a dead process;
    // on tcp, a connection not up yet) holds up only its own: its ops move, in order, to a
    // queue of their own (parked_), tried first on every pass, and the rest go on. Before,
    // the first -EAGAIN stopped the NIC, so one dead peer stalled the traffic to every other
    // until liveness declared it lost.
    //
    // The parked peers take turns: each pass starts at the peer after the last one a parked
    // op was posted to. A fixed order (by address handle) gave the peer that sorted
    // first every slot the provider freed between passes: on shm, where a sender's posts
    // answer -EAGAIN hundreds of times a step in an RL update, inference rank 1 (resolved second)
    // fenced after rank 0 in 30 of 30 steps, by 21 ms at the median, and swapping the order
    // the peers were resolved in swapped the ranks.
    bool post_pending() {
        bool any = false;
        full_ = false;
        for (uint32_t n = 0; n < nics_.size(); n++) {
            auto& park = parked_[n];
            std::array<uint64_t, kMaxParked + 1> turn;  // the parked peers, in this pass's order
            size_t turns = 0;
            if (!park.empty()) {
                auto first = park.upper_bound(park_served_[n]);
                if (first == park.end()) first = park.begin();
                for (auto it = first; it != park.end() && turns < turn.size(); ++it) turn[turns++] = it->first;
                for (auto it = park.begin(); it != first && turns < turn.size(); ++it) turn[turns++] = it->first;
            }
            for (size_t i = 0; i < turns; i++) {
                auto it = park.find(turn[i]);
                if (it == park.end()) continue;
                Parked& pk = it->second;
                while (!pk.ops.empty()) {
                    OpCtx* op = pk.ops.front();
                    if (op->request->abandoned) {
                        pk.ops.pop_front();
                        settle(*op);
                        any = true;
                        continue;
                    }
                    if (wedged_.load(std::memory_order_relaxed)) return any;  // see below
                    int rc = post(n, *op);
                    if (rc == kCapped) {  // its earlier writes are not reported yet: the
                        full_ = true;     // provider refused nothing, so no stall either
                        pk.since = now_;
                        break;
                    }
                    if (rc == -EAGAIN) {
                        eagain_++;
                        full_ = true;
                        // A path whose provider will not take a work request for as long as a
                        // peer may leave a probe unanswered (tcp: a connection that never comes
                        // up says -EAGAIN forever) is lost like one that fails them: its queued
                        // work requests, never posted, move to another NIC.
                        if (n > 0 && op->kind == 0 && now_ - pk.since >= stall_limit(path_of(*op)) &&
                            path_lost(*op, kTransport, "the provider refused every work request for it", false)) {
                            pk.ops.pop_front();
                            pk.since = now_;
                            any = true;
                            continue;
                        }
                        break;
                    }
                    pk.ops.pop_front();
                    pk.since = now_;
                    park_served_[n] = turn[i];
                    after_post(n, op, rc);
                    any = true;
                }
                if (pk.ops.empty()) park.erase(it);
            }
            auto& q = pending_[n];
            unsigned budget = 256;
            while (!q.empty() && budget--) {
                OpCtx* op = q.front();
                q.pop_front();
                if (op->request->abandoned) {  // failed early: never posted
                    settle(*op);
                    any = true;
                    continue;
                }
                // A wedged engine (close() gave up on a thread stuck in the provider) has failed
                // every request: should the stuck call return at last, nothing more is posted,
                // so no bytes of a transfer reported failed land after it (close() fails the rest).
                if (wedged_.load(std::memory_order_relaxed)) {
                    q.push_front(op);
                    return any;
                }
                if (!park.empty()) {
                    auto it = park.find(park_key(n, *op));
                    if (it != park.end()) {  // behind its peer's earlier ops
                        it->second.ops.push_back(op);
                        continue;
                    }
                }
                int rc = post(n, *op);
                if (rc == -EAGAIN || rc == kCapped) {
                    if (rc == -EAGAIN) eagain_++;
                    full_ = true;
                    Parked& pk = park[park_key(n, *op)];
                    if (pk.ops.empty()) pk.since = now_;
                    pk.ops.push_back(op);
                    // so many full peers: the NIC itself is full (capped peers say nothing of it)
                    if (rc == -EAGAIN && park.size() >= kMaxParked) break;
                    continue;
                }
                after_post(n, op, rc);
                any = true;
            }
        }
        return any;
    }

    // What follows post() of an op that did not answer -EAGAIN.
    void after_post(uint32_t n, OpCtx* op, int rc) {
        if (rc == kRerouted) {  // its path is down (or not yet set up): another NIC
            pending_[op->nic].push_back(op);
            return;
        }
        if (rc == kGone) {  // never posted; the peer is not suspect, it is gone for good
            if (op->kind == 0) NicTraffic::bump(traffic_[n].errors);
            fail_op(*op, kPeerUnreachable, "the peer is an endpoint of this process that was closed");
            return;
        }
        if (rc != 0 && op->kind == 0 && path_lost(*op, kPeerUnreachable, std::strerror(-rc), false)) return;
        if (rc != 0) {
            if (op->kind == 0) NicTraffic::bump(traffic_[n].errors);
            bool unreachable = rc == -EHOSTUNREACH || rc == -ECONNREFUSED || rc == -ENOTCONN;
            std::string why = std::string("posting failed: ") + std::strerror(-rc);
            if (unreachable) transport_lost(*op);
            fail_op(*op, unreachable ? kPeerUnreachable : kTransport, why);
        } else {
            op->state = OpCtx::kPosted;
            op->posts++;
            NicTraffic::bump(posted_, op_wrs(*op));
        }
    }

    int post(uint32_t n, OpCtx& op) {
        Request& r = *op.request;
        if (op.kind == 1) {
            if (ClosedSet::instance().contains(r.send_to)) return kGone;
            if (op.src == 0) {  // first attempt: take a bounce slot (none free: retry later)
                if (free_slots_.empty()) return -EAGAIN;
                op.src = uint64_t(free_slots_.back()) + 1;
                free_slots_.pop_back();
                char* slot = send_slot(op.src - 1);
                slot[0] = wire_.load(std::memory_order_relaxed);
                slot[1] = kFrameUser;
                std::memcpy(slot + kUserHead, r.payload.data(), r.payload.size());
            }
            return nics_[n]->post_send(send_slot(op.src - 1), r.payload.size() + kUserHead, send_desc_, op.dst_off,
                                       &op);
        }
        Target& t = *r.targets[op.target];
        if (closed(t)) return kGone;
        if (t.peers.size() != nics_.size() || t.epoch != epoch_) {  // new, or a peer was evicted since
            t.peers.assign(nics_.size(), Target::kUnresolved);
            t.epoch = epoch_;
            t.state = &state_for(t.addresses[0]);
            if (nics_.size() > 1) start_hello(*t.state);  // NICs > 0 carry WriteImms once answered
        }
        bool imm = op.mode == OpCtx::kImmOnly || (r.has_imm && op.mode == OpCtx::kAsPlanned);
        PathState* path = nullptr;
        if (n > 0) {  // several NICs: is this path usable (for an imm: is the session up)?
            PeerState& p = *t.state;
            if (p.paths.size() != nics_.size()) p.paths.resize(nics_.size());
            path = &p.paths[n];
            bool down = now_ < path->down_until || !path->failed.empty() || path->querying;
            if (down || (imm && !p.session_ok)) {
                if (imm && !p.session_ok) start_hello(p);
                op.nic = pick_nic(p, n, imm);
                return kRerouted;
            }
        }
        uint64_t& peer = t.peers[n];
        if (peer == Target::kUnresolved) {
            if (!resolve(n, t.addresses[n], peer)) {
                peer = Target::kUnresolved;
                return -EHOSTUNREACH;
            }
            auto& known = t.state->nic_addrs;
            if (known.size() < nics_.size()) known.resize(nics_.size());
            if (n < t.addresses.size()) known[n] = t.addresses[n];
        }
        WriteOp w;
        w.src = reinterpret_cast<const void*>(op.src);
        w.len = op.mode == OpCtx::kImmOnly ? 0 : op.len;
        w.desc = r.src_desc ? (*r.src_desc)[n] : nullptr;
        w.peer = peer;
        w.raddr = (nics_[n]->virt_addr() ? t.remote_base : 0) + op.dst_off;
        w.rkey = t.rkeys[n];
        w.has_imm = imm;
        w.batch = r.wrs() > 1;
        w.imm = r.imm;
        bool capped = counts_toward_queue_depth(*nics_[n], w, 0);
        if (capped && over_queue_depth(*t.state, op)) return kCapped;
        // Announced to the process before the last look at whether the peer closed: a peer
        // closing in this process adds itself to ClosedSet, then waits for the count (its
        // drain_on_close), so either it sees this post coming or this post sees it closed.
        // (Only writes to an engine of this process are counted: no other can wait for them.)
        PeerState& ps = *t.state;
        const bool counted = local(ps);
        if (counted) {
            if (!ps.inbound) ps.inbound = InboundWrites::instance().counter(ps.address);
            ps.inbound->fetch_add(1, std::memory_order_seq_cst);
        }
        if (closed(t)) {
            if (counted) ps.inbound->fetch_sub(1, std::memory_order_seq_cst);
            return kGone;
        }
        int rc = op.pages                  ? post_list(*nics_[n], w, r, op)
                 : eager_fits(n, w, op)    ? post_eager(w, op, *t.state)
                                           : nics_[n]->post_write(w, &op);
        if (rc == 0) {
            NicTraffic::bump(traffic_[n].inflight);
            t.state->inflight++;
            if (capped) {
                if (t.state->queued++ == 0) busy_peers_++;
                t.state->queued_bytes += op_bytes(op);
                if (op.pages) t.state->queued_lists++;
            }
            op.queued = capped;
            if (op.pages) NicTraffic::bump(list_ops_);
            if (counted) ps.posted_here++;
            op.inbound = counted;
        } else if (counted) {
            ps.inbound->fetch_sub(1, std::memory_order_seq_cst);
        }
        if (rc == 0 && path) {
            if (imm) path->imm_busy++;
            if (path->busy++ == 0) path->progress = now_;
        }
        return rc;
    }

    // A list op to a domain that takes lists (post_write_list(w, src, dst, n, ctx): ``w`` as
    // for a single write of one page, its raddr the base the pages' offsets add to); the
    // planner makes list ops only where list_pages said yes, so the fallback never runs.
    static int post_list(Domain& d, const WriteOp& w, Request& r, OpCtx& op) {
        return domain_post_list(d, w, r.list_src.data() + op.first_page, r.list_dst.data() + op.first_page, op.pages,
                                &op, 0);
    }
    // A domain's abort_path(peer address) where it has one: resets its connections to the
    // peer's endpoint (see PathState::cut_until); how many.
    template <class D>
    static auto abort_path_of(D& d, const std::string& peer, int) -> decltype(size_t(d.abort_path(peer))) {
        return d.abort_path(peer);
    }
    template <class D>
    static size_t abort_path_of(D&, const std::string&, long) {
        return 0;
    }
    template <class D>
    static auto target_copies_of(const D& d, int) -> decltype(bool(d.target_copies())) {
        return d.target_copies();
    }
    template <class D>
    static bool target_copies_of(const D&, long) {
        return false;
    }

  public:
    // The most pages of a list op (OpCtx::pages) NIC 0's domain takes for a paged request to
    // ``rkey`` (0: the pages go one work request each). Any thread: a domain answers from what
    // it fixed at open.
    size_t list_pages(uint64_t rkey) const { return nics_.empty() ? 0 : domain_list_pages(*nics_[0], rkey, 0); }

  private:
    // Whether ``p`` is an engine of this process (LocalEndpoints); one atomic load unless an
    // engine of this process opened or went since ``p`` was last looked at.
    static bool local(PeerState& p) {
        uint64_t epoch = LocalEndpoints::instance().epoch();
        if (p.local_epoch != epoch) {
            p.local = LocalEndpoints::instance().contains(p.address);
            p.local_epoch = epoch;
        }
        return p.local;
    }

    // Whether ``t`` is an endpoint of this process that closed (since the write was submitted:
    // the binding refuses writes to one at submit, but a write can wait here long after,
    // behind the queue depth or a full provider queue). On shm its memory is gone, and a post
    // to it touches freed provider state (SIGSEGV in the poster). One atomic load unless an
    // endpoint closed or reopened since ``t`` was last looked at.
    static bool closed(Target& t) {
        uint64_t epoch = ClosedSet::instance().epoch();
        if (t.closed_epoch != epoch) {
            t.closed = !t.addresses.empty() && ClosedSet::instance().contains(t.addresses[0]);
            t.closed_epoch = epoch;
        }
        return t.closed;
    }

    // A usable NIC other than ``n`` for an op to ``p``: NIC 0 always is (its failures are the
    // peer's); one above it if its path is up and, for an imm, the session is.
    uint32_t pick_nic(const PeerState& p, uint32_t n, bool imm) const {
        uint32_t count = static_cast<uint32_t>(nics_.size());
        for (uint32_t step = 1; step < count; step++) {
            uint32_t j = (n + step) % count;
            if (j == 0) return 0;
            const PathState& q = p.paths[j];
            if (now_ >= q.down_until && q.failed.empty() && !q.querying && (!imm || p.session_ok)) return j;
        }
        return 0;
    }

    struct Sink {
        Engine* self;
        uint32_t nic;
        void on_write_done(void* ctx) { self->write_done(*static_cast<OpCtx*>(ctx)); }
        void on_send_done(void* ctx) {
            auto* op = static_cast<OpCtx*>(ctx);
            if (op->kind == 3 || op->kind == kEagerFrame) {  // (an eager write waits for its ack)
                self->release_probe(*op);
                return;
            }
            self->finish_op(*op);
        }
        void on_recv(void* ctx, size_t len) { self->got_message(*static_cast<OpCtx*>(ctx), len); }
        // A control receive the provider truncated: a frame larger than the buffer (a domain
        // that cannot tell reports it through on_error, and the buffer is not posted again).
        void on_recv_truncated(void* ctx) { self->got_truncated(*static_cast<OpCtx*>(ctx)); }
        // ``src``: the source's peer handle on this NIC where the domain reports it (kNoSource
        // otherwise); imms arriving on NICs > 0 are attributed to their sender for NIC loss.
        void on_imm(uint32_t imm, uint64_t src) {
            self->imm_counts_[imm]++;
            NicTraffic::bump(self->traffic_[nic].imms);
            if (nic > 0) self->attribute(nic, src, imm);
        }
        // ``count`` imms of one value from one source (an inbox record).
        void on_imms(uint32_t imm, uint64_t src, uint32_t count) {
            if (count == 0) return;
            self->imm_counts_[imm] += count;
            NicTraffic::bump(self->traffic_[nic].imms, count);
            if (nic > 0)
                for (uint32_t k = 0; k < count; k++) self->attribute(nic, src, imm);
        }
        void on_error(void* ctx, int32_t status, const std::string& message) {
            if (ctx == nullptr) return;
            bool dropped = status == kConnectionDropped;
            if (dropped) status = kPeerUnreachable;
            auto* op = static_cast<OpCtx*>(ctx);
            if (op->kind == 2) return;  // a receive flushed at close
            if (op->kind == 3) {
                self->probe_failed(*op, status, message);
                return;
            }
            if (op->kind == kEagerFrame) {  // the frame of an eager write: the write fails with it
                const uint64_t nonce = op->dst_off;
                self->release_probe(*op);
                OpCtx* write = self->take_eager(nonce);
                if (write != nullptr) on_error(write, dropped ? int32_t(kConnectionDropped) : status, message);
                return;
            }
            if (op->kind == 0) {
                self->reported(*op, false);
                PathState* path = self->path_of(*op);
                if (path != nullptr) {
                    self->path_reported(*path);
                    if (op_imm(*op) && path->imm_busy > 0) path->imm_busy--;
                }
                if (self->path_lost(*op, status, message, true)) return;  // to be retried
                if (status == kPeerUnreachable) self->transport_lost(*op);
                if (dropped && self->check_access(*op, status, message)) return;  // held: the target is asked why
                self->fail_op(*op, status, message);
                return;
            }
            // (before fail_op, which may free the op's request)
            if (status == kPeerUnreachable) self->transport_lost(*op);
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

    // A write's successful completion (from a domain's poll).
    void write_done(OpCtx& op) {
        reported(op, true);
        PathState* path = path_of(op);
        if (path != nullptr) {
            path_reported(*path);
            path->fails = 0;  // it works
            if (op_imm(op)) {
                if (path->imm_busy > 0) path->imm_busy--;
                path->tx.add(op.request->imm);
            }
        }
        if (op.retry != nullptr && op.carrier && !op.request->abandoned) {
            // its bytes are in place: it carries a make-up imm once the whole batch's are
            NicTraffic::bump(completed_);
            NicTraffic::bump(bytes_, op.len);
            RetryBatch* b = op.retry;
            op.retry = nullptr;
            b->carriers.push_back(&op);
            batch_step(b);
            return;
        }
        finish_op(op);
    }

    // A posted write was reported (``ok``: completed): the traffic counters move.
    void reported(OpCtx& op, bool ok) {
        if (op.kind != 0 || op.nic >= nics_.size()) return;
        NicTraffic& t = traffic_[op.nic];
        NicTraffic::drop(t.inflight);
        uint64_t len = op_bytes(op), wrs = op_wrs(op);
        if (ok) {
            NicTraffic::bump(t.wrs, wrs);
            NicTraffic::bump(t.bytes, len);
        } else {
            NicTraffic::bump(t.errors, wrs);
        }
        const Request& r = *op.request;
        PeerState* p = op.target < r.targets.size() ? r.targets[op.target]->state : nullptr;
        if (p == nullptr) return;
        if (p->inflight > 0) p->inflight--;
        if (op.queued && p->queued > 0) {
            if (--p->queued == 0 && busy_peers_ > 0) busy_peers_--;
            p->queued_bytes -= std::min(p->queued_bytes, op_bytes(op));
            if (op.pages && p->queued_lists > 0) p->queued_lists--;
        }
        if (op.inbound && p->posted_here > 0) {  // reaped: the provider is done with the peer's memory for it
            p->posted_here--;
            p->inbound->fetch_sub(1, std::memory_order_seq_cst);
        }
        op.inbound = false;
        if (ok) {
            p->wrs += wrs;
            p->bytes += len;
        } else {
            p->errors += wrs;
        }
    }

    // Whether the domain counts a write towards the queue depth (a domain says so through
    // counts_toward_queue_depth(const WriteOp&); one that does not: every write counts). A
    // domain that moves some writes without the provider's queues (CUDA IPC copies) leaves
    // those out.
    template <class D>
    static auto counts_toward_queue_depth(const D& d, const WriteOp& w, int)
        -> decltype(d.counts_toward_queue_depth(w)) {
        return d.counts_toward_queue_depth(w);
    }
    template <class D>
    static bool counts_toward_queue_depth(const D&, const WriteOp&, long) {
        return true;
    }

    // Whether ``op`` must wait for the queue depth to its peer ``p`` (configure_queue): the
    // peer has its depth posted, and the byte allowance (if any) has no room for it. The
    // allowance is for an engine writing to one peer: while another has writes posted, a
    // post that spins on a busy target keeps that one waiting, which the depth is there to
    // prevent (an RL update, each trainer writing to two receivers, took 337-403 ms with the
    // allowance for every peer against 275-318 without). A list op (pages) is many writes,
    // each a command in the target's queue: it never goes past the depth, nor does anything
    // while one is posted.
    bool over_queue_depth(const PeerState& p, const OpCtx& op) const {
        if (queue_cap_ == 0) return false;
        const uint64_t nics = nics_.size();
        if (p.queued < queue_cap_ * nics) return false;
        if (queue_bytes_ == 0 || op.pages || p.queued_lists > 0 || busy_peers_ > 1) return true;
        return p.queued_bytes + op_bytes(op) > queue_bytes_ * nics;
    }

    void path_reported(PathState& path) {
        if (path.busy > 0) path.busy--;
        path.progress = now_;
    }

    static bool op_imm(const OpCtx& op) {
        return op.kind == 0 &&
               (op.mode == OpCtx::kImmOnly || (op.request->has_imm && op.mode == OpCtx::kAsPlanned));
    }

    // The path a write goes (or went) on, where NIC loss tracks it (NICs > 0 of a multi-NIC
    // engine).
    PathState* path_of(const OpCtx& op) {
        if (op.kind != 0 || op.nic == 0) return nullptr;
        const Request& r = *op.request;
        if (op.target >= r.targets.size()) return nullptr;
        PeerState* p = r.targets[op.target]->state;
        if (p == nullptr || p->paths.size() <= op.nic) return nullptr;
        return &p->paths[op.nic];
    }

    void finish_op(OpCtx& op) {
        if (op.kind == 0) {
            NicTraffic::bump(completed_, op_wrs(op));
            NicTraffic::bump(bytes_, op_bytes(op));
            // a completed work request is a sign of life (a probe can sit behind megabytes of
            // data on a transport with one stream per peer, such as tcp)
            PeerState* p = op.request->targets[op.target]->state;
            if (p != nullptr) p->heard = now_;
        }
        settle(op);
    }

    void fail_op(OpCtx& op, int32_t status, const std::string& message) {
        Request& r = *op.request;
        if (r.status == kOk) {
            r.status = status;
            r.message = message;
            r.fail_nic = op.kind == 0 ? static_cast<int32_t>(op.nic) : 0;
        }
        settle(op);
    }

    void settle(OpCtx& op) {
        if (op.kind == 1 && op.src != 0) {  // the send's bounce slot is free again
            free_slots_.push_back(static_cast<uint32_t>(op.src - 1));
            op.src = 0;
        }
        if (op.retry != nullptr) {  // a bytes-only retry that ends here (done, or failed)
            RetryBatch* b = op.retry;
            op.retry = nullptr;
            batch_step(b);
        }
        Request& r = *op.request;
        op.state = OpCtx::kSettled;
        inflight_--;
        if (--r.left == 0) {
            if (!r.abandoned) {
                if (r.status == kOk) {
                    ready_.push_back(Completion{r.id, kOk, std::string(), std::string()});
                } else {
                    ready_.push_back(failure(r, r.status, r.message, r.fail_nic));
                }
                if (r.status == kOk)  // a completed write or send is a sign of life
                    for (const auto& t : r.targets)
                        if (t->state) heard(*t->state);
            }
            live_.erase(r.id);
        }
    }

    void got_message(OpCtx& op, size_t len) {
        const char* buf = recv_buf(op.src);
        // [wire byte][type][address length][address][body]; a user frame's address and body are
        // the Python header and payload, handed on without the wire and type bytes.
        if (len >= 1 && buf[0] != wire_.load(std::memory_order_relaxed)) {
            got_foreign(buf, len);
        } else if (len >= 3 && size_t(uint8_t(buf[2])) + 3 <= len) {
            std::string from(buf + 3, uint8_t(buf[2]));
            if (!foreign_.empty() && !from.empty()) foreign_.erase(from);  // it speaks this version now
            auto it = peer_state_.find(from);
            if (it != peer_state_.end()) heard(it->second);
            uint64_t nonce = 0;
            const char type = buf[1];
            size_t body = 3 + size_t(uint8_t(buf[2]));
            if (type != kFrameUser && len >= body + sizeof(nonce)) std::memcpy(&nonce, buf + body, sizeof(nonce));
            if (type == kFrameUser) {
                messages_.emplace_back(buf + kUserHead, len - kUserHead);
            } else if (type == kFramePing) {
                // The answer leaves after everything this engine posted to the pinger before it,
                // on the same stream where the transport has one (tcp): fence() relies on it.
                // So frames still queued for it go first, and the answer waits behind them. A
                // fence's ping (nonce > 0; a liveness probe's is 0) is
                // answered by answer_fences(): once this engine's writes to the pinger on other
                // NICs, which travel on streams of their own, have been reported too, and once
                // every imm already in this engine's CQs is counted.
                if (nonce != 0) {
                    bool known = std::any_of(pongs_.begin(), pongs_.end(), [&](const PendingPong& q) {
                        return q.to == from && q.nonce == nonce;
                    });
                    if (!known) pongs_.push_back(PendingPong{from, nonce, postings_to({from}, 1)});
                } else {
                    // Behind what is still queued for the pinger; an answer the provider cannot
                    // take now (its queue to the pinger full of writes: -EAGAIN) waits in the
                    // outbox rather than being dropped: the pinger would wait out its probe
                    // timeout and declare this engine lost while its writes still land.
                    bool asked = std::any_of(outbox_.begin(), outbox_.end(), [&](const OutFrame& f) {
                        return f.to == from && f.type == kFramePong && f.nonce == nonce;
                    });
                    if (!asked) send_or_queue(kFramePong, from, nonce, frame_body());
                }
            } else if (type == kFramePong && it != peer_state_.end()) {
                // (an answer to a fence not asked yet is a forgery, or garbage: taken for no
                // more than the fences already asked, or it would answer every later one)
                it->second.answered = std::max(it->second.answered, std::min(nonce, fence_nonce_));
                uint64_t frame = 0;  // [nonce][the answering engine's receive buffers' size]
                if (len >= body + 2 * sizeof(uint64_t)) std::memcpy(&frame, buf + body + sizeof(nonce), sizeof(frame));
                if (frame > 0) got_frame_size(it->second, frame);
            } else if (len >= body + sizeof(nonce)) {
                const char* extra = buf + body + sizeof(nonce);
                size_t elen = len - body - sizeof(nonce);
                if (type == kFrameHello) {
                    got_hello(from, nonce, extra, elen);
                } else if (type == kFrameHelloAck && it != peer_state_.end() && elen >= 9) {
                    PeerState& p = it->second;
                    if (p.session == nonce && !p.session_ok) {
                        p.session_ok = true;
                        std::memcpy(&p.peer_incarnation, extra, 8);
                        if (p.paths.size() != nics_.size()) p.paths.resize(nics_.size());
                        for (auto& path : p.paths) {
                            path.tx = PowerSums{};
                            path.ghosts.clear();
                        }
                    }
                } else if (type == kFramePathReset && it != peer_state_.end() && elen >= 1) {
                    // The peer lost its NIC k path to this engine: drop this side's connection
                    // state for its address there too, or a half-dead connection it cannot
                    // see may keep refusing the one it makes next.
                    uint32_t k = uint8_t(extra[0]);
                    PeerState& p = it->second;
                    if (k > 0 && k < nics_.size()) {
                        reset_path(p, k);
                        poke(p, k);
                    }
                } else if (type == kFrameAccess) {
                    send_or_queue(kFrameAccessAnswer, from, nonce, access_answer(extra, elen));
                } else if (type == kFrameAccessAnswer) {
                    got_access_answer(from, nonce, extra, elen);
                } else if (type == kFrameWrite) {
                    got_eager_write(from, nonce, extra, elen);
                } else if (type == kFrameWriteAck) {
                    got_eager_acks(from, extra, elen);
                } else if (type == kFrameQuery && elen >= 1) {
                    queries_.push_back(Query{from, nonce, uint8_t(extra[0])});
                } else if (type == kFrameCounts && it != peer_state_.end()) {
                    PeerState& p = it->second;
                    for (uint32_t k = 1; k < p.paths.size(); k++)
                        if (p.paths[k].querying && nonce >= p.paths[k].query_first && nonce <= p.paths[k].query_nonce)
                            reconcile(p, k, extra, elen);
                }
            }
        }
        nics_[0]->post_recv(recv_buf(op.src), frame_, recv_desc_, &op);
    }

    // --- messages larger than some engines take ----------------------------------------
    // A receiver's buffers hold its own max_send_size (and never less than kFrameFloor), not
    // the sender's: a larger message is truncated to nothing on tcp (got_truncated), and on
    // shm (1.17) its send never completes and the sender's endpoint stops (EngineWedged).
    // So a message of more than kFrameFloor bytes goes only to a peer whose buffers are known
    // to hold it: every engine's pong carries the size of its buffers (frame_body()), and a
    // send to a peer whose size is not known yet waits (sized_wait_) while it is asked (a
    // ping, again every kFenceRetry). One that does not fit fails at once, kTransport, saying
    // both sizes. A peer that never answers is found by the liveness probes, or the send ends
    // at its deadline. The first large message to a peer waits for the answer, whose way back
    // may need setting up (a first 25.6 KB message took 5-14 ms on shm and 41 ms on tcp, a
    // first 100-byte one 0.1-3.4 ms and 29 ms); smaller ones wait for nothing.
    bool sized(OpCtx& op) {
        const int verdict = size_verdict(op);
        if (verdict == 0) sized_wait_.push_back(&op);
        return verdict > 0;
    }

    // 1: ``op``'s message goes (it fits, or post() fails it: an endpoint of this process that
    // closed, kGone); 0: its peer's size is not known yet (asked); -1: it does not fit (failed).
    int size_verdict(OpCtx& op) {
        Request& r = *op.request;
        if (r.send_to == self_address_) return fits(op, frame_) ? 1 : -1;
        if (ClosedSet::instance().contains(r.send_to)) return 1;
        PeerState& p = state_for(r.send_to);
        if (p.frame == 0) {
            ask_frame(p);
            return 0;
        }
        return fits(op, p.frame) ? 1 : -1;
    }

    // Whether ``op``'s message fits a peer's buffers of ``frame`` bytes; fails it if not.
    bool fits(OpCtx& op, uint64_t frame) {
        const uint64_t need = op.request->payload.size() + kUserHead;
        if (need <= frame) return true;
        fail_op(op, kTransport,
                "the message takes " + std::to_string(need) + " bytes and the peer's receive buffers hold " +
                    std::to_string(frame) + " (its max_send_size is smaller than this engine's): give every "
                    "engine of a job the same max_send_size");
        return false;
    }

    void ask_frame(PeerState& p) {
        if (p.frame_asked != Clock::time_point{} && now_ - p.frame_asked < kFenceRetry) return;
        if (send_frame(kFramePing, p.address, nullptr)) p.frame_asked = now_;
    }

    std::string frame_body() const {
        const uint64_t frame = frame_;
        return std::string(reinterpret_cast<const char*>(&frame), sizeof(frame));
    }

    void got_frame_size(PeerState& p, uint64_t frame) {
        p.frame = frame;
        if (!sized_wait_.empty()) sized_tick();
    }

    // Sends waiting for a size: ended ones settle, those whose peer's size came go on (or
    // fail), the rest ask again.
    void sized_tick() {
        std::vector<OpCtx*> left;
        for (OpCtx* op : sized_wait_) {
            Request& r = *op->request;
            if (r.abandoned) {
                settle(*op);
                continue;
            }
            const int verdict = size_verdict(*op);
            if (verdict > 0) pending_[0].push_back(op);
            if (verdict == 0) left.push_back(op);
        }
        sized_wait_.swap(left);
    }

    // A frame whose first byte is not this engine's wire byte: written by an engine of another
    // wire protocol (another fabric release), whose frames this one cannot read, nor it
    // this one's. Counted (frames_foreign) and dropped. Where the prefix all versions share
    // names its sender (wire byte 0x80 or above, an address), the sender is noted as speaking
    // that version (foreign_) and told, once a second at most, that this engine speaks another
    // (kFrameForeign, which is never answered: two engines of different versions do not
    // answer each other for ever). Neither frame is a sign of life: a peer that speaks
    // another version answers no probe, and one that work depends on is lost once a probe
    // has gone unanswered for kForeignGrace, its requests failed with kIncompatible
    // (peer_lost). A frame of this version from it clears the note. Frames are not
    // authenticated (docs/concepts/security.md): a forged one costs an honest peer nothing but
    // an early probe, which it answers.
    void got_foreign(const char* buf, size_t len) {
        if (len == 3 && buf[1] == kFrameDeliveryMarker && buf[2] == 0) return;  // a domain's marker
        NicTraffic::bump(frames_foreign_);
        const uint8_t wire = uint8_t(buf[0]);
        if (!(wire & 0x80) || len < 3 || size_t(uint8_t(buf[2])) + 3 > len || buf[2] == 0) return;
        std::string from(buf + 3, uint8_t(buf[2]));
        if (from == self_address_) return;
        if (foreign_.size() >= kForeignMax && foreign_.find(from) == foreign_.end()) foreign_.clear();
        Foreign& f = foreign_[from];
        const bool fresh = f.wire != wire;
        f.wire = wire;
        auto ps = peer_state_.find(from);
        // probed at once: a forged note costs an honest peer that probe, whose answer clears it
        if (fresh && ps != peer_state_.end()) probe_soon(ps->second);
        if (buf[1] == kFrameForeign) return;
        if (f.told != Clock::time_point{} && now_ - f.told < kForeignTell) return;
        if (send_frame(kFrameForeign, from, nullptr, nullptr, 0, false, std::string(1, buf[0]))) f.told = now_;
    }

    // The wire byte ``address`` was last heard speaking, where it is another than this
    // engine's; 0 where it is not known to.
    uint8_t foreign_wire(const std::string& address) const {
        if (foreign_.empty()) return 0;
        auto it = foreign_.find(address);
        return it == foreign_.end() ? 0 : it->second.wire;
    }

    // How long a probe to ``p`` may go unanswered before it is lost.
    Clock::duration probe_deadline(const PeerState& p) const {
        return foreign_wire(p.address) != 0 ? std::min<Clock::duration>(probe_timeout_, kForeignGrace) : probe_timeout_;
    }

    // A control frame larger than this engine's receive buffers (its sender runs a larger
    // max_send_size and sent a message above this one's): counted, and its buffer posted
    // again. Before, each such frame cost a buffer for good, and recv_depth of them left the
    // engine deaf to every control frame (probes, answers, acknowledgements). The provider
    // keeps none of the frame (tcp reports 0 bytes), so its sender is not known here; the
    // sender's send completed, and a lost message is the application's to notice, as for one
    // its peer never receives. Engine frames always fit (kFrameFloor).
    void got_truncated(OpCtx& op) {
        NicTraffic::bump(frames_truncated_);
        nics_[0]->post_recv(recv_buf(op.src), frame_, recv_desc_, &op);
    }

    // A region as remote writes address it (note_region), for access checks and eager writes.
    struct AccessEntry {
        uint64_t base = 0, len = 0;
        bool writable = false;
        uint64_t ptr = 0;   // where the region is in this process
        bool host = true;   // host memory (eager writes: copied with memcpy)
    };

    // An answer about a key, as access checks and eager writes' acknowledgements carry it:
    // [known][writable][base][length] (kAccessBytes; all zero for a key it does not have).
    struct AccessFacts {
        bool known = false, writable = false;
        uint64_t base = 0, len = 0;
    };
    static constexpr size_t kAccessBytes = 2 + 2 * sizeof(uint64_t);
    static void put_access(const AccessEntry* e, char* out) {
        std::memset(out, 0, kAccessBytes);
        if (e == nullptr) return;
        out[0] = 1;
        out[1] = e->writable ? 1 : 0;
        std::memcpy(out + 2, &e->base, sizeof(e->base));
        std::memcpy(out + 2 + sizeof(uint64_t), &e->len, sizeof(e->len));
    }
    static AccessFacts read_access(const char* in) {
        AccessFacts f;
        f.known = in[0] != 0;
        f.writable = in[1] != 0;
        std::memcpy(&f.base, in + 2, sizeof(f.base));
        std::memcpy(&f.len, in + 2 + sizeof(uint64_t), sizeof(f.len));
        return f;
    }

    // --- eager writes ------------------------------------------------------------------
    // Where NIC 0's domain allows it (eager_write_max(): fabric-efa on tcp;ofi_rxm), a lone
    // write of up to that many bytes (the one work request of its request) goes as a control
    // frame instead: its bytes, key, remote address and imm. The target's engine checks the
    // key and range against its own registrations (note_region), copies the bytes into the
    // region, counts the imm, and acknowledges the frame; the write completes when that
    // acknowledgement comes, so its bytes are in place as for a delivery-complete write. On
    // tcp a delivery-complete write costs an acknowledgement that the target's provider sends
    // before it reports the imm there, and that the writer reads before anything behind it:
    // both on a round trip's path. The engine's acknowledgement leaves after the imm is
    // counted, at the target's next step (flush_acks), and several writes' go in one frame.
    // A refusal comes back in the acknowledgement (RemoteAccessError, the same text as an
    // access check's), not as a dropped connection. An eager write whose frame the transport
    // fails, whose peer's connection state is reset (evict: lost, or suspected after a
    // transport failure), or that waits past eager_wait() for its acknowledgement fails as
    // a write cancelled with its connection would (kConnectionDropped: the target is asked
    // whether it would have taken it). Its bytes may then have landed, as for any write
    // that fails.
    //
    // Frame: [kFrameWrite][address length][writer's NIC 0 address][nonce][rkey][raddr]
    // [has imm: 1][imm: 4][bytes]. Acknowledgement: [kFrameWriteAck][address][nonce: 0] and
    // per write [nonce][known][writable][base][length][host] (what the target has under the
    // key, as access_answer says it (put_access), and whether it is host memory: the writer
    // words a refusal itself, with refusal_text).
    static constexpr size_t kEagerHead = 2 * sizeof(uint64_t) + 1 + sizeof(uint32_t);
    // the most bytes an eager write carries (efa_eager_max's bound: rxm's eager message size)
    static constexpr size_t kEagerLimit = 16384;
    // Every engine's receive buffers hold the largest frame an engine sends of its own accord:
    // an eager write's, with the largest payload and address. A target whose max_send_size is
    // below its writer's would otherwise truncate its eager frames (the provider keeps none
    // of a truncated frame, so nobody could answer the write: it waited out eager_wait()).
    static constexpr size_t kFrameFloor = 3 + 255 + sizeof(uint64_t) + kEagerHead + kEagerLimit;
    static constexpr size_t kAckEntry = sizeof(uint64_t) + kAccessBytes + 1;
    static constexpr int kEagerFrame = 4;  // OpCtx::kind of an eager write's frame (its send)
    // send slots eager writes leave to the control channel (probes, acknowledgements): past
    // them a write goes through the provider
    static constexpr size_t kEagerSlotReserve = 8;
    static constexpr auto kEagerWaitMin = std::chrono::seconds(1);
    static constexpr auto kEagerWaitMax = std::chrono::seconds(60);

    struct EagerOut {
        OpCtx* op;
        PeerState* peer;
        Clock::time_point sent;
    };
    struct EagerDrop {
        OpCtx* op;
        int32_t status;
        std::string message;
    };

    template <class D>
    static auto eager_max_of(const D& d, int) -> decltype(size_t(d.eager_write_max())) {
        return d.eager_write_max();
    }
    template <class D>
    static size_t eager_max_of(const D&, long) {
        return 0;
    }

    template <class D>
    static auto nic_down_of(const D& d, int) -> decltype(bool(d.nic_down())) {
        return d.nic_down();
    }
    template <class D>
    static bool nic_down_of(const D&, long) {
        return false;
    }

    bool eager_fits(uint32_t n, const WriteOp& w, const OpCtx& op) const {
        return n == 0 && w.len > 0 && w.len <= eager_max_ && !w.batch && op.mode == OpCtx::kAsPlanned &&
               free_slots_.size() > kEagerSlotReserve && !nic_down_of(*nics_[0], 0);
    }

    // Sends ``op`` (a write on NIC 0, ``w`` as the domain would have had it) as an eager
    // frame to ``p``; the domain's post_send's result.
    int post_eager(const WriteOp& w, OpCtx& op, PeerState& p) {
        const uint64_t nonce = ++eager_nonce_;
        OpCtx* f = new_probe();
        f->kind = kEagerFrame;
        f->dst_off = nonce;
        f->src = uint64_t(free_slots_.back()) + 1;
        free_slots_.pop_back();
        char* slot = send_slot(f->src - 1);
        char* at = put_head(slot, kFrameWrite, nonce);
        std::memcpy(at, &w.rkey, sizeof(w.rkey));
        at += sizeof(w.rkey);
        std::memcpy(at, &w.raddr, sizeof(w.raddr));
        at += sizeof(w.raddr);
        *at++ = w.has_imm ? 1 : 0;
        std::memcpy(at, &w.imm, sizeof(w.imm));
        at += sizeof(w.imm);
        std::memcpy(at, w.src, static_cast<size_t>(w.len));
        at += w.len;
        int rc = nics_[0]->post_send(slot, static_cast<size_t>(at - slot), send_desc_, w.peer, f);
        if (rc != 0) {
            release_probe(*f);
            return rc;
        }
        eager_out_.emplace(nonce, EagerOut{&op, &p, now_});
        NicTraffic::bump(eager_writes_);
        return 0;
    }

    // The eager write of frame ``nonce``, no longer waited for; null if it was not (answered,
    // or failed, already).
    OpCtx* take_eager(uint64_t nonce) {
        auto it = eager_out_.find(nonce);
        if (it == eager_out_.end()) return nullptr;
        OpCtx* op = it->second.op;
        eager_out_.erase(it);
        return op;
    }

    // A target's side: an eager write from ``from``, applied (or refused) and acknowledged.
    void got_eager_write(const std::string& from, uint64_t nonce, const char* extra, size_t elen) {
        if (elen < kEagerHead) return;  // malformed: its writer's wait runs out
        uint64_t rkey, raddr;
        uint32_t imm;
        std::memcpy(&rkey, extra, sizeof(rkey));
        std::memcpy(&raddr, extra + 8, sizeof(raddr));
        const bool has_imm = extra[16] != 0;
        std::memcpy(&imm, extra + 17, sizeof(imm));
        const char* bytes = extra + kEagerHead;
        const uint64_t len = elen - kEagerHead;
        char entry[kAckEntry] = {};
        std::memcpy(entry, &nonce, sizeof(nonce));
        bool landed = false;
        {
            // (held over the copy: a region is forgotten before it is deregistered, so no copy
            // reaches memory its owner got back)
            std::lock_guard<std::mutex> lock(access_mu_);
            const AccessEntry* e = find_access(0, rkey);
            put_access(e, entry + sizeof(nonce));
            entry[sizeof(nonce) + kAccessBytes] = e != nullptr && e->host ? 1 : 0;
            if (e != nullptr && e->host && !refuses(true, e->writable, e->base, e->len, raddr, len)) {
                std::memcpy(reinterpret_cast<char*>(e->ptr) + (raddr - e->base), bytes, static_cast<size_t>(len));
                landed = true;
            }
        }
        if (landed) {
            NicTraffic::bump(eager_landed_);
            if (has_imm) {  // (as NIC 0's domain reports an imm)
                imm_counts_[imm]++;
                NicTraffic::bump(traffic_[0].imms);
            }
        }
        acks_[from].append(entry, kAckEntry);
    }

    // Sends the acknowledgements due, one frame per writer (more where they do not fit one);
    // those the provider cannot take now stay for the next step. Whether any went. Called by
    // the next step after the one that applied the writes (before its polls), not by an
    // inline submit: so a target's waiter that polled an eager write itself returns as soon
    // as it counted its imm, and an answer it then sends leaves before the acknowledgement. The acknowledgement does not wake a napping worker (spinning(): it is
    // not work in flight); it waits at most for the worker's nap, or the next waiter's step.
    // Waking it cost the round trip twice the time on the 2-core machine: the woken worker
    // then polled on beside the waiters of both sides, on two CPUs (forward leg 25-37 us
    // against 8.7 for a delivery-complete write; docs/backends/efa.md).
    bool flush_acks() {
        bool sent = false;
        const size_t head = frame_head();
        const size_t per = frame_ > head ? (frame_ - head) / kAckEntry * kAckEntry : 0;
        for (auto it = acks_.begin(); it != acks_.end();) {
            std::string& due = it->second;
            while (!due.empty() && per > 0) {
                const size_t take = std::min(due.size(), per);
                int error = 0;
                if (send_frame(kFrameWriteAck, it->first, nullptr, &error, 0, false, due.substr(0, take))) {
                    due.erase(0, take);
                    sent = true;
                } else {
                    if (error != 0 && error != -EAGAIN) due.clear();  // refused: its writer's wait runs out
                    break;
                }
            }
            it = due.empty() ? acks_.erase(it) : std::next(it);
        }
        return sent;
    }

    // A writer's side: acknowledgements from ``from``.
    void got_eager_acks(const std::string& from, const char* extra, size_t elen) {
        Sink sink{this, 0};
        for (size_t at = 0; at + kAckEntry <= elen; at += kAckEntry) {
            const char* e = extra + at;
            uint64_t nonce;
            std::memcpy(&nonce, e, sizeof(nonce));
            auto it = eager_out_.find(nonce);
            if (it == eager_out_.end() || it->second.peer->address != from) continue;  // failed already
            OpCtx* op = it->second.op;
            eager_out_.erase(it);
            const AccessFacts a = read_access(e + sizeof(nonce));
            const bool host = e[sizeof(nonce) + kAccessBytes] != 0;
            const Request& r = *op->request;
            const Target& t = *r.targets[op->target];
            const uint64_t raddr = (nics_[0]->virt_addr() ? t.remote_base : 0) + op->dst_off;
            std::string why = refusal_text(a.known, a.writable, a.base, a.len, raddr, op->len, t.rkeys[0], 0);
            if (nic_down_of(*nics_[0], 0)) {  // (as the domain reports its writes then)
                sink.on_error(op, kTransport, "NIC down (injected): acknowledgement lost");
            } else if (!why.empty()) {
                sink.on_error(op, kRemoteAccess, why);
            } else if (!host) {
                sink.on_error(op, kTransport,
                              "the target's region is device memory, which an eager write cannot reach (its "
                              "writer's efa_eager_max must be 0 for it)");
            } else {
                sink.on_write_done(op);  // (may free the op's request: not touched after)
            }
        }
    }

    // ``p``'s connection state goes (evict): its eager writes waiting for an acknowledgement
    // fail at the end of this step (fail_dropped_eager), as writes its connection took along.
    void drop_eager(PeerState& p, const char* why) {
        if (eager_out_.empty()) return;
        drop_eager_where([&](const EagerOut& e) { return e.peer == &p; },
                         p.lost ? int32_t(kPeerUnreachable) : int32_t(kConnectionDropped),
                         std::string("eager write not acknowledged: ") + why);
    }

    // Moves the eager writes ``drop`` picks out of eager_out_, to fail with ``status``.
    template <class Pick>
    void drop_eager_where(Pick drop, int32_t status, const std::string& message) {
        for (auto it = eager_out_.begin(); it != eager_out_.end();) {
            if (!drop(it->second)) {
                ++it;
                continue;
            }
            eager_dropped_.push_back(EagerDrop{it->second.op, status, message});
            it = eager_out_.erase(it);
        }
    }

    bool fail_dropped_eager() {
        std::vector<EagerDrop> dropped;
        dropped.swap(eager_dropped_);
        Sink sink{this, 0};
        for (auto& d : dropped) sink.on_error(d.op, d.status, d.message);
        return !dropped.empty();
    }

    // How long an eager write waits for its acknowledgement: as long as a liveness probe.
    Clock::duration eager_wait() const {
        return std::clamp<Clock::duration>(probe_timeout_, kEagerWaitMin, kEagerWaitMax);
    }

    // tick: eager writes unacknowledged past eager_wait() (a frame lost with a connection
    // the transport replaced unseen) fail.
    void eager_tick() {
        const auto wait = eager_wait();
        drop_eager_where([&](const EagerOut& e) { return now_ - e.sent >= wait; }, kConnectionDropped,
                         "eager write not acknowledged within " +
                             std::to_string(std::chrono::duration<double>(wait).count()) + " s");
    }

    // --- access checks -----------------------------------------------------------------
    // A write the provider cancelled because its connection went (kConnectionDropped: tcp's
    // target drops the connection when a key is refused, and the writer sees only its queued
    // work cancelled, as it may for a peer that died) is held while the target is asked, on
    // the control channel, what it has registered under the write's key on that NIC (the peer
    // is suspected as before: a dead one fails its probe, and the write then fails as it did). The answer makes it a RemoteAccessError where the target would
    // have refused it (no such key: never issued, or deregistered; no remote write; the range
    // outside the region), else the failure it was. No answer within kAccessWait (a target
    // gone, a control channel down), or the request ended meanwhile: the failure it was. One
    // question per target, NIC and key is out at a time; the writes it covers wait on it.
    // A question out, with the failed writes it holds.
    struct AccessHeld {
        OpCtx* op;
        int32_t status;
        std::string message;
        uint64_t raddr;  // the write's remote address, as posted
        uint64_t len;    // its bytes (a list op: the span from its lowest page to its highest)
    };
    struct AccessCheck {
        std::string to;  // the target's NIC 0 address
        uint32_t nic = 0;
        uint64_t key = 0;
        uint64_t nonce = 0;
        Clock::time_point asked{}, sent{};  // sent: when last asked (epoch: not yet)
        Clock::time_point lost_at{};         // a refused probe's verdict, held until then
        std::string lost_why;
        std::vector<AccessHeld> ops;
    };
    bool check_access(OpCtx& op, int32_t status, const std::string& message) {
        Request& r = *op.request;
        if (r.abandoned || op.target >= r.targets.size()) return false;
        Target& t = *r.targets[op.target];
        if (t.state == nullptr || t.state->lost || op.nic >= t.rkeys.size() || op.nic >= nics_.size()) return false;
        uint64_t key = t.rkeys[op.nic];
        uint64_t raddr = (nics_[op.nic]->virt_addr() ? t.remote_base : 0) + op.dst_off;
        uint64_t len = op.len;
        if (op.pages) {  // its pages' span: a refusal of any page refuses the whole op
            const uint64_t* dst = r.list_dst.data() + op.first_page;
            auto [lo, hi] = std::minmax_element(dst, dst + op.pages);
            raddr = (nics_[op.nic]->virt_addr() ? t.remote_base : 0) + *lo;
            len = *hi - *lo + op.len;
        }
        const std::string& to = t.state->address;
        auto it = std::find_if(access_checks_.begin(), access_checks_.end(), [&](const AccessCheck& c) {
            return c.to == to && c.nic == op.nic && c.key == key;
        });
        if (it == access_checks_.end()) {
            AccessCheck c;
            c.to = to;
            c.nic = op.nic;
            c.key = key;
            c.nonce = ++access_nonce_;
            c.asked = now_;
            access_checks_.push_back(std::move(c));
            it = std::prev(access_checks_.end());
        }
        it->ops.push_back(AccessHeld{&op, status, message, raddr, len});
        return true;
    }

    void ask_access(AccessCheck& c) {
        std::string extra(1 + sizeof(uint64_t), '\0');
        extra[0] = static_cast<char>(c.nic);
        std::memcpy(&extra[1], &c.key, sizeof(uint64_t));
        c.sent = now_;  // (a frame the provider cannot take now is asked again at the next retry)
        send_frame(kFrameAccess, c.to, nullptr, nullptr, c.nonce, false, extra);
    }

    // A target's side: what it has registered under a key on a NIC, as an answer.
    std::string access_answer(const char* extra, size_t len) {
        std::string out(kAccessBytes, '\0');
        if (len < 1 + sizeof(uint64_t)) return out;
        uint32_t nic = uint8_t(extra[0]);
        uint64_t key;
        std::memcpy(&key, extra + 1, sizeof(key));
        std::lock_guard<std::mutex> lock(access_mu_);
        put_access(find_access(nic, key), out.data());
        return out;
    }

    // What this engine has under ``key`` on ``nic`` (null: nothing); access_mu_ held.
    const AccessEntry* find_access(uint32_t nic, uint64_t key) const {
        if (nic >= access_.size()) return nullptr;
        auto it = access_[nic].find(key);
        return it == access_[nic].end() ? nullptr : &it->second;
    }

    // The target's answer: settle the writes held on the question.
    void got_access_answer(const std::string& from, uint64_t nonce, const char* body, size_t len) {
        if (len < kAccessBytes) return;  // malformed: the question times out
        auto it = std::find_if(access_checks_.begin(), access_checks_.end(),
                               [&](const AccessCheck& c) { return c.to == from && c.nonce == nonce; });
        if (it == access_checks_.end()) return;  // answered already, or given up on
        AccessCheck c = std::move(*it);
        access_checks_.erase(it);
        const AccessFacts a = read_access(body);
        // Why the target would have refused a held write ("": it would have taken it).
        auto refusal = [&](const AccessHeld& h) {
            return refusal_text(a.known, a.writable, a.base, a.len, h.raddr, h.len, c.key, c.nic);
        };
        std::vector<std::pair<AccessHeld*, std::string>> verdicts;
        for (auto& h : c.ops) verdicts.emplace_back(&h, h.op->request->abandoned ? std::string() : refusal(h));
        // Refused writes settle first: a request with a refused work request fails as refused,
        // though others of it (inside the region) were cancelled with the connection.
        std::stable_partition(verdicts.begin(), verdicts.end(), [](const auto& v) { return !v.second.empty(); });
        for (auto& [h, why] : verdicts) {
            h->op->state = OpCtx::kPosted;
            if (why.empty()) {
                fail_op(*h->op, h->status, h->message);  // it would have taken it: the failure it was
            } else {
                fail_op(*h->op, kRemoteAccess, why);
            }
        }
    }

    // tick: questions asked again every kFenceRetry (a connection being rebuilt loses what was
    // queued on it), given up on after kAccessWait, or once their target is lost or every
    // write they hold belongs to an ended request.
    void access_tick() {
        for (size_t i = 0; i < access_checks_.size();) {
            AccessCheck& c = access_checks_[i];
            bool ended = std::all_of(c.ops.begin(), c.ops.end(),
                                     [](const AccessHeld& h) { return h.op->request->abandoned; });
            auto ps = peer_state_.find(c.to);
            bool lost = ps != peer_state_.end() && ps->second.lost;
            if (ended || lost || now_ - c.asked >= kAccessWait) {
                AccessCheck gone = std::move(c);
                access_checks_.erase(access_checks_.begin() + static_cast<std::ptrdiff_t>(i));
                for (auto& h : gone.ops) {
                    h.op->state = OpCtx::kPosted;
                    fail_op(*h.op, h.status, h.message);
                }
                continue;
            }
            // A probe the transport refused while the question was out (suspect() probes the
            // peer at once) is not taken for the peer's death at once: a target that refused a
            // key drops the connection, and the first frames on the next may be refused too.
            // Unanswered by then, the peer is lost as the probe said.
            if (c.lost_at != Clock::time_point{} && now_ >= c.lost_at && ps != peer_state_.end()) {
                std::string why = c.lost_why;
                c.lost_at = Clock::time_point{};
                peer_lost(ps->second, why);  // (its requests end: the next tick settles them)
                i++;
                continue;
            }
            // First asked kAccessSettle after the failure (the target drops its side of the
            // connection meanwhile), then again every kAccessRetry until answered.
            if (c.sent == Clock::time_point{} ? now_ - c.asked >= kAccessSettle : now_ - c.sent >= kAccessRetry)
                ask_access(c);
            i++;
        }
    }

    // --- NIC loss -----------------------------------------------------------------------
    // A sender's hello: its NIC addresses. Its imms on NICs > 0 are attributed to it from
    // now on (each address resolved to the handle the domain reports as their source); a
    // new session starts its counts afresh.
    void got_hello(const std::string& from, uint64_t session, const char* extra, size_t len) {
        if (len < 9) return;
        PeerState& p = state_for(from);
        if (p.paths.size() != nics_.size()) p.paths.resize(nics_.size());
        size_t count = uint8_t(extra[8]), off = 9;
        std::vector<std::string> addrs;
        for (size_t i = 0; i < count && off < len; i++) {
            size_t alen = uint8_t(extra[off]);
            if (off + 1 + alen > len) return;  // malformed
            addrs.emplace_back(extra + off + 1, alen);
            off += 1 + alen;
        }
        if (p.rx_session != session) {
            for (auto& path : p.paths) path.rx = PowerSums{};
            p.rx_session = session;
        }
        if (p.nic_addrs.size() < nics_.size()) p.nic_addrs.resize(nics_.size());
        for (uint32_t k = 1; k < nics_.size() && k < addrs.size(); k++) {
            // (a sender of this NIC from now on, whether or not its address resolves here)
            if (!nic_sender_[k]) {
                nic_sender_[k] = &p;
            } else if (nic_sender_[k] != &p) {
                nic_shared_[k] = 1;
            }
            uint64_t handle = 0;
            if (!resolve(k, addrs[k], handle)) continue;
            p.nic_addrs[k] = addrs[k];
            attrib_[k][handle] = &p;
            p.paths[k].unattributed_at_hello = unattributed_[k];
        }
        std::string ack(9, '\0');
        std::memcpy(&ack[0], &incarnation_, 8);
        ack[8] = 1;  // (unread: every target keeps counts per sender; a query's answer says
                     // whether they are exact, answer_queries)
        send_or_queue(kFrameHelloAck, from, session, std::move(ack));
    }

    // Answers (to a hello, a count query) must not be lost to a provider that cannot take a
    // send yet (a connection still coming up: -EAGAIN): they wait in the outbox, in order.
    void send_or_queue(char type, const std::string& to, uint64_t nonce, std::string extra) {
        bool queued = std::any_of(outbox_.begin(), outbox_.end(), [&](const OutFrame& f) { return f.to == to; });
        int error = 0;
        if (!queued && send_frame(type, to, nullptr, &error, nonce, false, extra)) return;
        if (queued || error == 0 || error == -EAGAIN) outbox_.push_back(OutFrame{type, to, nonce, std::move(extra)});
    }

    // Sends what the outbox holds (for ``to`` only, if given); true if none of it is left.
    bool flush_outbox(const std::string* to = nullptr) {
        bool clear = true;
        std::vector<std::string> blocked;  // peers whose earlier frame is still waiting
        std::vector<OutFrame> left;
        for (auto& f : outbox_) {
            bool mine = to == nullptr || f.to == *to;
            bool behind = std::find(blocked.begin(), blocked.end(), f.to) != blocked.end();
            int error = 0;
            if (!mine || behind || !send_frame(f.type, f.to, nullptr, &error, f.nonce, false, f.extra)) {
                if (mine && !behind && error != 0 && error != -EAGAIN) continue;  // refused: dropped
                if (mine) clear = false;
                if (!behind) blocked.push_back(f.to);
                left.push_back(std::move(f));
            }
        }
        outbox_.swap(left);
        return clear;
    }

    // A write failed (``posted``: the provider took it, so it may have landed all the same)
    // on a path that NIC loss handles: the path goes down for a while and the write is
    // retried on another NIC, at once for bytes only (idempotent), after reconciliation for a
    // WriteImm. Returns false where the failure is the request's (NIC 0, a refused key, a
    // request already ended): the caller fails the op as before.
    bool path_lost(OpCtx& op, int32_t status, const std::string& message, bool posted) {
        if (op.kind != 0 || op.nic == 0 || status == kRemoteAccess) return false;
        Request& r = *op.request;
        if (op.target >= r.targets.size() || r.targets[op.target]->state == nullptr) return false;
        PeerState& p = *r.targets[op.target]->state;
        if (p.lost || p.paths.size() <= op.nic) return false;
        PathState& path = p.paths[op.nic];
        if (r.abandoned) {  // ended: failed as it is, but what it may have counted is owed
            if (posted && op_imm(op) && p.session_ok) path.ghosts[r.imm]++;
            return false;
        }
        NicTraffic::bump(traffic_[op.nic].retries);
        if (!posted) {  // refused at posting: a failure of this NIC all the same
            NicTraffic::bump(traffic_[op.nic].errors);
            p.errors++;
        }
        if (now_ >= path.down_until) {  // newly down: a fresh connection when it is tried again
            path.down_until = now_ + path_retry_after() * (1u << std::min<uint32_t>(path.fails++, 4));
            evict_path(p, op.nic);
            last_path_error_ = message;
        }
        retries_.fetch_add(1, std::memory_order_relaxed);
        bool imm = op_imm(op);
        if (imm && posted) {
            op.state = OpCtx::kQueued;
            path.failed.push_back(&op);  // reconciled once the path is quiet (tick)
            return true;
        }
        requeue(op);  // bytes only, or never posted: retried as it is
        return true;
    }

    // How long a path may refuse or sit on work requests before it counts as lost: as long
    // as a peer may leave a probe unanswered; once it has failed (and not recovered), at most
    // a second (or a retry interval, if longer), so that trying a dead path again costs
    // little, yet a connection being set up on a busy host is not given up on.
    Clock::duration stall_limit(const PathState* path) const {
        if (path != nullptr && path->fails > 0)
            return std::min(probe_timeout_, std::max<Clock::duration>(path_retry_after(), std::chrono::seconds(1)));
        return probe_timeout_;
    }

    Clock::duration path_retry_after() const {
        return probe_interval_ == Clock::duration::max() ? std::chrono::seconds(1)
                                                         : std::max<Clock::duration>(probe_interval_, kPathRetryMin);
    }

    void requeue(OpCtx& op) {
        op.state = OpCtx::kQueued;
        pending_[op.nic].push_back(&op);  // post() moves it off a path that is down
    }

    // The path to ``p`` on NIC ``n`` is dead: forget the peer's address there (its connection),
    // here and, through a control frame, at the peer.
    void evict_path(PeerState& p, uint32_t n) {
        reset_path(p, n);
        send_or_queue(kFramePathReset, p.address, 0, std::string(1, static_cast<char>(n)));
    }

    // Forgets the peer's address on NIC ``n`` only and resolves it again at once: the handle
    // is also how its imms are attributed here.
    void reset_path(PeerState& p, uint32_t n) {
        if (n >= p.nic_addrs.size() || p.nic_addrs[n].empty()) return;
        const std::string& a = p.nic_addrs[n];
        if (!forget_address(n, a)) return;
        epoch_++;
        uint64_t handle = 0;
        if (resolve(n, a, handle) && p.rx_session != 0) attrib_[n][handle] = &p;
    }

    // Sends a one-byte frame to ``p`` on NIC ``n`` (its address there), where the domain's
    // connections can go stale: a connection to ``p`` that ``p`` dropped (its NIC reset it,
    // and this side, which only received on it, never saw that) still looks alive here, and
    // rxm refuses each new connection ``p`` makes from the same process while it does
    // (EALREADY: "simultaneous connect"), so ``p``'s path would never come back. Sending on it
    // meets the reset, and the provider drops it. On a live connection the poke arrives where
    // no receive is posted (NICs > 0 take none): rxm keeps it as an unexpected message, one
    // small buffer per poke until the endpoint closes, and pokes are as rare as path resets.
    // Its completion, good or bad, only frees its context.
    void poke(PeerState& p, uint32_t n) {
        if (!nics_[n]->stale_peers() || n >= p.nic_addrs.size() || p.nic_addrs[n].empty()) return;
        uint64_t handle = 0;
        if (!resolve(n, p.nic_addrs[n], handle)) return;
        if (!poke_ready_[n]) {
            try {
                poke_desc_[n] = nics_[n]->local_desc(&poke_frame_[n], 1);
            } catch (const std::exception&) {
                return;  // no poke: the path may stay refused (as before pokes)
            }
            poke_ready_[n] = 1;
        }
        OpCtx* op = new_probe();  // no slot, no peer it probes: its end only releases it
        op->nic = n;
        if (nics_[n]->post_send(&poke_frame_[n], 1, poke_desc_[n], handle, op) == 0) {
            pokes_sent_++;
        } else {
            release_probe(*op);  // -EAGAIN (connecting): a new connection is not stale
        }
    }

    // An imm counted on NIC ``nic`` > 0 goes to its sender's sums: the sender whose handle the
    // domain reported as its source, or, where the domain reported none (a provider without
    // FI_SOURCE, or one that leaves it out: libfabric 2.x's rxm does for every remote write),
    // the one engine that ever said hello naming this NIC, if only one ever did. WriteImms use
    // a NIC > 0 only once their sender's hello was answered, so then none can come from anyone
    // else. Otherwise the imm is unattributed, and no sender's counts on this NIC are exact
    // any more (answer_queries).
    void attribute(uint32_t nic, uint64_t src, uint32_t imm) {
        auto& m = attrib_[nic];
        auto it = m.find(src);
        PeerState* sender = it != m.end() ? it->second : nullptr;
        if (src == kNoSource) sourceless_[nic]++;
        if (!sender && src == kNoSource && !nic_shared_[nic] && nic_sender_[nic] && nic_sender_[nic]->rx_session != 0)
            sender = nic_sender_[nic];
        if (!sender) {
            unattributed_[nic]++;
            return;
        }
        PeerState& p = *sender;
        if (p.paths.size() <= nic) p.paths.resize(nics_.size());
        p.paths[nic].rx.add(imm);
    }

    // A bytes-only retry of ``b`` ended: once all have, the carriers post their make-up imms.
    void batch_step(RetryBatch* b) {
        if (b->left > 0) b->left--;
        if (b->left > 0) return;
        std::vector<OpCtx*> carriers;
        carriers.swap(b->carriers);
        batches_.remove_if([b](const std::unique_ptr<RetryBatch>& x) { return x.get() == b; });
        for (OpCtx* c : carriers) {
            c->carrier = false;
            c->mode = OpCtx::kImmOnly;
            makeups_.fetch_add(1, std::memory_order_relaxed);
            if (c->request->abandoned) {
                settle(*c);
            } else {
                requeue(*c);
            }
        }
    }

    // Starts (or repeats) the hello of a session with ``p``: this engine's NIC addresses, so
    // that ``p`` attributes the imms it counts from them. Not while WriteImms of an older
    // session are in flight to it on NICs > 0 (their counts belong to that session).
    void start_hello(PeerState& p) {
        if (p.lost || p.session_ok) return;
        if (p.hello_sent != Clock::time_point{} && now_ - p.hello_sent < kFenceRetry) return;
        for (const auto& path : p.paths)
            if (path.imm_busy > 0 || !path.failed.empty()) return;
        if (p.session == 0) p.session = incarnation_ + (++session_seq_ << 1);
        std::string extra(sizeof(uint64_t), '\0');
        std::memcpy(&extra[0], &incarnation_, sizeof(uint64_t));
        extra.push_back(static_cast<char>(nics_.size()));
        for (const auto& d : nics_) {
            std::string a = d->address();
            if (a.size() > 255) return;  // cannot be told: NICs > 0 stay off for its WriteImms
            extra.push_back(static_cast<char>(a.size()));
            extra += a;
        }
        send_or_queue(kFrameHello, p.address, p.session, std::move(extra));
        p.hello_sent = now_;
    }

    void end_session(PeerState& p) {
        p.session_ok = false;
        p.session = 0;
        p.hello_sent = Clock::time_point{};
    }

    // tick: reconcile quiet paths with failures, answer the peers' count queries.
    void nic_loss_tick() {
        for (auto& [addr, p] : peer_state_) {
            for (uint32_t k = 1; k < p.paths.size(); k++) {
                PathState& path = p.paths[k];
                if (path.busy > 0 && !p.lost && now_ >= path.down_until && now_ - path.progress >= stall_limit(&path)) {
                    // Work requests outstanding on it and none completed for as long as a peer
                    // may stay silent, while the peer itself answers (on NIC 0): the NIC went
                    // quiet (a link down says nothing on tcp). Dropping the peer's address there
                    // makes the provider fail what it holds (rxm closes the connection), and
                    // those failures take the path down and are retried as any other.
                    path.down_until = now_ + path_retry_after() * (1u << std::min<uint32_t>(path.fails++, 4));
                    path.progress = now_;
                    last_path_error_ = "no work request completed on it in " +
                                       std::to_string(std::chrono::duration<double>(probe_timeout_).count()).substr(0, 5) +
                                       " s";
                    evict_path(p, k);
                    // A provider may hold them for as long as TCP retransmits (tcp;ofi_rxm: its
                    // connection outlives the address): their connections are reset while the
                    // path is avoided (nothing new goes on it meanwhile), so that it fails them.
                    path.cut_until = path.down_until;
                }
                if (path.busy > 0 && now_ < path.cut_until && now_ - path.cut_last >= kCutEvery) {
                    path.cut_last = now_;
                    if (k < p.nic_addrs.size() && !p.nic_addrs[k].empty())
                        paths_cut_ += abort_path_of(*nics_[k], p.nic_addrs[k], 0);
                }
                if (path.failed.empty() && path.ghosts.empty()) continue;
                // requests that ended meanwhile (deadline, cancel): nothing to retry
                auto ended = std::stable_partition(path.failed.begin(), path.failed.end(),
                                                   [](OpCtx* op) { return !op->request->abandoned; });
                std::vector<OpCtx*> gone(ended, path.failed.end());
                path.failed.erase(ended, path.failed.end());
                for (OpCtx* op : gone) {
                    path.ghosts[op->request->imm]++;  // (it may have been counted all the same)
                    settle(*op);
                }
                if (path.failed.empty() && path.ghosts.empty()) {
                    path.querying = false;
                    continue;
                }
                if (path.imm_busy > 0) continue;  // not quiet yet
                if (!p.session_ok) {
                    fail_path(p, k, "its NIC " + std::to_string(k) + " was lost (" + last_path_error_ +
                                        ") and the peer cannot tell which of its WriteImms it counted");
                    continue;
                }
                static_assert(3 + 255 + 8 + 17 + sizeof(Sums) <= kFrameFloor, "a count answer fits every frame");
                if (path.querying && now_ - path.query_sent < kFenceRetry) continue;
                // (asked again with a new nonce; any answer of this round will do: each was
                // asked once the path was quiet)
                path.query_nonce = ++query_nonce_;
                if (!path.querying) path.query_first = path.query_nonce;
                std::string extra(1, static_cast<char>(k));
                if (send_frame(kFrameQuery, p.address, nullptr, nullptr, path.query_nonce, false, extra)) {
                    path.querying = true;
                    path.query_sent = now_;
                }
            }
        }
        if (queries_.empty()) return;
        // Everything the peer had counted before asking is in the CQs: take it all first.
        for (int i = 0; i < 64 && poll_all(); i++) {
        }
        std::vector<Query> queries;
        queries.swap(queries_);
        for (const Query& q : queries) {
            auto it = peer_state_.find(q.from);
            uint8_t valid = 0;
            PowerSums sums;
            uint64_t session = 0;
            if (it != peer_state_.end() && q.nic < nics_.size() && q.nic > 0) {
                PeerState& p = it->second;
                if (p.paths.size() <= q.nic) p.paths.resize(nics_.size());
                session = p.rx_session;
                sums = p.paths[q.nic].rx;
                valid = session != 0 && unattributed_[q.nic] == p.paths[q.nic].unattributed_at_hello;
            }
            std::string extra(2 * sizeof(uint64_t) + 1 + sizeof(Sums), '\0');
            std::memcpy(&extra[0], &session, sizeof(uint64_t));
            std::memcpy(&extra[8], &incarnation_, sizeof(uint64_t));
            extra[16] = static_cast<char>(valid);
            std::memcpy(&extra[17], sums.s.data(), sizeof(Sums));
            send_or_queue(kFrameCounts, q.from, q.nonce, std::move(extra));
        }
    }

    // Fails every WriteImm waiting on path (p, k): what landed of them cannot be told.
    void fail_path(PeerState& p, uint32_t k, const std::string& why) {
        PathState& path = p.paths[k];
        std::vector<OpCtx*> failed;
        failed.swap(path.failed);
        path.ghosts.clear();  // (the session they belong to is over, or cannot reconcile)
        path.querying = false;
        unreconciled_.fetch_add(failed.size(), std::memory_order_relaxed);
        for (OpCtx* op : failed) {
            op->state = OpCtx::kPosted;
            fail_op(*op, kTransport, why);
        }
    }

    // The peer's answer to a count query for path k: settle its failed WriteImms.
    void reconcile(PeerState& p, uint32_t k, const char* body, size_t len) {
        PathState& path = p.paths[k];
        path.querying = false;
        if (len < 17 + sizeof(Sums)) return;  // malformed: asked again
        uint64_t session, incarnation;
        std::memcpy(&session, body, 8);
        std::memcpy(&incarnation, body + 8, 8);
        bool valid = body[16] != 0;
        PowerSums rx;
        std::memcpy(rx.s.data(), body + 17, sizeof(Sums));
        // every WriteImm that failed on the path and may have been counted: those to retry,
        // and those of ended requests (not retried)
        std::map<uint32_t, uint64_t> live, counts = path.ghosts;
        for (OpCtx* op : path.failed) {
            live[op->request->imm]++;
            counts[op->request->imm]++;
        }
        std::optional<std::map<uint32_t, uint64_t>> landed;
        const char* why = nullptr;
        if (!valid) {
            why = session == 0 ? "it holds no counts of this engine's session"
                               : "it counted imms on that NIC whose sender it could not tell";
        } else if (!p.session_ok || session != p.session || incarnation != p.peer_incarnation) {
            why = "they belong to another session";
        } else {
            landed = landed_per_imm(rx.minus(path.tx), counts);
            if (!landed) why = "they do not fit the failed WriteImms";
        }
        if (!landed) {
            end_session(p);  // a fresh session before NICs > 0 carry its WriteImms again
            fail_path(p, k, "its NIC " + std::to_string(k) + " was lost (" + last_path_error_ +
                                ") and the peer's counts do not tell which of its WriteImms landed (" + why + ")");
            return;
        }
        for (const auto& [x, n] : *landed) {
            path.tx.add(x, n);  // counted there: agree again
            landed_unacked_.fetch_add(n, std::memory_order_relaxed);
        }
        reconciled_.fetch_add(path.failed.size(), std::memory_order_relaxed);
        // Of each value's landed ones, the ended requests' are taken to be first: a live
        // WriteImm is made up unless it surely landed. (Where both carry one value, the
        // target may count up to the ended ones' number more: what an ended request may
        // land, as it could have had it not failed.)
        std::map<uint32_t, uint64_t> short_by;
        for (const auto& [x, n] : live) {
            uint64_t ghost = path.ghosts.count(x) ? path.ghosts[x] : 0;
            uint64_t got = (*landed)[x];
            short_by[x] = n - std::min<uint64_t>(n, got > ghost ? got - ghost : 0);
        }
        std::map<uint32_t, bool> all_landed;
        for (const auto& [x, n] : short_by) all_landed[x] = n == 0;
        path.ghosts.clear();
        std::vector<OpCtx*> failed;
        failed.swap(path.failed);
        RetryBatch* batch = nullptr;
        for (OpCtx* op : failed) {
            uint32_t x = op->request->imm;
            if (all_landed[x]) {  // every one of this value landed
                op->state = OpCtx::kPosted;
                finish_op(*op);
                continue;
            }
            // the bytes again, without imm; the make-up imms once all of them are in place
            if (batch == nullptr) {
                batches_.push_back(std::make_unique<RetryBatch>());
                batch = batches_.back().get();
            }
            op->mode = OpCtx::kBytesOnly;
            op->retry = batch;
            batch->left++;
            if (short_by[x] > 0) {
                short_by[x]--;
                op->carrier = true;
            }
            requeue(*op);
        }
    }

    // --- failure detection --------------------------------------------------------------
    static Clock::duration to_duration(double s) {
        if (!std::isfinite(s) || s > 1e9) return Clock::duration::max();
        return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::max(s, 0.0)));
    }

    PeerState& state_for(const std::string& address) {
        auto [it, fresh] = peer_state_.try_emplace(address);
        if (fresh) {
            it->second.address = address;
            it->second.heard = now_;  // a new peer gets an interval before it is probed
            it->second.paths.resize(nics_.size());
        }
        return it->second;
    }

    void heard(PeerState& p) {
        p.heard = now_;
        p.probe_sent = Clock::time_point{};
        p.probe_posted = false;
        if (p.lost) {
            p.lost = false;
            revived_.push_back(p.address);
        }
    }

    // Sends a ping or a pong to ``to`` (NIC 0 address) from a probe slot; false if it could
    // not be posted now (no slot, a full NIC: the next tick tries again) or the peer refused.
    // ``about``: the peer a ping probes (its failure then says the peer is gone); null: a pong.
    bool send_frame(char type, const std::string& to, PeerState* about = nullptr, int* error = nullptr,
                    uint64_t nonce = 0, bool fencing = false, const std::string& extra = std::string()) {
        if (ClosedSet::instance().contains(to)) {  // an endpoint of this process, closed: its
            if (error) *error = -EHOSTUNREACH;      // memory is gone (shm), nothing may reach it
            return false;
        }
        if (free_slots_.empty()) return false;
        if (frame_head() + extra.size() > frame_) {
            if (error) *error = -EMSGSIZE;  // max_send_size too small for it: never sent
            return false;
        }
        uint64_t handle = 0;
        if (!resolve(0, to, handle)) {
            if (error) *error = -EHOSTUNREACH;
            return false;
        }
        OpCtx* op = new_probe();
        op->target = fencing ? 1 : 0;
        op->dst_off = reinterpret_cast<uint64_t>(about);
        op->src = uint64_t(free_slots_.back()) + 1;
        free_slots_.pop_back();
        char* slot = send_slot(op->src - 1);
        char* body = put_head(slot, type, nonce);
        if (!extra.empty()) std::memcpy(body, extra.data(), extra.size());
        int rc = nics_[0]->post_send(slot, size_t(body - slot) + extra.size(), send_desc_, handle, op);
        if (rc != 0) {
            release_probe(*op);
            if (error) *error = rc;
            return false;
        }
        return true;
    }

    // A fresh context for a frame that belongs to no request (probe, answer, poke): kind 3,
    // from the free list, or a new one (probe_ctx_ keeps their addresses stable).
    OpCtx* new_probe() {
        OpCtx* op;
        if (free_probes_.empty()) {
            probe_ctx_.emplace_back();
            op = &probe_ctx_.back();
        } else {
            op = free_probes_.back();
            free_probes_.pop_back();
        }
        *op = OpCtx{};
        op->kind = 3;
        return op;
    }

    void release_probe(OpCtx& op) {
        if (op.src != 0) free_slots_.push_back(static_cast<uint32_t>(op.src - 1));
        op.src = 0;
        free_probes_.push_back(&op);
    }

    void probe_failed(OpCtx& op, int32_t status, const std::string& message) {
        auto* about = reinterpret_cast<PeerState*>(op.dst_off);
        bool fencing = op.target == 1;
        release_probe(op);
        if (about != nullptr && fencing) {  // the connection went: retry on a fresh one
            evict(*about);
            return;
        }
        // A ping the transport refuses says the peer is gone; any other failure leaves it to
        // the unanswered-probe deadline.
        if (about != nullptr && status == kPeerUnreachable) {
            std::string why = "the transport refused a liveness probe: " + message;
            // A write to it is held on an access check (check_access): the refusal may be the
            // connection the target dropped over a refused key. The check's answer, if it comes
            // within kAccessGrace, says the peer lives.
            auto held = std::find_if(access_checks_.begin(), access_checks_.end(),
                                     [&](const AccessCheck& c) { return c.to == about->address; });
            if (held != access_checks_.end()) {
                evict(*about);
                if (held->lost_at == Clock::time_point{}) {
                    held->lost_at = now_ + kAccessGrace;
                    held->lost_why = why;
                }
                return;
            }
            peer_lost(*about, why);
        }
    }

    // A work request failed with kPeerUnreachable: the peer it was for becomes suspect.
    void transport_lost(OpCtx& op) {
        Request& r = *op.request;
        if (r.abandoned) return;  // the aftermath of a failure already acted on (flushed WRs)
        const std::string* peer = nullptr;
        if (op.kind == 1) {
            peer = &r.send_to;
        } else if (op.target < r.targets.size() && !r.targets[op.target]->addresses.empty()) {
            peer = &r.targets[op.target]->addresses[0];
        }
        if (peer != nullptr && !peer->empty()) suspect(state_for(*peer));
    }

    // The transport failed a work request to ``p`` at the connection level. That is not proof
    // of death (tcp drops a connection over one bad key; a restarted peer refuses the old
    // connection): reset the connection state, so the next request connects anew, and probe
    // it now. Unanswered, the probe declares it lost, as for a silent peer.
    void suspect(PeerState& p) {
        evict(p);
        probe_soon(p);
    }

    // ``p`` is probed at the next tick, unless a probe is out already or probing is off
    // (deadlines only).
    void probe_soon(PeerState& p) {
        if (probe_interval_ == Clock::duration::max() || p.probe_posted) return;
        p.touched = true;
        p.heard = std::min(p.heard, now_ - probe_interval_);
    }

    // Drops address ``a`` from NIC ``n``'s address vector (and what hangs on its handle);
    // false if it was not there.
    bool forget_address(uint32_t n, const std::string& a) {
        auto it = peers_[n].find(a);
        if (it == peers_[n].end()) return false;
        attrib_[n].erase(it->second);
        try {
            nics_[n]->remove_peer(it->second);
        } catch (...) {
        }
        peers_[n].erase(it);
        return true;
    }

    void evict(PeerState& p) {
        drop_eager(p, p.lost ? "peer lost" : "its connection was reset");
        for (uint32_t n = 0; n < nics_.size(); n++) {
            const std::string& a = n == 0 ? p.address : (n < p.nic_addrs.size() ? p.nic_addrs[n] : std::string());
            if (!a.empty()) forget_address(n, a);
        }
        epoch_++;
        // It may have restarted, or dropped this engine's addresses: a new session (hello)
        // before its WriteImms use NICs > 0 again. Its own imms here go unattributed until
        // it says hello again.
        end_session(p);
        p.rx_session = 0;
        p.frame = 0;  // a process restarted at its address may take other sizes
        if (p.queued > 0 && busy_peers_ > 0) busy_peers_--;
        p.queued = 0;
        p.queued_bytes = 0;
        p.queued_lists = 0;
    }

    // Completes ``r`` now with ``status``; its posted WRs are reaped as the provider reports
    // them, its queued ones are dropped unposted.
    void abandon(Request& r, int32_t status, std::string message) {
        if (r.abandoned) return;
        r.abandoned = true;
        if (r.status == kOk) {
            r.status = status;
            r.message = message;
        }
        int32_t nic = -1;
        for (const OpCtx& op : r.ops)
            if (op.state != OpCtx::kSettled) {
                nic = static_cast<int32_t>(op.nic);
                break;
            }
        ready_.push_back(failure(r, status, std::move(message), nic));
    }

    static Completion failure(const Request& r, int32_t status, std::string message, int32_t nic) {
        std::string peer = !r.send_to.empty()                                      ? r.send_to
                           : !r.targets.empty() && !r.targets[0]->addresses.empty() ? r.targets[0]->addresses[0]
                                                                                   : std::string();
        return Completion{r.id, status, std::move(message), std::move(peer), nic};
    }

    static bool depends_on(const Request& r, const std::string& peer) {
        if (!r.send_to.empty()) return r.send_to == peer;
        for (const auto& t : r.targets)
            if (!t->addresses.empty() && t->addresses[0] == peer) return true;
        return false;
    }

    void peer_lost(PeerState& p, const std::string& given) {
        std::string why = given;
        int32_t status = kPeerUnreachable;
        if (uint8_t wire = foreign_wire(p.address)) {  // it speaks another wire protocol (got_foreign)
            status = kIncompatible;
            why += "; it speaks " + wire_text(wire) + " and this engine " + wire_text(uint8_t(wire_.load(std::memory_order_relaxed))) +
                   ", so neither reads the other's control frames: run one fabric release on every engine of a job";
        }
        std::string message = "peer lost: " + why;
        for (auto& [id, r] : live_)
            if (!r->abandoned && depends_on(*r, p.address)) abandon(*r, status, message);
        for (auto& path : p.paths) {  // WriteImms awaiting reconciliation: their requests ended
            std::vector<OpCtx*> failed;
            failed.swap(path.failed);
            path.querying = false;
            for (OpCtx* op : failed) settle(*op);
        }
        // nothing queued for it goes out any more (a dead tcp peer answers -EAGAIN forever)
        outbox_.erase(std::remove_if(outbox_.begin(), outbox_.end(), [&](const OutFrame& f) { return f.to == p.address; }),
                      outbox_.end());
        bool fresh = !p.lost;
        if (fresh) peers_lost_++;
        p.lost = true;
        p.probe_sent = Clock::time_point{};
        p.probe_posted = false;
        p.heard = now_;  // the next probe (if work still needs it) comes an interval from now
        // Evict: its address-vector entries go, and every target resolves anew (a restarted
        // process at the same address is a new peer to the provider).
        evict(p);
        if (fresh) lost_.push_back(LostPeer{p.address, why, status});
    }

    // Every kTick: deadlines, and the liveness of the peers that work depends on.
    void tick() {
        last_tick_ = now_;
        {
            std::lock_guard<std::mutex> dropped(dropped_mu_);  // fences given up without the progress lock
            for (uint64_t nonce : dropped_fences_)
                fences_.erase(std::remove_if(fences_.begin(), fences_.end(),
                                             [nonce](const Fence& f) { return f.nonce == nonce; }),
                              fences_.end());
            dropped_fences_.clear();
        }
        if (!outbox_.empty()) flush_outbox();
        if (nics_.size() > 1) nic_loss_tick();
        if (!access_checks_.empty()) access_tick();
        if (!eager_out_.empty()) eager_tick();
        if (!sized_wait_.empty()) sized_tick();
        // fence() probes: sent, and sent again every kFenceRetry until answered (a connection
        // the transport tore down loses what was queued on it: the probe is then retried on a
        // fresh one, its state reset by the failure).
        for (auto& f : fences_) {
            PeerState& p = state_for(f.address);
            if (p.answered >= f.nonce || now_ - f.sent < kFenceRetry) continue;
            if (!flush_outbox(&f.address)) continue;  // the probe goes behind what is queued
            int error = 0;
            if (send_frame(kFramePing, f.address, &p, &error, f.nonce, true)) {
                f.sent = now_;
            } else if (error != 0 && error != -EAGAIN) {
                evict(p);
            }
        }
        bool probing = probe_interval_ != Clock::duration::max();
        for (auto& [id, r] : live_) {
            if (r->abandoned) continue;
            if (now_ >= r->deadline) {
                timeouts_++;
                abandon(*r, kTimeout, deadline_message(*r));
                continue;
            }
            if (!probing || now_ - r->started < probe_interval_) continue;
            if (!r->send_to.empty()) {
                state_for(r->send_to).wanted = true;
            } else {
                for (const auto& t : r->targets)
                    if (t->state) t->state->wanted = true;
            }
        }
        if (!probing) return;
        if (now_ - last_watch_ >= probe_interval_ / 4) {  // counter waiters naming a peer
            last_watch_ = now_;
            watched_ = counters_->watched_peers();
        }
        for (const auto& a : watched_) state_for(a).wanted = true;
        {
            std::lock_guard<std::mutex> lock(touch_mu_);
            for (const auto& a : touched_) {
                PeerState& p = state_for(a);
                if (!p.probe_posted || now_ - p.probe_sent >= probe_timeout_) {  // none, or a stale one
                    p.probe_posted = false;
                    p.probe_sent = Clock::time_point{};
                    p.touched = true;
                    p.heard = std::min(p.heard, now_ - probe_interval_);  // due now
                }
            }
            touched_.clear();
        }
        for (auto& [addr, p] : peer_state_) {
            if (!p.wanted && !p.touched) continue;
            p.wanted = false;
            // This engine itself (a loopback wait names it): alive while it runs this. A probe
            // to itself says nothing, and one the provider kept refusing (on shm, after a peer
            // died mid-write) failed the engine's own loopback waits as a lost peer.
            if (addr == self_address_) {
                p.touched = false;
                continue;
            }
            // A probe left over from an earlier need (nothing depended on the peer for a while,
            // so nothing watched for its answer) says nothing of the peer now: start afresh.
            // Before, a wait that began long after an unanswered probe found the peer lost at
            // once, though its writes had been landing all along.
            if (p.probe_sent != Clock::time_point{} && p.last_wanted != Clock::time_point{} &&
                now_ - p.last_wanted > probe_interval_) {
                p.probe_sent = Clock::time_point{};
                p.probe_posted = false;
                p.heard = std::min(p.heard, now_ - probe_interval_);  // due now
            }
            p.last_wanted = now_;
            if (p.probe_sent != Clock::time_point{} && now_ - p.probe_sent >= probe_deadline(p)) {
                auto waited = std::to_string(std::chrono::duration<double>(now_ - p.probe_sent).count()).substr(0, 5);
                peer_lost(p, p.probe_posted ? "no answer to a liveness probe in " + waited + " s"
                                            : "a liveness probe could not even be posted in " + waited +
                                                  " s (the provider keeps refusing: connection not established)");
                continue;
            }
            if (p.probe_posted) {  // asked; waiting for the answer, asking again every interval
                if (now_ - p.probe_again >= probe_interval_ && send_frame(kFramePing, addr, &p)) {
                    p.probe_again = now_;
                    p.probes++;
                    probes_++;
                }
                continue;
            }
            if (p.probe_sent == Clock::time_point{} && now_ - p.heard < probe_interval_) continue;
            // Due: post the probe. A provider that cannot post it now (-EAGAIN: e.g. a
            // connection that never comes up) is retried every tick, and the probe's deadline
            // runs from the first try all the same.
            if (p.probe_sent == Clock::time_point{}) p.probe_sent = now_;
            int error = 0;
            if (send_frame(kFramePing, addr, &p, &error)) {
                p.probe_posted = true;
                p.probe_again = now_;
                p.touched = false;
                p.probes++;
                probes_++;
            } else if (error != 0 && error != -EAGAIN) {
                peer_lost(p, std::string("a liveness probe could not be sent: ") + std::strerror(-error));
            }
        }
    }

    std::string deadline_message(const Request& r) const {
        size_t left = 0, unposted = 0;
        std::vector<size_t> per_nic(nics_.size(), 0);
        for (const OpCtx& op : r.ops) {
            if (op.state == OpCtx::kSettled) continue;
            left += op_wrs(op);
            if (op.state == OpCtx::kQueued) unposted += op_wrs(op);
            if (op.nic < per_nic.size()) per_nic[op.nic] += op_wrs(op);
        }
        auto secs = std::chrono::duration<double>(r.deadline - r.started).count();
        std::string m = "deadline of " + std::to_string(secs).substr(0, 6) + " s passed with " + std::to_string(left) +
                        " of " + std::to_string(r.wrs()) + " work requests outstanding (" +
                        std::to_string(unposted) + " never posted; per NIC:";
        for (size_t n = 0; n < per_nic.size(); n++) m += " " + std::to_string(per_nic[n]);
        m += ")";
        if (r.has_imm) m += ", imm " + std::to_string(r.imm);
        return m;
    }

    void publish() {
        // Imms first, straight into the counter table: a thread blocked on a counter wakes
        // now, from this thread, not after a hand-off through Python.
        if (!imm_counts_.empty()) {
            counters_->add(imm_counts_, fired_);
            imm_counts_.clear();
        }
        int64_t held = held_since_.load(std::memory_order_relaxed);
        if (held != 0) hand_off_held(held);
        if (ready_.empty() && fired_.empty() && messages_.empty() && lost_.empty() && revived_.empty()) return;
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
            for (auto& l : lost_) out_.lost.push_back(std::move(l));
            for (auto& a : revived_) out_.revived.push_back(std::move(a));
        }
        lost_.clear();
        revived_.clear();
        // A drainer takes what is published, or hands it over as it leaves (drain()); a
        // spinner may not come for it, so it is held for a while only (hand_off_held).
        if (drainers_.load(std::memory_order_seq_cst) == 0) {
            if (spinners_.load(std::memory_order_seq_cst) == 0) {
                out_cv_.notify_one();
            } else if (held_since_.load(std::memory_order_relaxed) == 0) {
                // (the clock now, not the step's start: a step that took long before it
                // published would have had them handed over early)
                held_since_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
            }
        }
        ready_.clear();
        fired_.clear();
        messages_.clear();
    }

    // Completions held back from the completion thread since ``held`` (Clock ticks) while a
    // thread spun on a counter: handed over once kHandOffGrace has passed and none spins, or
    // once kHandOffMax has passed. A drainer that came meanwhile takes them, or hands them over
    // as it leaves, as it does for any completion published while it drains: the completion
    // thread is not woken under it (woken, it would take a batch and send the drainer to
    // sleep on its transfer's event: a thread switch and a GIL hand-off per wake-up).
    void hand_off_held(int64_t held) {
        if (drainers_.load(std::memory_order_seq_cst) != 0) {
            held_since_.store(0, std::memory_order_relaxed);
            return;
        }
        auto age = now_ - Clock::time_point(Clock::duration(held));
        if (age < kHandOffGrace) return;
        if (age < kHandOffMax && spinners_.load(std::memory_order_seq_cst) != 0) return;
        held_since_.store(0, std::memory_order_relaxed);
        wake_for_leftovers();
    }

    void drain_on_close() {
        // Give posted work a short grace period, then fail everything left. An engine closing
        // in this process (its address in ClosedSet: guarded providers, shm) also goes on
        // taking commands until the writes this process's engines have under way to it are
        // reaped, for at most kInboundGrace: on shm a sender reaps a write through the
        // target's memory, which goes with the endpoint (fabric/closed.hpp, InboundWrites).
        // Before, a write the target took just before it closed could be reaped by its sender
        // after that (SIGSEGV in the sender's poll).
        auto start = std::chrono::steady_clock::now();
        auto deadline = start + std::chrono::milliseconds(200), inbound_deadline = start + kInboundGrace;
        const bool closing_here = ClosedSet::instance().contains(self_address_);
        auto& inbound = InboundWrites::instance();
        while (true) {
            auto now = std::chrono::steady_clock::now();
            bool own = inflight_ > 0 && now < deadline;
            bool theirs = closing_here && now < inbound_deadline && inbound.outstanding(self_address_) > 0;
            if (!own && !theirs) break;
            post_pending();
            if (!acks_.empty()) flush_acks();
            poll_all();
            if (!eager_dropped_.empty()) fail_dropped_eager();
            if (!own) std::this_thread::yield();  // the senders reap on threads of their own
        }
        // this engine's own writes still under way are reaped by no one now: their targets
        // need not wait for them
        for (auto& [address, p] : peer_state_) {
            if (p.posted_here > 0) p.inbound->fetch_sub(static_cast<int64_t>(p.posted_here), std::memory_order_seq_cst);
            p.posted_here = 0;
        }
        for (auto& q : pending_) q.clear();
        for (auto& park : parked_) park.clear();
        access_checks_.clear();  // (their requests fail below)
        sized_wait_.clear();     // (so do those of sends waiting for their peer's sizes)
        eager_out_.clear();  // (so do those of eager writes)
        eager_dropped_.clear();
        acks_.clear();
        for (auto& [id, r] : live_) {
            if (!r->abandoned) ready_.push_back(Completion{id, kClosed, "engine closed with this transfer in flight"});
            r->abandoned = true;
        }
        // (live_ keeps the requests: the provider may still hold their contexts until the
        // domains close, in ~Engine)
        inflight_ = 0;
        publish();
    }

    std::vector<std::unique_ptr<Domain>> nics_;
    std::shared_ptr<CounterTable> counters_;
    bool chaos_;
    std::mt19937_64 rng_;
    MpscQueue<Request> queue_;
    std::vector<std::deque<OpCtx*>> pending_;
    struct Parked {
        std::deque<OpCtx*> ops;  // in queue order
        Clock::time_point since{};  // parked, or last posted one, then
    };
    static constexpr size_t kMaxParked = 16;
    std::vector<std::map<uint64_t, Parked>> parked_;  // per NIC: peers whose queue is full
    std::vector<uint64_t> park_served_;                // per NIC: the last parked peer posted to
    std::vector<std::unordered_map<std::string, uint64_t>> peers_;
    std::unordered_map<uint64_t, std::unique_ptr<Request>> live_;
    static constexpr size_t kCoalesce = 32;
    static constexpr size_t kInlineOps = 8;  // a submit posts at most this many WRs itself
    // how long dump() and peer_traffic() wait for the progress lock (a step takes microseconds;
    // one that holds it this long is stuck inside the provider)
    static constexpr auto kDiagnosticWait = std::chrono::milliseconds(200);
    static constexpr std::chrono::microseconds kCoalesceWait{10};
    // how long completions wait for a thread that spins on a counter (hand_off_held)
    static constexpr std::chrono::microseconds kHandOffGrace{50};
    static constexpr std::chrono::microseconds kHandOffMax{500};
    // the worker's nap while a thread spins on a counter and runs the steps (defer()): how
    // long incoming messages, peers' writes that no waiter here awaits, and completions held
    // for the spinner (up to kHandOffMax while it spins) may wait once a spinner went back to
    // Python with nothing in flight, no other waiter queued, and did not wake it. Short naps
    // cost the round trip: two workers waking every 100 us from this nap on the 2-core machine
    // (each client and server spinning in turn) left both spinners sharing one CPU while the
    // other idled, and the tcp imm round trip took 43-77 us against 20-32 with 500-1000 us naps
    // (benchmarks/rtt_breakdown.py, alternated; docs/backends/efa.md).
    static constexpr std::chrono::microseconds kSpinnerNap{FABRIC_SPINNER_NAP_US};
    // let_in(): the longest the worker holds off for a thread waiting on the progress lock
    // (built with ThreadSanitizer, lock_by() polls the lock every 50 us)
    static constexpr std::chrono::microseconds kLetIn{200};
    // provider_worked(): a non-busy step that took kWorkedFactor x the quickest such step yet,
    // and at least kWorkedMin, moved bytes in the provider
    static constexpr std::chrono::microseconds kWorkedMin{2};
    static constexpr int kWorkedFactor = 4;
    // yield_alone(): a yield within kAloneFactor x the quickest yet found no other thread
    static constexpr int kAloneFactor = 3;
    Clock::duration empty_step_ = Clock::duration::max();  // (worker only)
    bool chores_ = false;  // the last step ran the tick or answered fences (under progress_mu_)
    std::atomic<int64_t> held_since_{0};  // Clock ticks: completions held back since (0: none)
    std::atomic<bool> more_coming_{false};  // work was in flight at the last publication
    size_t inflight_ = 0;
    bool full_ = false;  // the last posting pass met EAGAIN
    Clock::duration quickest_yield_ = Clock::duration::max() / 4;  // (yield_alone; the worker's)
    std::vector<Completion> ready_;
    std::unordered_map<uint32_t, uint64_t> imm_counts_;  // polled, not yet in counters_
    CounterTable::Tokens fired_;
    std::vector<std::string> messages_;
    size_t recv_depth_;
    size_t max_send_;
    // a control frame: the wire and type bytes and up to max_send_ bytes, at least kFrameFloor
    size_t frame_;
    char* recv_buf(size_t i) { return recv_arena_.data() + i * frame_; }
    // An engine frame's header as this engine writes it: [wire byte][type][address length]
    // [address][nonce] (frame_head() bytes; put_head() writes it and returns where the body
    // starts). A user frame has no nonce: [wire byte][kFrameUser] (kUserHead bytes), then
    // Python's header and payload.
    static constexpr size_t kUserHead = 2;
    size_t frame_head() const { return 3 + std::min<size_t>(self_address_.size(), 255) + sizeof(uint64_t); }
    char* put_head(char* slot, char type, uint64_t nonce) const {
        const size_t alen = std::min<size_t>(self_address_.size(), 255);
        slot[0] = wire_.load(std::memory_order_relaxed);
        slot[1] = type;
        slot[2] = static_cast<char>(alen);
        std::memcpy(slot + 3, self_address_.data(), alen);
        std::memcpy(slot + 3 + alen, &nonce, sizeof(nonce));
        return slot + 3 + alen + sizeof(nonce);
    }
    char* send_slot(size_t i) { return send_arena_.data() + i * frame_; }
    static constexpr char kFrameUser = 0, kFramePing = 1, kFramePong = 2, kFrameHello = 3, kFrameHelloAck = 4,
                          kFrameQuery = 5, kFrameCounts = 6, kFramePathReset = 7, kFramePoke = 8,
                          kFrameAccess = 9, kFrameAccessAnswer = 10,  // 11: kFrameDeliveryMarker
                          kFrameWrite = 12, kFrameWriteAck = 13;

    static constexpr int kRerouted = 1;  // post(): the op moved to another NIC's queue
    static constexpr int kCapped = 2;    // post(): its peer has the queue depth's worth posted
    static constexpr int kGone = 3;      // post(): its peer is an endpoint of this process, closed
    // how long a closing engine waits for this process's writes to it to be reaped (drain_on_close)
    static constexpr auto kInboundGrace = std::chrono::seconds(1);
    uint64_t queue_cap_ = 0;             // configure_queue (0: none)
    uint64_t queue_bytes_ = 0;           // configure_queue: the byte allowance past it (0: none)
    uint64_t busy_peers_ = 0;            // peers with writes counted in their ``queued``
    std::string self_address_;
    // The wire byte this engine writes and reads (kWireByte; speak_wire() for tests).
    std::atomic<char> wire_{kWireByte};
    // Senders heard speaking another wire protocol (got_foreign), by NIC 0 address: the wire
    // byte, and when this engine last told them it speaks another. At most kForeignMax (the
    // senders are not authenticated: past it the notes start afresh). Worker only.
    struct Foreign {
        uint8_t wire = 0;
        Clock::time_point told{};
    };
    std::unordered_map<std::string, Foreign> foreign_;
    static constexpr size_t kForeignMax = 1024;
    static constexpr auto kForeignTell = std::chrono::seconds(1);   // one kFrameForeign a second per sender
    static constexpr auto kForeignGrace = std::chrono::seconds(1);  // probe_deadline() of such a peer
    // failure detection (worker only)
    static constexpr auto kTick = std::chrono::milliseconds(10);
    Clock::time_point now_{}, last_tick_{}, last_watch_{};
    Clock::duration probe_interval_ = std::chrono::seconds(1);
    Clock::duration probe_timeout_ = std::chrono::seconds(10);
    double default_timeout_s_ = 60.0;
    std::unordered_map<std::string, PeerState> peer_state_;  // node-based: pointers stay valid
    std::vector<std::string> watched_;
    struct Fence {
        std::string address;
        uint64_t nonce;
        Clock::time_point sent{};
    };
    // One posting of a write a fence waits for: op ``index`` of request ``id``, posted for the
    // ``posts``-th time, to ``peer`` (NIC 0 address).
    struct Posting {
        uint64_t id;
        uint32_t index;
        uint32_t posts;
        std::string peer;
    };
    // The writes posted now (and not yet reported) to any of ``peers`` (NIC 0 addresses), on
    // NICs ``from_nic`` and up. Under progress_mu_.
    std::vector<Posting> postings_to(const std::vector<std::string>& peers, uint32_t from_nic) const {
        std::vector<Posting> out;
        for (const auto& [id, r] : live_)
            for (uint32_t i = 0; i < r->ops.size(); i++) {
                const OpCtx& op = r->ops[i];
                if (op.kind != 0 || op.state != OpCtx::kPosted || op.nic < from_nic || op.target >= r->targets.size())
                    continue;
                const auto& to = r->targets[op.target]->addresses;
                if (!to.empty() && std::find(peers.begin(), peers.end(), to[0]) != peers.end())
                    out.push_back(Posting{id, i, op.posts, to[0]});
            }
        return out;
    }
    // A fence's ping waiting for this engine's writes to the pinger on NICs > 0.
    struct PendingPong {
        std::string to;
        uint64_t nonce;
        std::vector<Posting> writing;
    };
    std::vector<PendingPong> pongs_;
    // Answers the fence pings whose writes have all been reported (each step while any
    // waits). First every completion already in the CQs is taken and the counts published:
    // an imm that landed on another NIC before the ping is counted, and seen counted, before
    // the pinger hears the answer (cancel() relies on it: nothing of a cancelled transfer is
    // counted after it returns).
    void answer_fences() {
        bool ready = false;
        for (auto& q : pongs_) {
            q.writing.erase(std::remove_if(q.writing.begin(), q.writing.end(),
                                           [&](const Posting& w) { return reported(w); }),
                            q.writing.end());
            ready |= q.writing.empty();
        }
        if (!ready) return;
        for (int i = 0; i < 64 && poll_all(); i++) {
        }
        publish();
        std::vector<PendingPong> left;
        for (auto& q : pongs_) {
            if (!q.writing.empty() || !flush_outbox(&q.to)) {
                left.push_back(std::move(q));
                continue;
            }
            send_frame(kFramePong, q.to, nullptr, nullptr, q.nonce, false, frame_body());  // (lost: asked again)
        }
        pongs_.swap(left);
    }
    // Whether that posting has been reported (its request ended, or the op completed, failed,
    // or was posted again since). Under progress_mu_.
    bool reported(const Posting& w) const {
        auto it = live_.find(w.id);
        if (it == live_.end() || w.index >= it->second->ops.size()) return true;
        const OpCtx& op = it->second->ops[w.index];
        return op.state != OpCtx::kPosted || op.posts != w.posts;
    }
    std::vector<Fence> fences_;  // fence() probes awaiting an answer
    std::mutex dropped_mu_;
    std::vector<uint64_t> dropped_fences_;  // fence() nonces given up while the lock was held (under dropped_mu_)
    static constexpr auto kFenceRetry = std::chrono::milliseconds(100);
    uint64_t fence_nonce_ = 1;
    std::mutex touch_mu_;
    std::vector<std::string> touched_;  // probe_peer() requests, any thread
    uint64_t epoch_ = 1;
    std::deque<OpCtx> probe_ctx_;  // stable addresses
    std::vector<OpCtx*> free_probes_;
    std::vector<LostPeer> lost_;
    std::vector<std::string> revived_;
    // NIC loss (worker only)
    static constexpr auto kPathRetryMin = std::chrono::milliseconds(200);
    static constexpr auto kCutEvery = std::chrono::milliseconds(100);
    std::vector<std::unordered_map<uint64_t, PeerState*>> attrib_;  // per NIC: source handle -> sender
    std::vector<uint64_t> unattributed_;  // per NIC: imms counted whose sender could not be told
    std::vector<uint64_t> sourceless_;    // per NIC: imms its domain reported without a source
    std::vector<PeerState*> nic_sender_;  // per NIC: the first engine whose hello named it
    std::vector<uint8_t> nic_shared_;     // per NIC: a second one's hello named it too
    uint64_t incarnation_ = 0;            // random per engine: a restart shows in hellos and answers
    uint64_t session_seq_ = 0, query_nonce_ = 0;
    struct Query {
        std::string from;
        uint64_t nonce;
        uint8_t nic;
    };
    std::vector<Query> queries_;  // count queries to answer at the next tick
    std::vector<AccessCheck> access_checks_;  // check_access(): questions out
    uint64_t access_nonce_ = 0;
    static constexpr auto kAccessWait = std::chrono::seconds(1);
    static constexpr auto kAccessSettle = std::chrono::milliseconds(20);
    static constexpr auto kAccessRetry = std::chrono::milliseconds(50);
    static constexpr auto kAccessGrace = std::chrono::milliseconds(300);  // a refused probe's wait
    // note_region(): per NIC, key -> the region as writes address it (any thread: access_mu_)
    std::mutex access_mu_;
    std::vector<std::unordered_map<uint64_t, AccessEntry>> access_;
    // eager writes (post_eager): the largest (0: none), the frames out by nonce, those to fail
    // at the end of the step, and as a target the acknowledgements due, per writer's address
    size_t eager_max_ = 0;
    uint64_t eager_nonce_ = 0;
    std::unordered_map<uint64_t, EagerOut> eager_out_;
    std::vector<EagerDrop> eager_dropped_;
    std::unordered_map<std::string, std::string> acks_;
    struct OutFrame {
        char type;
        std::string to;
        uint64_t nonce;
        std::string extra;
    };
    std::vector<OutFrame> outbox_;  // answers the provider could not take yet
    std::vector<OpCtx*> sized_wait_;  // sends waiting for their peer's receive buffers' size (sized())
    std::list<std::unique_ptr<RetryBatch>> batches_;
    std::string last_path_error_;
    static constexpr uint32_t kSendSlots = 64;
    std::vector<char> recv_arena_;
    std::vector<char> send_arena_;
    void* recv_desc_ = nullptr;
    void* send_desc_ = nullptr;
    std::vector<uint32_t> free_slots_;  // worker only
    std::vector<OpCtx> recv_ctx_;
    std::vector<char> poke_frame_;   // per NIC: the byte a poke sends
    std::vector<void*> poke_desc_;   // its registration there (at the first poke)
    std::vector<char> poke_ready_;   // per NIC: registered
    uint64_t pokes_sent_ = 0;        // worker only (dump)
    uint64_t paths_cut_ = 0;         // connections reset by abort_path (worker only, dump)
    std::unique_ptr<NicTraffic[]> traffic_;          // per NIC (stats)

    std::mutex out_mu_;
    std::condition_variable out_cv_;
    Batch out_;
    bool stopped_ = false;

    std::mutex wake_mu_;
    std::condition_variable wake_cv_;
    std::atomic<bool> sleeping_{false};
    std::atomic<bool> deferring_{false};  // the worker naps because a thread spins (defer())
    std::atomic<bool> work_left_{false};  // work in flight after the last step (spinning())
    std::atomic<uint64_t> spinner_wakes_{0};  // (dump)
    std::atomic<uint64_t> worker_naps_{0};     // (dump)
    std::atomic<int> progress_wanted_{0};      // threads in take_progress() (let_in())
    std::atomic<uint64_t> provider_steps_{0};  // steps provider_worked() counted (dump)
    std::atomic<uint64_t> worker_yields_{0}, lone_yields_{0};  // (yield_alone; dump)
    std::mutex exit_mu_;          // exited_: the worker has left run() (close() waits on exit_cv_)
    std::condition_variable exit_cv_;
    bool exited_ = false;
    std::atomic<bool> wedged_{false};  // close() left a thread inside the provider
    std::atomic<int64_t> progress_since_ns_{0};  // when the progress now running began, 0: none (stalled_for())
    // Marks progress_since_ns_ for as long as a step or an inline post runs.
    struct InProgress {
        std::atomic<int64_t>& since;
        explicit InProgress(std::atomic<int64_t>& s, Clock::time_point now = Clock::now()) : since(s) {
            since.store(std::max<int64_t>(1, now.time_since_epoch().count()), std::memory_order_relaxed);
        }
        ~InProgress() { since.store(0, std::memory_order_relaxed); }
        InProgress(const InProgress&) = delete;
        InProgress& operator=(const InProgress&) = delete;
    };
    std::timed_mutex progress_mu_;     // held by whoever runs step(): the worker or a helper
    std::atomic<int> in_hand_{0};  // batches of wait_batch() not yet handed to Python (drain())
    std::atomic<int> spinners_{0};  // threads spinning on a counter (spinning())
    std::atomic<int> drainers_{0};  // threads in drain(): the completion thread is not woken
    std::atomic<bool> stop_{false};
    std::mutex close_mu_;
    // written under the progress lock only (NicTraffic::bump: no locked instruction per work
    // request), read by stats() from any thread
    std::atomic<uint64_t> posted_{0}, completed_{0}, bytes_{0}, eagain_{0};
    std::atomic<uint64_t> probes_{0}, peers_lost_{0}, timeouts_{0}, retries_{0};
    std::atomic<uint64_t> reconciled_{0}, landed_unacked_{0}, makeups_{0}, unreconciled_{0};
    std::atomic<uint64_t> eager_writes_{0}, eager_landed_{0}, frames_truncated_{0}, frames_foreign_{0}, list_ops_{0};
    std::thread worker_;
};

}  // namespace fabric
