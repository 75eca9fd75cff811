// One NIC through libibverbs: the Domain of fabric's C++ engine core (fabric/engine.hpp) for
// ConnectX (and any RC-capable verbs device, Soft-RoCE included).
//
// Per domain: a protection domain, one CQ for every RC queue pair, a shared receive queue of
// zero-length receives that WRITE_WITH_IMM completions consume (the imms), on NIC 0 a second
// SRQ holding the engine's control-message buffers, and a UD queue pair for the handshake
// (its GID/LID/QPN/Q_Key are the DomainAddress, address.hpp).
//
// Per peer: reliable-connected queue pairs, created lazily on first use (insert_peer, which
// the engine calls on a peer's first write or send, or eagerly for a peer group) through the
// handshake of handshake.hpp over the UD QP: a data QP (writes; receives from the imm SRQ)
// and, on NIC 0, a control QP (sends; receives from the control SRQ). Two QPs because an RC
// QP takes its receives from one queue, and a SEND needs a buffer where an imm needs none.
//
// The Domain concept's answers:
// - post_write / post_send to a peer still connecting return -EAGAIN (the engine retries);
//   to a peer whose handshake failed (or any refused request) they return 0 and the failure
//   arrives from the next poll() as on_error(ctx, kPeerUnreachable / kTransport, reason), so
//   the transfer fails with the typed error and the reason (see the note in docs/backends/verbs.md).
// - Work requests are staged per send queue and posted as chains of up to chain_max (one
//   doorbell), signalled selectively (wr_chain.hpp). A request to an idle queue is posted at
//   once (latency); the rest are posted when a chain fills or at the next poll(), which the
//   engine's progress step runs right after posting. A signalled completion completes every
//   earlier request of its queue (RC completes in order): poll() reports each to the engine.
// - A completion with an error (the QP is now in the error state) fails that request with
//   its typed status, fails every other request of that connection (flushed), destroys its
//   QPs and resets its handshake: the next use builds new ones (a new epoch).
// - Imm receive buffers are re-posted in batches at the end of each poll(); the SRQ depth
//   (FABRIC_VERBS_IMM_DEPTH) bounds the imms in flight towards this NIC between two polls,
//   and the RNR timer is the shortest (10 us) should a burst still exceed it.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fabric/engine.hpp>

#include "address.hpp"
#include "fabric/cuda.hpp"
#include "devices.hpp"
#include "handshake.hpp"
#include "wr_chain.hpp"

namespace fabric::verbs {

struct DomainConfig {
    std::string device;
    int port = 0;        // 0: the first ACTIVE port
    int gid_index = -1;  // -1: RoCE v2 by default (choose_gid)
    bool control = false;         // this NIC carries control messages (NIC 0 of the group)
    uint32_t recv_depth = 64;     // control receive buffers the engine keeps posted (NIC 0)
    uint32_t sq_depth = 1024;     // send queue depth of each RC QP
    uint32_t imm_depth = 16384;   // imm receives kept posted on the SRQ
    uint32_t cq_depth = 65536;
    uint32_t chain_max = 16;      // work requests per doorbell (at most kMaxChain)
    uint32_t signal_every = 16;   // at most signal_every - 1 unsignalled requests in a row
    HsTiming timing;
    double fail_hold_s = 1.0;     // after a failed handshake, fail new work at once this long
    uint8_t traffic_class = 0;
    uint8_t service_level = 0;
    uint8_t hop_limit = 64;
    uint8_t timeout = 14;         // local ACK timeout: 4.096 us * 2**14 = 67 ms
    uint8_t retry_cnt = 7;
    uint8_t rnr_retry = 7;        // 7: retry forever
    uint8_t min_rnr_timer = 1;    // 0.01 ms
};

struct DomainStats {
    uint64_t peers = 0;
    uint64_t handshakes = 0;          // incarnations started (REQ or answered REQ)
    uint64_t connected = 0;
    uint64_t handshake_failures = 0;
    uint64_t qp_errors = 0;           // connections torn down by an error completion or event
    uint64_t async_events = 0;        // ibv_get_async_event events seen (QP errors, port changes)
    uint64_t wrs_posted = 0;
    uint64_t wrs_signaled = 0;
    uint64_t doorbells = 0;           // ibv_post_send calls
    uint64_t ud_sent = 0;
    uint64_t ud_received = 0;
    uint64_t ud_dropped = 0;          // handshake messages not sent (no free slot, no AH)
    uint64_t ud_garbage = 0;          // datagrams that were not handshake messages for us
    uint64_t imm_low_water = 0;       // fewest imm receives seen posted
    uint64_t dmabuf_registrations = 0;
    uint64_t peer_memory_registrations = 0;
};

inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The engine's status for a failed work completion.
inline int32_t status_of(ibv_wc_status s) {
    switch (s) {
        case IBV_WC_RETRY_EXC_ERR:
        case IBV_WC_RNR_RETRY_EXC_ERR:
        case IBV_WC_RESP_TIMEOUT_ERR:
        case IBV_WC_REM_ABORT_ERR:
            return kPeerUnreachable;
        case IBV_WC_REM_ACCESS_ERR:
        case IBV_WC_REM_INV_REQ_ERR:
        case IBV_WC_REM_OP_ERR:
            return kRemoteAccess;
        default:
            return kTransport;
    }
}

class VerbsDomain {
  public:
    using Mr = ibv_mr*;
    static constexpr uint32_t kMaxChain = 64;

    explicit VerbsDomain(const DomainConfig& cfg) : cfg_(cfg), rng_(std::random_device{}()) {
        try {
            open();
        } catch (...) {
            close();
            throw;
        }
    }
    ~VerbsDomain() { close(); }
    VerbsDomain(const VerbsDomain&) = delete;
    VerbsDomain& operator=(const VerbsDomain&) = delete;

    // --- the Domain concept ---------------------------------------------------------------
    const std::string& address() const { return address_; }
    bool virt_addr() const { return true; }
    // Imm sources are not reported yet (the QP number of a completion would say): a target on
    // verbs reconciles a lost NIC's WriteImms only for a NIC's sole sender (Engine::attribute);
    // with several, their senders fail them instead.
    // No pokes (engine.hpp, the Domain concept): whether a queue pair the peer tore down
    // stays usable-looking here until it sends is not measured on hardware yet.
    bool stale_peers() const { return false; }

