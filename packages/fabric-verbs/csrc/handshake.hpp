// The connection handshake of the verbs backend, as a transport-agnostic state machine.
//
// Two domains that want to write to each other need a pair of connected RC queue pairs, and
// each side needs the other's QPN, first PSN, GID, LID and MTU. The Domain carries these in
// small datagrams over a UD queue pair (whose address is the DomainAddress), and datagrams get
// lost, duplicated and reordered. The machine here decides what to do with each; it never
// touches the network or a clock itself, so the tests drive it with an explicit clock and a
// fake transport that drops, duplicates and reorders (tests/test_handshake.py).
//
// Messages (fixed 128 bytes, CRC-32 checked, see encode_message):
//   REQ(epoch e_a, params_a)            "connect your QP to mine (my incarnation e_a)"
//   REP(epoch e_b, echo e_a, params_b)  "my QP e_b is connected to your QP e_a"
//   ACK(epoch e_a, echo e_b)            "mine is connected to yours: you may send"
// Each side numbers its incarnations of one connection (epochs, from 1; a rebuilt QP is a
// new epoch), so a late message from an older incarnation is recognised and ignored.
//
// Rules:
// - start(): IDLE or FAILED -> a fresh QP (new epoch), REQ, REQ_SENT. The REQ is resent with
//   exponential backoff (retry_initial_s doubling up to retry_max_s) until a REP arrives or
//   timeout_s passes: then FAILED (the Domain fails the waiting writes with PeerUnreachable).
// - REQ from a new incarnation of the peer (epoch above the last one seen):
//     IDLE / FAILED: a fresh QP, connected to the peer's (RTR+RTS), REP, REP_SENT.
//     REQ_SENT (simultaneous open): the side with the lower address stays active and ignores
//       it (its own REQ will be answered); the other answers it with the QP it made for its
//       own REQ: REP, REP_SENT.
//     REP_SENT / CONNECTED: the peer rebuilt its side: the old QP is torn down (its in-flight
//       work fails) and a fresh one answers: REP, REP_SENT.
// - REQ of the incarnation already seen: a duplicate. The passive side (that sent the REP)
//   resends its REP: a lost REP is recovered by the peer's REQ retry. Anything older: ignored.
// - REP echoing the current epoch, in REQ_SENT (or in REP_SENT from a newer incarnation of
//   the peer): connect to it, ACK, CONNECTED. A duplicate REP when CONNECTED (the ACK was
//   lost): resend the ACK. The passive side resends its REP with backoff until the ACK comes.
// - ACK of the current pair in REP_SENT: CONNECTED. The passive side sends nothing before it
//   (the active side's QP may not be ready to receive yet); it receives from RTR on.
// Every resend is idempotent, every state but CONNECTED has a deadline, so with finitely many
// losses both sides end CONNECTED with each other's parameters, and with all packets lost
// both end FAILED by the deadline: never a hang.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

#include "address.hpp"

namespace fabric::verbs {

enum class MsgType : uint8_t { kReq = 1, kRep = 2, kAck = 3 };

inline const char* type_name(MsgType t) {
    switch (t) {
        case MsgType::kReq:
            return "REQ";
        case MsgType::kRep:
            return "REP";
        case MsgType::kAck:
            return "ACK";
    }
    return "?";
}

// What one side tells the other about its queue pairs.
struct QpParams {
    uint32_t qpn = 0;       // the RC QP of writes (its receives come from the imm SRQ)
    uint32_t ctrl_qpn = 0;  // the RC QP of control messages (NIC 0 only; 0: none)
    uint32_t psn = 0;       // first PSN of both QPs' send queues (24 bits)
    std::array<uint8_t, 16> gid{};
    uint16_t lid = 0;
    uint8_t mtu = 0;  // enum ibv_mtu of the port

