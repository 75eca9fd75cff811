// Work-request limits, chaining and selective signalling of the verbs backend (pure C++).
//
// Splitting happens before the Domain: fabric_core.plan_request (and fabric/plan.hpp on the
// fast path) cut every shard at the engine's max_msg_size, and the verbs engine sets that to
// max_wr_bytes(): the port's max_msg_sz (queried, never assumed), at most 2**31 bytes (an
// ibv_sge length is 32 bits: the reference system silently truncated shards above 4 GiB), and
// the user's cap. The Domain still refuses a longer work request rather than truncate it.
//
// Chaining and signalling: a Domain stages the work requests of each send queue and posts
// them as linked chains of at most chain_max (one doorbell each). Only some are signalled: the
// one that ends a run of signal_every, and the last of every chain, so the queue never holds
// an unsignalled tail whose completion nobody would see. On an RC queue pair completions come
// in posting order, so a signalled completion also completes every unsignalled request before
// it (the Domain reports those to the engine at that point).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fabric::verbs {

constexpr uint64_t kMaxSgeBytes = uint64_t(1) << 31;

// The largest work request the engine may plan: the port's max_msg_sz (0: unreported, then
// the SGE limit), the SGE limit, and the user's cap (0: none).
inline uint64_t max_wr_bytes(uint64_t port_max_msg_sz, uint64_t cap) {
    uint64_t m = port_max_msg_sz ? std::min(port_max_msg_sz, kMaxSgeBytes) : kMaxSgeBytes;
    if (cap) m = std::min(m, cap);
    return m;
}

// The signalling rule of one send queue.
class Signaller {
  public:
    explicit Signaller(uint32_t every = 16) : every_(std::max<uint32_t>(1, every)) {}

    // Whether the next work request is signalled; ``last``: it ends its chain.
    bool next(bool last) {
        if (last || ++run_ >= every_) {
            run_ = 0;
            return true;
        }
        return false;
    }
    // The flags of a chain of ``n`` without committing them (see commit()).
    std::vector<bool> plan(size_t n) const {
        Signaller s = *this;
        std::vector<bool> flags(n);
        for (size_t i = 0; i < n; i++) flags[i] = s.next(i + 1 == n);
        return flags;
    }
    // Only the first ``k`` of ``flags`` were posted (a partial post).
    void commit(const std::vector<bool>& flags, size_t k) {
        for (size_t i = 0; i < k; i++) run_ = flags[i] ? 0 : run_ + 1;
    }
    uint32_t every() const { return every_; }

  private:
    uint32_t every_;
    uint32_t run_ = 0;  // unsignalled requests posted since the last signalled one
};

// One planned work request of build_chains: the index of the op it posts, its chain (one
// doorbell on one send queue) and whether it is signalled.
struct PlannedWr {
    uint64_t index;
    uint32_t chain;
    bool signaled;
};

// What a Domain does with a batch of ops, for the tests: each op goes to the send queue of
// (nic, target); a queue's staged ops are posted as a chain when chain_max are staged, and
// the rest at the end of the batch (the Domain's poll), each queue's in the order the queue
// was first used. Throws std::invalid_argument for an op above max_wr or the SGE limit.
inline std::vector<PlannedWr> build_chains(const std::vector<uint32_t>& nic, const std::vector<uint32_t>& target,
                                           const std::vector<uint64_t>& length, uint64_t max_wr, uint32_t chain_max,
                                           uint32_t signal_every) {
    if (nic.size() != target.size() || nic.size() != length.size())
        throw std::invalid_argument("nic, target and length differ in length");
    if (chain_max < 1) throw std::invalid_argument("chain_max must be at least 1");
    uint64_t limit = std::min(max_wr, kMaxSgeBytes);
    struct Queue {
        std::vector<uint64_t> staged;
        Signaller sig;
    };
    std::vector<Queue> queues;
    std::unordered_map<uint64_t, size_t> which;
    std::vector<PlannedWr> out;
    uint32_t chains = 0;
    auto flush = [&](Queue& q) {
        if (q.staged.empty()) return;
        std::vector<bool> flags = q.sig.plan(q.staged.size());
        q.sig.commit(flags, flags.size());
        for (size_t i = 0; i < q.staged.size(); i++) out.push_back(PlannedWr{q.staged[i], chains, flags[i]});
        chains++;
        q.staged.clear();
    };
    for (size_t i = 0; i < nic.size(); i++) {
        if (length[i] > limit) {
            throw std::invalid_argument("work request " + std::to_string(i) + " of " + std::to_string(length[i]) +
                                        " bytes exceeds the limit of " + std::to_string(limit) +
                                        " (it would be truncated): split it at max_wr_bytes()");
        }
        uint64_t key = (uint64_t(nic[i]) << 32) | target[i];
        auto it = which.find(key);
        if (it == which.end()) {
            it = which.emplace(key, queues.size()).first;
            queues.push_back(Queue{{}, Signaller(signal_every)});
        }
        Queue& q = queues[it->second];
        q.staged.push_back(i);
        if (q.staged.size() >= chain_max) flush(q);
    }
    for (auto& q : queues) flush(q);
    return out;
}

}  // namespace fabric::verbs