    uint64_t insert_peer(const std::string& raw) {
        auto it = by_addr_.find(raw);
        if (it != by_addr_.end()) return it->second;
        Address a = decode_address(raw);  // std::invalid_argument with the reason
        if (a.ethernet() != self_.ethernet()) {
            throw std::runtime_error(std::string("the peer's port is ") + (a.ethernet() ? "Ethernet" : "InfiniBand") +
                                     " and this one " + (self_.ethernet() ? "Ethernet" : "InfiniBand"));
        }
        Conn& c = new_conn(raw, a);
        if (!c.self) {
            c.hs.start(now_s());  // eager: the first write or send finds it connecting or connected
            track(c);
        }
        return c.handle;
    }

    // The engine lost this peer (failure detection): its queue pairs go (what was posted on
    // them fails, flushed) and its handshake starts over on the next use, so a restarted
    // process behind the same address gets new queue pairs.
    void remove_peer(uint64_t handle) {
        Conn* c = conn_of(handle);
        if (!c) return;
        teardown(*c, kPeerUnreachable, "the peer " + peer_name(*c) + " was declared lost");
        if (c->self) {
            c->data.connected = false;
        } else {
            c->hs.reset();
        }
    }

    int post_write(const WriteOp& w, void* ctx) {
        Conn* c = conn_of(w.peer);
        if (!c) return -EINVAL;
        if (w.len > max_wr_) {
            defer(ctx, kTransport,
                  "a work request of " + std::to_string(w.len) + " bytes exceeds " + info_.name + "'s limit of " +
                      std::to_string(max_wr_) + " (it would be truncated; plan with max_msg_size <= the limit)");
            return 0;
        }
        if (w.len && !w.desc) {
            defer(ctx, kTransport, "the source is not registered on " + info_.name);
            return 0;
        }
        int r = ready(*c, ctx);
        if (r != 0) return r > 0 ? 0 : r;
        QpSlot& q = c->data;
        if (q.inflight() >= sq_depth_ || sends_outstanding_ + flushing_ >= send_budget_) return -EAGAIN;
        Staged s;
        s.ctx = ctx;
        s.op = w.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        s.src = reinterpret_cast<uint64_t>(w.src);
        s.len = static_cast<uint32_t>(w.len);
        s.lkey = w.desc ? static_cast<ibv_mr*>(w.desc)->lkey : 0;
        s.raddr = w.raddr;
        s.rkey = static_cast<uint32_t>(w.rkey);
        s.imm_be = htonl(w.imm);
        stage(q, s);
        return 0;
    }

    int post_send(const void* buf, size_t len, void* desc, uint64_t peer, void* ctx) {
        if (!cfg_.control) return -ENOTSUP;
        Conn* c = conn_of(peer);
        if (!c) return -EINVAL;
        int r = ready(*c, ctx);
        if (r != 0) return r > 0 ? 0 : r;
        if (!c->ctrl.qp) {
            defer(ctx, kPeerUnreachable, "the peer " + peer_name(*c) + " has no control queue pair (not a NIC 0)");
            return 0;
        }
        QpSlot& q = c->ctrl;
        if (q.inflight() >= sq_depth_ || sends_outstanding_ + flushing_ >= send_budget_) return -EAGAIN;
        Staged s;
        s.ctx = ctx;
        s.op = IBV_WR_SEND;
        s.src = reinterpret_cast<uint64_t>(buf);
        s.len = static_cast<uint32_t>(len);
        s.lkey = desc ? static_cast<ibv_mr*>(desc)->lkey : 0;
        s.send = true;
        stage(q, s);
        return 0;
    }

    int post_recv(void* buf, size_t len, void* desc, void* ctx) {
        if (!ctrl_srq_) return -ENOTSUP;
        recv_bufs_[ctx] = RecvBuf{buf, static_cast<uint32_t>(len), desc ? static_cast<ibv_mr*>(desc)->lkey : 0};
        return post_ctrl_recv(ctx);
    }

    void* local_desc(void* buf, size_t len) {
        ibv_mr* mr = ibv_reg_mr(pd_, buf, len, IBV_ACCESS_LOCAL_WRITE);
        if (!mr) throw VerbsError("ibv_reg_mr(control buffers) on " + info_.name, errno);
        local_mrs_.push_back(mr);
        return mr;
    }

    // Host memory: ibv_reg_mr. CUDA memory: a DMA-BUF of its allocation (ibv_reg_dmabuf_mr),
    // else peer memory (ibv_reg_mr on the device pointer: nvidia-peermem). Relaxed ordering
    // where the device supports it. Failures throw with the cause, at registration time.
    ibv_mr* register_memory(void* ptr, size_t len, uint64_t requested_key, bool remote_write, uint64_t& key,
                            void*& desc) {
        (void)requested_key;  // verbs keys are the device's
        int access = IBV_ACCESS_LOCAL_WRITE | (remote_write ? IBV_ACCESS_REMOTE_WRITE : 0) | IBV_ACCESS_RELAXED_ORDERING;
        ibv_mr* mr = nullptr;
        if (cuda::is_device_pointer(ptr)) {
            std::string dmabuf_why, peer_why;
            uint64_t offset = 0;
            int fd = cuda::dmabuf_fd(ptr, offset, dmabuf_why);
            if (fd >= 0) {
                mr = ibv_reg_dmabuf_mr(pd_, offset, len, reinterpret_cast<uint64_t>(ptr), fd, access);
                int err = errno;
                ::close(fd);
                if (!mr) dmabuf_why = std::string("ibv_reg_dmabuf_mr: ") + std::strerror(err);
            }
            if (mr) {
                stats_.dmabuf_registrations++;
            } else {
                mr = ibv_reg_mr(pd_, ptr, len, access);
                if (mr) {
                    stats_.peer_memory_registrations++;
                } else {
                    int err = errno;
                    peer_why = std::string("ibv_reg_mr: ") + std::strerror(err) +
                               " (peer memory needs the nvidia-peermem module: modprobe nvidia-peermem)";
                    throw std::runtime_error("cannot register CUDA memory [" + hex(ptr) + ", +" + std::to_string(len) +
                                             ") on " + info_.name + ": DMA-BUF: " + dmabuf_why +
                                             "; peer memory: " + peer_why);
                }
            }
        } else {
            mr = ibv_reg_mr(pd_, ptr, len, access);
            if (!mr) {
                int err = errno;
                std::string hint = err == ENOMEM || err == EPERM || err == EAGAIN
                                       ? " (is the locked-memory limit too low? ulimit -l; in a container: --ulimit "
                                         "memlock=-1)"
                                       : "";
                throw std::runtime_error("cannot register host memory [" + hex(ptr) + ", +" + std::to_string(len) +
                                         ") on " + info_.name + ": ibv_reg_mr: " + std::strerror(err) + hint);
            }
        }
        key = mr->rkey;
        desc = mr;
        return mr;
    }