    bool operator==(const QpParams& o) const {
        return qpn == o.qpn && ctrl_qpn == o.ctrl_qpn && psn == o.psn && gid == o.gid && lid == o.lid && mtu == o.mtu;
    }
    bool operator!=(const QpParams& o) const { return !(*this == o); }
};

struct HsMessage {
    MsgType type = MsgType::kReq;
    uint32_t epoch = 0;  // the sender's incarnation of this connection
    uint32_t echo = 0;   // the receiver's incarnation as the sender knows it (REP, ACK; 0 in REQ)
    std::string from;    // the sender's encoded address
    std::string to;      // the receiver's encoded address
    QpParams params;     // REQ and REP; zero in ACK
};

constexpr size_t kMessageBytes = 128;
constexpr uint8_t kMessageVersion = 1;

//   0 "fh"  2 version  3 type  4 epoch  8 echo  12 from (40)  52 to (40)
//  92 qpn  96 ctrl_qpn  100 psn  104 gid (16)  120 lid  122 mtu  123 zero  124 CRC-32 of [0, 124)
inline std::string encode_message(const HsMessage& m) {
    if (m.from.size() != kAddressBytes || m.to.size() != kAddressBytes)
        throw std::invalid_argument("handshake message: addresses must be encoded addresses");
    uint8_t b[kMessageBytes] = {};
    b[0] = 'f';
    b[1] = 'h';
    b[2] = kMessageVersion;
    b[3] = static_cast<uint8_t>(m.type);
    put32(b + 4, m.epoch);
    put32(b + 8, m.echo);
    std::memcpy(b + 12, m.from.data(), kAddressBytes);
    std::memcpy(b + 52, m.to.data(), kAddressBytes);
    put32(b + 92, m.params.qpn);
    put32(b + 96, m.params.ctrl_qpn);
    put32(b + 100, m.params.psn);
    std::memcpy(b + 104, m.params.gid.data(), 16);
    put16(b + 120, m.params.lid);
    b[122] = m.params.mtu;
    put32(b + 124, crc32(b, 124));
    return std::string(reinterpret_cast<const char*>(b), kMessageBytes);
}

// Throws std::invalid_argument with the reason for anything but a well-formed message.
inline HsMessage decode_message(std::string_view raw) {
    auto bad = [](const std::string& why) { return std::invalid_argument("not a fabric-verbs handshake: " + why); };
    if (raw.size() != kMessageBytes)
        throw bad(std::to_string(raw.size()) + " bytes, expected " + std::to_string(kMessageBytes));
    const auto* b = reinterpret_cast<const uint8_t*>(raw.data());
    if (b[0] != 'f' || b[1] != 'h') throw bad("wrong magic");
    if (b[2] != kMessageVersion) throw bad("version " + std::to_string(b[2]));
    if (get32(b + 124) != crc32(b, 124)) throw bad("checksum mismatch");
    if (b[3] < 1 || b[3] > 3) throw bad("unknown type " + std::to_string(b[3]));
    if (b[123] != 0) throw bad("reserved byte is not zero");
    HsMessage m;
    m.type = static_cast<MsgType>(b[3]);
    m.epoch = get32(b + 4);
    m.echo = get32(b + 8);
    m.from.assign(raw.data() + 12, kAddressBytes);
    m.to.assign(raw.data() + 52, kAddressBytes);
    decode_address(m.from);  // both must be addresses (throws with the reason)
    decode_address(m.to);
    m.params.qpn = get32(b + 92);
    m.params.ctrl_qpn = get32(b + 96);
    m.params.psn = get32(b + 100);
    std::memcpy(m.params.gid.data(), b + 104, 16);
    m.params.lid = get16(b + 120);
    m.params.mtu = b[122];
    if (m.epoch == 0) throw bad("epoch 0");
    if (m.type == MsgType::kReq && m.echo != 0) throw bad("a REQ echoes no epoch");
    if (m.type != MsgType::kReq && m.echo == 0) throw bad(std::string(type_name(m.type)) + " echoes epoch 0");
    if (m.type == MsgType::kAck) {
        if (m.params != QpParams{}) throw bad("an ACK carries no queue pair parameters");
    } else {
        const QpParams& p = m.params;
        if (p.qpn < 2 || p.qpn >= (1u << 24)) throw bad("QPN " + std::to_string(p.qpn));
        if (p.ctrl_qpn == 1 || p.ctrl_qpn >= (1u << 24)) throw bad("control QPN " + std::to_string(p.ctrl_qpn));
        if (p.psn >= (1u << 24)) throw bad("PSN " + std::to_string(p.psn) + " is not 24 bits");
        if (p.mtu < 1 || p.mtu > 5) throw bad("MTU code " + std::to_string(p.mtu));
    }
    return m;
}

enum class HsState : uint8_t { kIdle, kReqSent, kRepSent, kConnected, kFailed };

inline const char* state_name(HsState s) {
    switch (s) {
        case HsState::kIdle:
            return "idle";
        case HsState::kReqSent:
            return "req_sent";
        case HsState::kRepSent:
            return "rep_sent";
        case HsState::kConnected:
            return "connected";
        case HsState::kFailed:
            return "failed";
    }
    return "?";
}

struct HsTiming {
    double retry_initial_s = 0.005;  // first resend after this long
    double retry_max_s = 0.25;       // the backoff doubles up to this
    double timeout_s = 5.0;          // no answer by then: FAILED (PeerUnreachable)
};

// What the machine asks of its owner (the Domain, or a test's fake).
class HandshakeHost {
  public:
    virtual ~HandshakeHost() = default;
    // A fresh queue pair (pair) in INIT for incarnation ``epoch``, replacing any older one
    // (destroyed quietly: the machine calls teardown() first where work may be in flight).
    // Its parameters go into REQ / REP. May throw: the machine then fails with the reason.
    virtual QpParams open_qp(uint32_t epoch) = 0;
    // Connect the current queue pair to the peer's (RTR then RTS; from any state). False or a
    // throw: the machine fails with ``why``.
    virtual bool connect_qp(const QpParams& remote, std::string& why) = 0;
    // The peer rebuilt its side: fail the work in flight on the current QP and destroy it.
    virtual void teardown(const std::string& why) = 0;
    // Send one encoded message to the peer (best effort: a message may be lost).
    virtual void send(const std::string& bytes) = 0;
    virtual void connected() = 0;
    // The deadline passed (or a QP could not be made): the waiting work fails with ``why``.
    virtual void failed(const std::string& why) = 0;
};

class HandshakeMachine {
  public:
    HandshakeMachine(std::string local_address, std::string peer_address, HsTiming timing, HandshakeHost& host)
        : local_addr_(std::move(local_address)), peer_(std::move(peer_address)), timing_(timing), host_(host) {}