    void deregister_memory(ibv_mr* mr) {
        if (mr) ibv_dereg_mr(mr);
    }

    template <class Sink>
    size_t poll(Sink& sink) {
        double now = now_s();
        deliver(sink);
        flush_dirty();
        ibv_wc wc[kPollBatch];
        int n = ibv_poll_cq(cq_, kPollBatch, wc);
        size_t work = n > 0 ? static_cast<size_t>(n) : 0;
        for (int i = 0; i < n; i++) handle(wc[i], sink);
        if (imm_consumed_) repost_imm();
        work += poll_ud(now);
        tick(now);
        if (now >= next_housekeeping_) {
            next_housekeeping_ = now + kHousekeepingS;
            async_events();
            bury(now, false);
        }
        deliver(sink);
        return work;
    }

    // --- what fabric_verbs reports ---------------------------------------------------------
    const DeviceInfo& device() const { return info_; }
    const PortInfo& port() const { return port_; }
    const GidInfo& gid() const { return gid_; }
    uint64_t max_wr() const { return max_wr_; }
    uint32_t sq_depth() const { return sq_depth_; }
    uint32_t imm_depth() const { return imm_depth_; }
    uint32_t qkey() const { return qkey_; }
    DomainStats stats() const {
        DomainStats s = stats_;
        s.peers = conns_.size();
        return s;
    }

  private:
    static constexpr int kPollBatch = 64;
    static constexpr uint64_t kWrSend = 0, kWrImmRecv = 1, kWrCtrlRecv = 2;
    static constexpr uint32_t kUdSlots = 64;
    static constexpr uint32_t kUdRecvBytes = 256;  // 40 bytes of GRH, then the message
    static constexpr uint64_t kUdSendTag = uint64_t(1) << 63;
    static constexpr double kHousekeepingS = 0.001;  // async events and dead QPs, at most this often
    static constexpr double kGraveS = 0.2;            // a QP in the error state lives this long

    struct Posted {
        uint32_t seq;
        void* ctx;
        bool send;
    };
    struct Staged {
        uint32_t seq = 0;
        void* ctx = nullptr;
        ibv_wr_opcode op = IBV_WR_RDMA_WRITE;
        uint64_t src = 0;
        uint32_t len = 0;
        uint32_t lkey = 0;
        uint64_t raddr = 0;
        uint32_t rkey = 0;
        uint32_t imm_be = 0;
        bool send = false;
    };
    // One RC queue pair and what it holds.
    struct QpSlot {
        ibv_qp* qp = nullptr;
        uint32_t uid = 0;        // names this incarnation in wr_ids (stale completions are dropped)
        bool connected = false;  // past INIT
        uint32_t next_seq = 0;
        std::deque<Posted> fifo;    // posted, completion not seen yet, in posting order
        std::deque<Staged> staged;  // not posted yet
        Signaller sig;
        bool dirty = false;      // in dirty_
        uint32_t flushing = 0;   // posted requests failed by teardown: their flush completions are due
        size_t inflight() const { return fifo.size() + staged.size(); }
    };
    struct RecvBuf {
        void* buf;
        uint32_t len;
        uint32_t lkey;
    };
    struct Deferred {
        void* ctx;
        int32_t status;
        std::string message;
    };

    // One peer domain: its handshake and its queue pairs.
    struct Conn final : HandshakeHost {
        Conn(VerbsDomain& d, uint32_t h, std::string r, const Address& a, bool is_self)
            : dom(d), handle(h), raw(std::move(r)), peer(a), self(is_self), hs(d.address_, raw, d.cfg_.timing, *this) {
            data.sig = ctrl.sig = Signaller(d.cfg_.signal_every);
        }
        ~Conn() override = default;

        QpParams open_qp(uint32_t epoch) override {
            (void)epoch;
            return dom.open_qps(*this);
        }
        bool connect_qp(const QpParams& remote, std::string& why) override { return dom.connect_qps(*this, remote, why); }
        void teardown(const std::string& why) override {
            dom.teardown(*this, kPeerUnreachable, "the connection to " + dom.peer_name(*this) + " was rebuilt: " + why);
        }
        void send(const std::string& bytes) override { dom.ud_send(*this, bytes); }
        void connected() override { dom.stats_.connected++; }
        void failed(const std::string& why) override {
            failed_at = now_s();
            dom.stats_.handshake_failures++;
            dom.teardown(*this, kPeerUnreachable, dom.unreachable(*this, why));
        }

        VerbsDomain& dom;
        uint32_t handle;
        std::string raw;
        Address peer;
        bool self;  // this domain's own address: two local QPs connected to each other
        HandshakeMachine hs;
        ibv_ah* ah = nullptr;
        std::string ah_error;  // why no address handle could be made (handshake datagrams dropped)
        QpSlot data, ctrl;
        QpSlot mirror_data, mirror_ctrl;  // the far ends of a connection to ourselves
        uint32_t psn = 0;
        double failed_at = -std::numeric_limits<double>::infinity();
        bool tracked = false;  // in active_ (handshake timers)
    };

    // --- setup and teardown -------------------------------------------------------------
    void open() {
        DeviceList l;
        if (l.err == ENOSYS || (l.err == 0 && l.count == 0)) throw std::runtime_error(kNoDevice);
        if (l.err) throw VerbsError("ibv_get_device_list", l.err);
        ibv_device* dev = l.find(cfg_.device);
        if (!dev) throw std::runtime_error("no RDMA device named '" + cfg_.device + "' (present: " + join(l.names()) + ")");
        info_ = describe(dev);
        if (!info_.error.empty()) throw std::runtime_error(info_.name + ": " + info_.error);
        port_ = choose_port(info_, cfg_.port);
        gid_ = choose_gid(info_.name, port_, cfg_.gid_index);
        max_wr_ = max_wr_bytes(port_.max_msg_sz, 0);
        ctx_ = ibv_open_device(dev);
        if (!ctx_) throw VerbsError("ibv_open_device(" + info_.name + ")", errno ? errno : ENODEV);
        pd_ = ibv_alloc_pd(ctx_);
        if (!pd_) throw VerbsError("ibv_alloc_pd(" + info_.name + ")", errno);
        int fl = fcntl(ctx_->async_fd, F_GETFL);
        if (fl < 0 || fcntl(ctx_->async_fd, F_SETFL, fl | O_NONBLOCK) < 0)
            throw VerbsError("fcntl(async_fd, O_NONBLOCK) on " + info_.name, errno);

        chain_max_ = std::clamp<uint32_t>(cfg_.chain_max, 1, kMaxChain);
        sq_depth_ = std::clamp<uint32_t>(cfg_.sq_depth, 16, static_cast<uint32_t>(std::max(16, info_.max_qp_wr)));
        uint32_t max_srq = static_cast<uint32_t>(std::max(16, info_.max_srq_wr));
        imm_depth_ = std::clamp<uint32_t>(cfg_.imm_depth, 16, max_srq);
        ctrl_depth_ = cfg_.control ? std::clamp<uint32_t>(cfg_.recv_depth, 1, max_srq) : 0;
        uint32_t cq_depth = std::min<uint32_t>(cfg_.cq_depth, static_cast<uint32_t>(std::max(1, info_.max_cqe)));
        uint32_t reserved = imm_depth_ + ctrl_depth_ + 64;
        if (cq_depth < reserved + sq_depth_) {
            throw std::runtime_error(info_.name + ": a CQ of " + std::to_string(cq_depth) + " entries cannot hold " +
                                     std::to_string(imm_depth_) + " imm receives, " + std::to_string(ctrl_depth_) +
                                     " control receives and a send queue of " + std::to_string(sq_depth_) +
                                     " (lower FABRIC_VERBS_IMM_DEPTH or FABRIC_VERBS_SQ_DEPTH)");
        }
        send_budget_ = cq_depth - reserved;
        cq_ = ibv_create_cq(ctx_, static_cast<int>(cq_depth), nullptr, nullptr, 0);
        if (!cq_) throw VerbsError("ibv_create_cq(" + std::to_string(cq_depth) + ") on " + info_.name, errno);
        ud_cq_ = ibv_create_cq(ctx_, 2 * kUdSlots + 8, nullptr, nullptr, 0);
        if (!ud_cq_) throw VerbsError("ibv_create_cq(handshake) on " + info_.name, errno);
        imm_srq_ = create_srq(imm_depth_);
        if (cfg_.control) ctrl_srq_ = create_srq(ctrl_depth_);
        open_ud();

        self_.gid = gid_.gid;
        self_.lid = port_.lid;
        self_.port = port_.port;
        self_.gid_index = static_cast<uint8_t>(gid_.index);
        self_.ud_qpn = ud_qp_->qp_num;
        self_.qkey = qkey_;
        self_.mtu = port_.active_mtu;
        self_.flags = static_cast<uint8_t>((port_.ethernet() ? kFlagEthernet : 0) |
                                           (port_.ethernet() && gid_.type == kGidRoceV2 ? kFlagRoceV2 : 0));
        address_ = encode_address(self_);

        imm_consumed_ = imm_depth_;
        repost_imm();
        stats_.imm_low_water = imm_depth_;
        if (imm_consumed_) throw std::runtime_error(info_.name + ": cannot post the imm receive queue");
    }

    ibv_srq* create_srq(uint32_t depth) {
        ibv_srq_init_attr a{};
        a.attr.max_wr = depth;
        a.attr.max_sge = 1;
        ibv_srq* srq = ibv_create_srq(pd_, &a);
        if (!srq) throw VerbsError("ibv_create_srq(" + std::to_string(depth) + ") on " + info_.name, errno);
        return srq;
    }

    void open_ud() {
        qkey_ = (static_cast<uint32_t>(rng_()) & 0x7fffffffu) | 1u;
        ud_arena_.assign(size_t(kUdSlots) * (kUdRecvBytes + kMessageBytes), 0);
        ud_mr_ = ibv_reg_mr(pd_, ud_arena_.data(), ud_arena_.size(), IBV_ACCESS_LOCAL_WRITE);
        if (!ud_mr_) throw VerbsError("ibv_reg_mr(handshake buffers) on " + info_.name, errno);
        ibv_qp_init_attr a{};
        a.send_cq = ud_cq_;
        a.recv_cq = ud_cq_;
        a.qp_type = IBV_QPT_UD;
        a.cap.max_send_wr = kUdSlots;
        a.cap.max_recv_wr = kUdSlots;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        ud_qp_ = ibv_create_qp(pd_, &a);
        if (!ud_qp_) throw VerbsError("ibv_create_qp(UD) on " + info_.name, errno);
        ibv_qp_attr q{};
        q.qp_state = IBV_QPS_INIT;
        q.pkey_index = 0;
        q.port_num = port_.port;
        q.qkey = qkey_;
        modify(ud_qp_, q, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, "UD INIT");
        q = {};
        q.qp_state = IBV_QPS_RTR;
        modify(ud_qp_, q, IBV_QP_STATE, "UD RTR");
        q = {};
        q.qp_state = IBV_QPS_RTS;
        q.sq_psn = rng_() & 0xffffff;
        modify(ud_qp_, q, IBV_QP_STATE | IBV_QP_SQ_PSN, "UD RTS");
        for (uint32_t i = 0; i < kUdSlots; i++) {
            repost_ud_recv(i);
            ud_free_.push_back(i);
        }
    }

    void modify(ibv_qp* qp, ibv_qp_attr& a, int mask, const char* what) {
        int rc = ibv_modify_qp(qp, &a, mask);
        if (rc != 0) throw VerbsError(std::string("ibv_modify_qp(") + what + ") on " + info_.name, rc);
    }

    void close() {
        closing_ = true;
        bury(0, true);
        for (auto& c : conns_) {
            for (QpSlot* s : {&c->data, &c->ctrl, &c->mirror_data, &c->mirror_ctrl}) destroy_slot(*s);
            if (c->ah) ibv_destroy_ah(c->ah);
            c->ah = nullptr;
        }
        bury(0, true);
        conns_.clear();
        by_addr_.clear();
        if (ud_qp_) ibv_destroy_qp(ud_qp_);
        if (imm_srq_) ibv_destroy_srq(imm_srq_);
        if (ctrl_srq_) ibv_destroy_srq(ctrl_srq_);
        if (cq_) ibv_destroy_cq(cq_);
        if (ud_cq_) ibv_destroy_cq(ud_cq_);
        if (ud_mr_) ibv_dereg_mr(ud_mr_);
        for (auto* mr : local_mrs_) ibv_dereg_mr(mr);
        local_mrs_.clear();
        if (pd_) ibv_dealloc_pd(pd_);
        if (ctx_) ibv_close_device(ctx_);
        ud_qp_ = nullptr;
        imm_srq_ = ctrl_srq_ = nullptr;
        cq_ = ud_cq_ = nullptr;
        ud_mr_ = nullptr;
        pd_ = nullptr;
        ctx_ = nullptr;
    }