    HandshakeMachine(const HandshakeMachine&) = delete;
    HandshakeMachine& operator=(const HandshakeMachine&) = delete;

    // Connect (first use, or again after a failure or a reset). A no-op while connecting or
    // connected.
    void start(double now) {
        if (state_ != HsState::kIdle && state_ != HsState::kFailed) return;
        failure_.clear();
        if (!open(now)) return;
        active_ = true;
        enter(HsState::kReqSent, now);
        send(MsgType::kReq);
    }

    // A message that decoded (decode_message); anything not between these two ends is ignored.
    void on_message(const HsMessage& m, double now) {
        if (m.from != peer_ || m.to != local_addr_) {
            ignored_++;
            return;
        }
        switch (m.type) {
            case MsgType::kReq:
                on_req(m, now);
                break;
            case MsgType::kRep:
                on_rep(m, now);
                break;
            case MsgType::kAck:
                on_ack(m);
                break;
        }
    }

    // Resends and the deadline; call it whenever now >= next_timer().
    void tick(double now) {
        if (!connecting()) return;
        if (now >= deadline_) {
            fail("no answer from the peer within " + fmt(timing_.timeout_s) + " s (" + std::to_string(sent_in_state_) +
                 " " + (state_ == HsState::kReqSent ? "REQ" : "REP") + " messages sent)");
            return;
        }
        if (now >= next_retry_) {
            backoff_ = std::min(backoff_ * 2, timing_.retry_max_s);
            next_retry_ = now + backoff_;
            retries_++;
            send(state_ == HsState::kReqSent ? MsgType::kReq : MsgType::kRep);
        }
    }

    // The connection broke under the machine (a QP went to the error state and the owner tore
    // it down): back to IDLE, keeping the epochs, so the next start() is a new incarnation.
    void reset() {
        state_ = HsState::kIdle;
        active_ = false;
    }

    double next_timer() const {
        return connecting() ? std::min(next_retry_, deadline_) : std::numeric_limits<double>::infinity();
    }
    bool connecting() const { return state_ == HsState::kReqSent || state_ == HsState::kRepSent; }
    HsState state() const { return state_; }
    bool active() const { return active_; }
    uint32_t local_epoch() const { return local_epoch_; }
    uint32_t remote_epoch() const { return remote_epoch_; }
    const QpParams& local_params() const { return local_; }
    const QpParams& remote_params() const { return remote_; }
    const std::string& failure() const { return failure_; }
    const std::string& peer_address() const { return peer_; }
    uint64_t sent() const { return sent_; }
    uint64_t retries() const { return retries_; }
    uint64_t ignored() const { return ignored_; }