    // --- connections --------------------------------------------------------------------
    Conn& new_conn(const std::string& raw, const Address& a) {
        auto h = static_cast<uint32_t>(conns_.size());
        conns_.push_back(std::make_unique<Conn>(*this, h, raw, a, raw == address_));
        by_addr_.emplace(raw, h);
        return *conns_.back();
    }

    Conn* conn_of(uint64_t handle) { return handle < conns_.size() ? conns_[handle].get() : nullptr; }

    void track(Conn& c) {
        if (c.hs.connecting() && !c.tracked) {
            c.tracked = true;
            active_.push_back(c.handle);
        }
    }

    // 0: connected; -EAGAIN: connecting; 1: failed (the failure of ``ctx`` is deferred).
    int ready(Conn& c, void* ctx) {
        if (c.self) {
            if (c.data.connected) return 0;
            std::string why;
            if (connect_self(c, why)) return 0;
            defer(ctx, kTransport, "cannot connect " + info_.name + " to itself: " + why);
            return 1;
        }
        HsState s = c.hs.state();
        if (s == HsState::kConnected) return 0;
        if (c.hs.connecting()) return -EAGAIN;
        double now = now_s();
        if (s == HsState::kFailed && now - c.failed_at < cfg_.fail_hold_s) {
            defer(ctx, kPeerUnreachable, unreachable(c, c.hs.failure()));
            return 1;
        }
        c.hs.start(now);
        track(c);
        if (c.hs.state() == HsState::kFailed) {
            defer(ctx, kPeerUnreachable, unreachable(c, c.hs.failure()));
            return 1;
        }
        return -EAGAIN;
    }

    QpParams open_qps(Conn& c) {
        teardown(c, kPeerUnreachable, "the connection to " + peer_name(c) + " was replaced");
        stats_.handshakes++;
        create_rc(c, c.data, imm_srq_);
        if (ctrl_srq_) create_rc(c, c.ctrl, ctrl_srq_);
        c.psn = static_cast<uint32_t>(rng_()) & 0xffffff;
        QpParams p;
        p.qpn = c.data.qp->qp_num;
        p.ctrl_qpn = c.ctrl.qp ? c.ctrl.qp->qp_num : 0;
        p.psn = c.psn;
        p.gid = gid_.gid;
        p.lid = port_.lid;
        p.mtu = port_.active_mtu;
        return p;
    }

    bool connect_qps(Conn& c, const QpParams& r, std::string& why) {
        try {
            if (!c.data.qp) throw std::runtime_error("no queue pair");
            connect_rc(c.data, r.qpn, r, c.psn);
            if (c.ctrl.qp) {
                if (r.ctrl_qpn) {
                    connect_rc(c.ctrl, r.ctrl_qpn, r, c.psn);
                } else {
                    destroy_slot(c.ctrl);  // the peer carries no control messages on this NIC
                }
            }
        } catch (const std::exception& e) {
            why = e.what();
            return false;
        }
        return true;
    }

    // A connection to this very domain: two local QP pairs, connected to each other directly.
    bool connect_self(Conn& c, std::string& why) {
        teardown(c, kPeerUnreachable, "rebuilt");
        try {
            create_rc(c, c.data, imm_srq_);
            create_rc(c, c.mirror_data, imm_srq_);
            if (ctrl_srq_) {
                create_rc(c, c.ctrl, ctrl_srq_);
                create_rc(c, c.mirror_ctrl, ctrl_srq_);
            }
            c.psn = static_cast<uint32_t>(rng_()) & 0xffffff;
            QpParams p;
            p.psn = c.psn;
            p.gid = gid_.gid;
            p.lid = port_.lid;
            p.mtu = port_.active_mtu;
            connect_rc(c.data, c.mirror_data.qp->qp_num, p, c.psn);
            connect_rc(c.mirror_data, c.data.qp->qp_num, p, c.psn);
            if (ctrl_srq_) {
                connect_rc(c.ctrl, c.mirror_ctrl.qp->qp_num, p, c.psn);
                connect_rc(c.mirror_ctrl, c.ctrl.qp->qp_num, p, c.psn);
            }
        } catch (const std::exception& e) {
            why = e.what();
            teardown(c, kTransport, why);
            return false;
        }
        return true;
    }

    void create_rc(Conn& c, QpSlot& s, ibv_srq* srq) {
        ibv_qp_init_attr a{};
        a.send_cq = cq_;
        a.recv_cq = cq_;
        a.srq = srq;
        a.qp_type = IBV_QPT_RC;
        a.sq_sig_all = 0;
        a.cap.max_send_wr = sq_depth_;
        a.cap.max_send_sge = 1;
        ibv_qp* qp = ibv_create_qp(pd_, &a);
        if (!qp) throw VerbsError("ibv_create_qp(RC) on " + info_.name, errno);
        s.qp = qp;
        s.uid = next_uid_;
        next_uid_ = (next_uid_ + 1) & 0x3fffffffu;
        if (next_uid_ == 0) next_uid_ = 1;
        s.connected = false;
        s.next_seq = 0;
        s.sig = Signaller(cfg_.signal_every);
        uids_[s.uid] = {&c, &s};
        qps_[qp] = s.uid;
        ibv_qp_attr q{};
        q.qp_state = IBV_QPS_INIT;
        q.pkey_index = 0;
        q.port_num = port_.port;
        q.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        modify(qp, q, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "RC INIT");
    }

    ibv_ah_attr path_to(const std::array<uint8_t, 16>& gid, uint16_t lid) const {
        ibv_ah_attr ah{};
        ah.is_global = 1;
        std::memcpy(ah.grh.dgid.raw, gid.data(), 16);
        ah.grh.sgid_index = static_cast<uint8_t>(gid_.index);
        ah.grh.hop_limit = cfg_.hop_limit;
        ah.grh.traffic_class = cfg_.traffic_class;
        ah.dlid = lid;
        ah.sl = cfg_.service_level;
        ah.port_num = port_.port;
        return ah;
    }

    void connect_rc(QpSlot& s, uint32_t remote_qpn, const QpParams& r, uint32_t local_psn) {
        ibv_qp_attr q{};
        if (s.connected) {  // re-pointed at a newer incarnation of the peer: RESET, INIT again
            q.qp_state = IBV_QPS_RESET;
            modify(s.qp, q, IBV_QP_STATE, "RC RESET");
            q = {};
            q.qp_state = IBV_QPS_INIT;
            q.pkey_index = 0;
            q.port_num = port_.port;
            q.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
            modify(s.qp, q, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "RC INIT");
            s.connected = false;
        }
        q = {};
        q.qp_state = IBV_QPS_RTR;
        q.path_mtu = static_cast<ibv_mtu>(std::min<uint8_t>(port_.active_mtu, r.mtu));
        q.dest_qp_num = remote_qpn;
        q.rq_psn = r.psn;
        q.max_dest_rd_atomic = 1;
        q.min_rnr_timer = cfg_.min_rnr_timer;
        q.ah_attr = path_to(r.gid, r.lid);
        modify(s.qp, q,
               IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                   IBV_QP_MIN_RNR_TIMER,
               "RC RTR");
        q = {};
        q.qp_state = IBV_QPS_RTS;
        q.timeout = cfg_.timeout;
        q.retry_cnt = cfg_.retry_cnt;
        q.rnr_retry = cfg_.rnr_retry;
        q.sq_psn = local_psn;
        q.max_rd_atomic = 1;
        modify(s.qp, q,
               IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                   IBV_QP_MAX_QP_RD_ATOMIC,
               "RC RTS");
        s.connected = true;
    }

    // Fail everything ``s`` holds (posted or staged) with ``status``.
    void fail_slot(QpSlot& s, int32_t status, const std::string& why) {
        for (const auto& p : s.fifo) defer(p.ctx, status, why);
        for (const auto& st : s.staged) defer(st.ctx, status, why);
        sends_outstanding_ -= s.fifo.size() + s.staged.size();
        s.flushing += static_cast<uint32_t>(s.fifo.size());
        flushing_ += s.fifo.size();  // the CQ still owes their flush completions
        s.fifo.clear();
        s.staged.clear();
    }

    // The QP goes to the error state now (it flushes the receives it took from an SRQ: their
    // completions put them back) and is destroyed a little later, once those are polled.
    // Its completions are recognised as stale from here on (its uid is gone).
    void destroy_slot(QpSlot& s) {
        if (!s.qp) return;
        uids_.erase(s.uid);
        qps_.erase(s.qp);
        if (closing_) {
            ibv_destroy_qp(s.qp);
            flushing_ -= s.flushing;
        } else {
            ibv_qp_attr a{};
            a.qp_state = IBV_QPS_ERR;
            ibv_modify_qp(s.qp, &a, IBV_QP_STATE);
            graveyard_.push_back(Grave{s.qp, now_s() + kGraveS, s.flushing});
        }
        s.flushing = 0;
        s.qp = nullptr;
        s.connected = false;
    }

    void bury(double now, bool all) {
        for (size_t i = 0; i < graveyard_.size();) {
            if (all || now >= graveyard_[i].at) {
                ibv_destroy_qp(graveyard_[i].qp);
                flushing_ -= graveyard_[i].flushing;
                graveyard_[i] = graveyard_.back();
                graveyard_.pop_back();
            } else {
                i++;
            }
        }
    }

    // QP and port events (non-blocking async fd). A QP that went to the error state without
    // an error completion of ours (an error it met as the responder of the peer's writes) is
    // torn down now rather than at our next post.
    void async_events() {
        ibv_async_event ev;
        while (ibv_get_async_event(ctx_, &ev) == 0) {
            ibv_event_type type = ev.event_type;
            ibv_qp* qp = ev.element.qp;
            ibv_ack_async_event(&ev);  // before any destroy: ibv_destroy_qp waits for the acks
            stats_.async_events++;
            if (type != IBV_EVENT_QP_FATAL && type != IBV_EVENT_QP_REQ_ERR && type != IBV_EVENT_QP_ACCESS_ERR)
                continue;
            auto it = qps_.find(qp);
            if (it == qps_.end()) continue;
            auto found = uids_.find(it->second);
            if (found == uids_.end()) continue;
            Conn& c = *found->second.first;
            stats_.qp_errors++;
            teardown(c, kTransport,
                     std::string("the queue pair from ") + info_.name + " to " + peer_name(c) +
                         " went to the error state: " + ibv_event_type_str(type));
            if (c.self) {
                c.data.connected = false;
            } else {
                c.hs.reset();
            }
        }
    }

    void teardown(Conn& c, int32_t status, const std::string& why) {
        fail_slot(c.data, status, why);
        fail_slot(c.ctrl, status, why);
        for (QpSlot* s : {&c.data, &c.ctrl, &c.mirror_data, &c.mirror_ctrl}) destroy_slot(*s);
    }

    std::string peer_name(const Conn& c) const {
        return gid_text(c.peer.gid) + " (UD QPN " + std::to_string(c.peer.ud_qpn) + ")";
    }
    std::string unreachable(const Conn& c, const std::string& why) const {
        return "peer " + peer_name(c) + " is unreachable from " + info_.name + " port " + std::to_string(port_.port) +
               ": connection handshake failed: " + why + (c.ah_error.empty() ? "" : " (" + c.ah_error + ")");
    }
    static std::string hex(const void* p) {
        char buf[24];
        std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
        return buf;
    }

    // --- posting ------------------------------------------------------------------------
    void defer(void* ctx, int32_t status, std::string message) {
        deferred_.push_back(Deferred{ctx, status, std::move(message)});
    }

    template <class Sink>
    void deliver(Sink& sink) {
        if (deferred_.empty()) return;
        std::vector<Deferred> out;
        out.swap(deferred_);
        for (auto& d : out) sink.on_error(d.ctx, d.status, d.message);
    }

    void stage(QpSlot& q, Staged s) {
        s.seq = q.next_seq++;
        sends_outstanding_++;
        bool idle = q.fifo.empty() && q.staged.empty();
        q.staged.push_back(s);
        if (idle || q.staged.size() >= chain_max_) {
            flush(q);
        } else if (!q.dirty) {
            q.dirty = true;
            dirty_.push_back(&q);
        }
    }

    void flush_dirty() {
        if (dirty_.empty()) return;
        std::vector<QpSlot*> slots;
        slots.swap(dirty_);
        for (QpSlot* q : slots) {
            q->dirty = false;
            flush(*q);
        }
    }