  private:
    void on_req(const HsMessage& m, double now) {
        if (remote_epoch_ != 0 && m.epoch <= remote_epoch_) {
            // The incarnation we know: a duplicate. Our REP was lost (or is late): resend it.
            // The active side ignores it (the peer's simultaneous-open REQ, superseded).
            if (m.epoch == remote_epoch_ && !active_ &&
                (state_ == HsState::kRepSent || state_ == HsState::kConnected)) {
                send(MsgType::kRep);
            } else {
                ignored_++;
            }
            return;
        }
        // A new incarnation of the peer's side.
        if (state_ == HsState::kReqSent) {
            if (local_addr_ < peer_) {  // simultaneous open: the lower address stays active
                ignored_++;
                return;
            }
            passive(m, now);  // answer with the QP made for our own REQ
            return;
        }
        if (state_ == HsState::kRepSent || state_ == HsState::kConnected)
            host_.teardown("the peer rebuilt its side of the connection");
        failure_.clear();
        if (!open(now)) return;
        passive(m, now);
    }

    void on_rep(const HsMessage& m, double now) {
        if (local_epoch_ == 0 || m.echo != local_epoch_) {  // for another incarnation of ours
            ignored_++;
            return;
        }
        bool fresh = state_ == HsState::kReqSent || (state_ == HsState::kRepSent && m.epoch > remote_epoch_);
        if (fresh) {
            remote_ = m.params;
            remote_epoch_ = m.epoch;
            if (!connect(now)) return;
            active_ = true;
            state_ = HsState::kConnected;
            send(MsgType::kAck);
            host_.connected();
            return;
        }
        if (state_ == HsState::kConnected && active_ && m.epoch == remote_epoch_) {
            send(MsgType::kAck);  // our ACK was lost: the peer resent its REP
            return;
        }
        if (state_ == HsState::kConnected && m.epoch > remote_epoch_) {
            // The peer rebuilt its side and answered a late REQ of ours: start over.
            host_.teardown("the peer rebuilt its side of the connection");
            state_ = HsState::kIdle;
            start(now);
            return;
        }
        ignored_++;
    }

    void on_ack(const HsMessage& m) {
        if (state_ == HsState::kRepSent && m.echo == local_epoch_ && m.epoch == remote_epoch_) {
            state_ = HsState::kConnected;
            host_.connected();
            return;
        }
        ignored_++;
    }

    // Answer the peer's REQ ``m`` with our current QP.
    void passive(const HsMessage& m, double now) {
        remote_ = m.params;
        remote_epoch_ = m.epoch;
        active_ = false;
        if (!connect(now)) return;
        enter(HsState::kRepSent, now);
        send(MsgType::kRep);
    }

    bool open(double now) {
        uint32_t epoch = ++epochs_;
        try {
            local_ = host_.open_qp(epoch);
        } catch (const std::exception& e) {
            local_epoch_ = epoch;
            fail(std::string("cannot create a queue pair: ") + e.what());
            return false;
        }
        local_epoch_ = epoch;
        (void)now;
        return true;
    }

    bool connect(double now) {
        std::string why;
        bool ok = false;
        try {
            ok = host_.connect_qp(remote_, why);
        } catch (const std::exception& e) {
            why = e.what();
        }
        if (!ok) fail("cannot connect the queue pair to the peer's: " + why);
        (void)now;
        return ok;
    }

    void enter(HsState s, double now) {
        state_ = s;
        backoff_ = timing_.retry_initial_s;
        next_retry_ = now + backoff_;
        deadline_ = now + timing_.timeout_s;
        sent_in_state_ = 0;
    }

    void fail(const std::string& why) {
        state_ = HsState::kFailed;
        active_ = false;
        failure_ = why;
        host_.failed(why);
    }

    void send(MsgType t) {
        HsMessage m;
        m.type = t;
        m.epoch = local_epoch_;
        m.echo = t == MsgType::kReq ? 0 : remote_epoch_;
        m.from = local_addr_;
        m.to = peer_;
        if (t != MsgType::kAck) m.params = local_;
        sent_++;
        sent_in_state_++;
        host_.send(encode_message(m));
    }

    static std::string fmt(double s) {
        std::string t = std::to_string(s);
        while (t.size() > 1 && t.back() == '0') t.pop_back();
        if (!t.empty() && t.back() == '.') t.pop_back();
        return t;
    }

    std::string local_addr_;
    std::string peer_;
    HsTiming timing_;
    HandshakeHost& host_;
    HsState state_ = HsState::kIdle;
    bool active_ = false;
    uint32_t epochs_ = 0;  // incarnations made so far
    uint32_t local_epoch_ = 0;
    uint32_t remote_epoch_ = 0;
    QpParams local_;
    QpParams remote_;
    double backoff_ = 0;
    double next_retry_ = 0;
    double deadline_ = 0;
    std::string failure_;
    uint64_t sent_ = 0;
    uint64_t sent_in_state_ = 0;
    uint64_t retries_ = 0;
    uint64_t ignored_ = 0;
};

}  // namespace fabric::verbs