    // Posts what ``q`` has staged, in chains of chain_max, the last of each signalled.
    void flush(QpSlot& q) {
        ibv_send_wr wrs[kMaxChain];
        ibv_sge sges[kMaxChain];
        while (!q.staged.empty() && q.qp) {
            size_t n = std::min<size_t>(q.staged.size(), chain_max_);
            std::vector<bool> flags = q.sig.plan(n);
            for (size_t i = 0; i < n; i++) {
                const Staged& st = q.staged[i];
                ibv_send_wr& wr = wrs[i];
                wr = ibv_send_wr{};
                wr.wr_id = (uint64_t(st.seq) << 32) | (uint64_t(q.uid) << 2) | kWrSend;
                wr.opcode = st.op;
                wr.send_flags = flags[i] ? IBV_SEND_SIGNALED : 0;
                if (st.len) {
                    sges[i] = ibv_sge{st.src, st.len, st.lkey};
                    wr.sg_list = &sges[i];
                    wr.num_sge = 1;
                }
                if (st.op != IBV_WR_SEND) {
                    wr.wr.rdma.remote_addr = st.raddr;
                    wr.wr.rdma.rkey = st.rkey;
                }
                if (st.op == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = st.imm_be;
                wr.next = i + 1 < n ? &wrs[i + 1] : nullptr;
            }
            ibv_send_wr* bad = nullptr;
            int rc = std::abs(ibv_post_send(q.qp, wrs, &bad));  // errno (some providers negate it)
            size_t k = n;
            if (rc != 0) k = bad ? static_cast<size_t>(bad - wrs) : 0;
            q.sig.commit(flags, k);
            stats_.doorbells++;
            for (size_t i = 0; i < k; i++) {
                const Staged& st = q.staged.front();
                q.fifo.push_back(Posted{st.seq, st.ctx, st.send});
                stats_.wrs_signaled += flags[i];
                q.staged.pop_front();
            }
            stats_.wrs_posted += k;
            if (rc == 0) continue;
            if (rc == ENOMEM) {  // the queue is full after all: the rest goes at the next poll
                if (!q.dirty) {
                    q.dirty = true;
                    dirty_.push_back(&q);
                }
                return;
            }
            // Refused (a bad request): fail it, and post the rest. (A prefix posted above
            // whose tail is unsignalled is completed by the next chain's signalled request.)
            Staged st = q.staged.front();
            q.staged.pop_front();
            sends_outstanding_--;
            defer(st.ctx, kTransport, std::string("ibv_post_send on ") + info_.name + ": " + std::strerror(rc));
        }
    }

    int post_ctrl_recv(void* ctx) {
        auto it = recv_bufs_.find(ctx);
        if (it == recv_bufs_.end()) return -EINVAL;
        ibv_sge sge{reinterpret_cast<uint64_t>(it->second.buf), it->second.len, it->second.lkey};
        ibv_recv_wr wr{};
        wr.wr_id = reinterpret_cast<uint64_t>(ctx) | kWrCtrlRecv;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        return -std::abs(ibv_post_srq_recv(ctrl_srq_, &wr, &bad));
    }

    void repost_imm() {
        stats_.imm_low_water = std::min<uint64_t>(stats_.imm_low_water, imm_depth_ - imm_consumed_);
        ibv_recv_wr wrs[kPollBatch];
        while (imm_consumed_ > 0) {
            uint32_t n = std::min<uint32_t>(imm_consumed_, kPollBatch);
            for (uint32_t i = 0; i < n; i++) {
                wrs[i] = ibv_recv_wr{};
                wrs[i].wr_id = kWrImmRecv;
                wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
            }
            ibv_recv_wr* bad = nullptr;
            int rc = ibv_post_srq_recv(imm_srq_, wrs, &bad);
            uint32_t k = rc == 0 ? n : bad ? static_cast<uint32_t>(bad - wrs) : 0;
            imm_consumed_ -= k;
            if (rc != 0) return;  // try again at the next poll
        }
    }

    // --- completions --------------------------------------------------------------------
    template <class Sink>
    void handle(const ibv_wc& wc, Sink& sink) {
        uint64_t id = wc.wr_id;
        uint64_t kind = id & 3;
        if (kind == kWrImmRecv) {
            imm_consumed_++;
            if (wc.status == IBV_WC_SUCCESS && (wc.wc_flags & IBV_WC_WITH_IMM)) sink.on_imm(ntohl(wc.imm_data), kNoSource);
            return;
        }
        if (kind == kWrCtrlRecv) {
            void* ctx = reinterpret_cast<void*>(id & ~uint64_t(3));
            if (wc.status == IBV_WC_SUCCESS) {
                sink.on_recv(ctx, wc.byte_len);  // the engine re-posts it (post_recv)
            } else if (!closing_) {
                post_ctrl_recv(ctx);  // flushed from a QP that died: back into the SRQ
            }
            return;
        }
        auto uid = static_cast<uint32_t>((id >> 2) & 0x3fffffffu);
        auto seq = static_cast<uint32_t>(id >> 32);
        auto it = uids_.find(uid);
        if (it == uids_.end()) return;  // its QP was torn down, and its work failed then
        Conn& c = *it->second.first;
        QpSlot& q = *it->second.second;
        if (wc.status == IBV_WC_SUCCESS) {
            retire(q, seq, true, sink);
            return;
        }
        retire(q, seq, false, sink);  // RC: everything before it completed
        int32_t status = status_of(wc.status);
        std::string cause = std::string(ibv_wc_status_str(wc.status)) + " (vendor error 0x" + to_hex(wc.vendor_err) +
                            ") on the queue pair from " + info_.name + " to " + peer_name(c);
        if (!q.fifo.empty() && q.fifo.front().seq == seq) {
            Posted p = q.fifo.front();
            q.fifo.pop_front();
            sends_outstanding_--;
            sink.on_error(p.ctx, status, cause);
        }
        stats_.qp_errors++;
        teardown(c, status == kPeerUnreachable ? kPeerUnreachable : kTransport,
                 "flushed: an earlier work request on the same connection failed: " + cause);
        if (c.self) {
            c.data.connected = false;
        } else {
            c.hs.reset();  // rebuilt (a new epoch) on the next use
        }
    }

    template <class Sink>
    void retire(QpSlot& q, uint32_t seq, bool inclusive, Sink& sink) {
        while (!q.fifo.empty()) {
            auto d = static_cast<int32_t>(q.fifo.front().seq - seq);
            if (d > 0 || (d == 0 && !inclusive)) break;
            Posted p = q.fifo.front();
            q.fifo.pop_front();
            sends_outstanding_--;
            if (p.send) {
                sink.on_send_done(p.ctx);
            } else {
                sink.on_write_done(p.ctx);
            }
        }
    }

    static std::string to_hex(uint32_t v) {
        char buf[16];
        std::snprintf(buf, sizeof(buf), "%x", v);
        return buf;
    }

    // --- the handshake's datagrams ------------------------------------------------------
    char* ud_recv_buf(uint32_t i) { return ud_arena_.data() + size_t(i) * kUdRecvBytes; }
    char* ud_send_buf(uint32_t i) {
        return ud_arena_.data() + size_t(kUdSlots) * kUdRecvBytes + size_t(i) * kMessageBytes;
    }

    void repost_ud_recv(uint32_t i) {
        ibv_sge sge{reinterpret_cast<uint64_t>(ud_recv_buf(i)), kUdRecvBytes, ud_mr_->lkey};
        ibv_recv_wr wr{};
        wr.wr_id = i;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        ibv_post_recv(ud_qp_, &wr, &bad);
    }

    void ud_send(Conn& c, const std::string& bytes) {
        if (!c.ah) {
            ibv_ah_attr a = path_to(c.peer.gid, c.peer.lid);
            c.ah = ibv_create_ah(pd_, &a);
            if (!c.ah) {
                c.ah_error = std::string("ibv_create_ah to ") + gid_text(c.peer.gid) + ": " + std::strerror(errno);
                stats_.ud_dropped++;  // a lost packet to the machine: it retries, then fails
                return;
            }
        }
        if (ud_free_.empty() || bytes.size() > kMessageBytes) {
            stats_.ud_dropped++;
            return;
        }
        uint32_t slot = ud_free_.back();
        ud_free_.pop_back();
        std::memcpy(ud_send_buf(slot), bytes.data(), bytes.size());
        ibv_sge sge{reinterpret_cast<uint64_t>(ud_send_buf(slot)), static_cast<uint32_t>(bytes.size()), ud_mr_->lkey};
        ibv_send_wr wr{};
        wr.wr_id = kUdSendTag | slot;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.wr.ud.ah = c.ah;
        wr.wr.ud.remote_qpn = c.peer.ud_qpn;
        wr.wr.ud.remote_qkey = c.peer.qkey;
        ibv_send_wr* bad = nullptr;
        if (ibv_post_send(ud_qp_, &wr, &bad) != 0) {
            ud_free_.push_back(slot);
            stats_.ud_dropped++;
            return;
        }
        stats_.ud_sent++;
    }

    size_t poll_ud(double now) {
        ibv_wc wc[16];
        int n = ibv_poll_cq(ud_cq_, 16, wc);
        for (int i = 0; i < n; i++) {
            if (wc[i].wr_id & kUdSendTag) {
                ud_free_.push_back(static_cast<uint32_t>(wc[i].wr_id & 0xffff));
                continue;
            }
            auto slot = static_cast<uint32_t>(wc[i].wr_id);
            if (wc[i].status == IBV_WC_SUCCESS && wc[i].byte_len > 40)
                on_datagram(std::string_view(ud_recv_buf(slot) + 40, wc[i].byte_len - 40), now);
            if (!closing_) repost_ud_recv(slot);
        }
        return n > 0 ? static_cast<size_t>(n) : 0;
    }

    void on_datagram(std::string_view data, double now) {
        HsMessage m;
        try {
            m = decode_message(data);
        } catch (const std::exception&) {
            stats_.ud_garbage++;
            return;
        }
        if (m.to != address_) {
            stats_.ud_garbage++;
            return;
        }
        stats_.ud_received++;
        Conn* c = nullptr;
        auto it = by_addr_.find(m.from);
        if (it != by_addr_.end()) {
            c = conns_[it->second].get();
        } else {
            if (m.type != MsgType::kReq) return;  // answers for a peer we never asked
            Address a = decode_address(m.from);   // decode_message validated it
            if (a.ethernet() != self_.ethernet() || m.from == address_) return;
            c = &new_conn(m.from, a);
        }
        if (c->self) return;
        c->hs.on_message(m, now);
        track(*c);
    }

    void tick(double now) {
        for (size_t i = 0; i < active_.size();) {
            Conn& c = *conns_[active_[i]];
            if (c.hs.connecting() && now >= c.hs.next_timer()) c.hs.tick(now);
            if (c.hs.connecting()) {
                i++;
                continue;
            }
            c.tracked = false;
            active_[i] = active_.back();
            active_.pop_back();
        }
    }

    DomainConfig cfg_;
    std::mt19937_64 rng_;
    DeviceInfo info_;
    PortInfo port_;
    GidInfo gid_;
    Address self_;
    std::string address_;
    uint64_t max_wr_ = kMaxSgeBytes;
    uint32_t chain_max_ = 16;
    uint32_t sq_depth_ = 0;
    uint32_t imm_depth_ = 0;
    uint32_t ctrl_depth_ = 0;
    uint64_t send_budget_ = 0;
    uint64_t sends_outstanding_ = 0;  // send-queue requests staged or posted, all QPs
    uint32_t imm_consumed_ = 0;       // imm receives to re-post
    uint32_t qkey_ = 0;
    uint32_t next_uid_ = 1;
    bool closing_ = false;

    ibv_context* ctx_ = nullptr;
    ibv_pd* pd_ = nullptr;
    ibv_cq* cq_ = nullptr;
    ibv_cq* ud_cq_ = nullptr;
    ibv_srq* imm_srq_ = nullptr;
    ibv_srq* ctrl_srq_ = nullptr;
    ibv_qp* ud_qp_ = nullptr;
    ibv_mr* ud_mr_ = nullptr;
    std::vector<char> ud_arena_;
    std::vector<uint32_t> ud_free_;
    std::vector<ibv_mr*> local_mrs_;

    std::vector<std::unique_ptr<Conn>> conns_;  // by handle; never removed before close
    std::unordered_map<std::string, uint32_t> by_addr_;
    std::unordered_map<uint32_t, std::pair<Conn*, QpSlot*>> uids_;
    std::unordered_map<ibv_qp*, uint32_t> qps_;             // live QP -> its uid (async events)
    struct Grave {
        ibv_qp* qp;
        double at;  // destroy then
        uint32_t flushing;
    };
    std::vector<Grave> graveyard_;  // QPs in the error state, destroyed a little later
    uint64_t flushing_ = 0;         // flush completions the graveyard still owes the CQ
    double next_housekeeping_ = 0;
    std::unordered_map<void*, RecvBuf> recv_bufs_;
    std::vector<uint32_t> active_;  // handles with a handshake in progress
    std::vector<QpSlot*> dirty_;    // send queues with staged requests
    std::vector<Deferred> deferred_;
    DomainStats stats_;
};

}  // namespace fabric::verbs
