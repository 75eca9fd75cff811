// The cutting rules of fabric_core.ops, in C++, for the accepted path of a submit.
//
// fabric_core.plan_request is the specification: it validates and plans every request and
// owns every error message. A compiled backend plans the common requests here instead (a
// single write, a paged write, an imm) so that no Python runs per work request; whatever
// these functions do not accept goes back to plan_request, which then raises the right
// ConfigError. The two must cut identically: the backends' tests compare them request by
// request.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine.hpp"

namespace fabric::plan {

constexpr uint64_t kShardAlign = 4096;
constexpr uint64_t kLimit = uint64_t(1) << 63;

using u128 = unsigned __int128;

// Bytes [off, off + len) lie inside a region of ``limit`` bytes and below 2**63.
inline bool span_ok(u128 off, uint64_t len, uint64_t limit) {
    u128 end = off + len;
    return end < kLimit && end <= limit;
}

// One work request, cut into pieces of at most ``max_msg`` bytes (each piece carries the
// request's imm); a zero-length write stays one work request.
inline void emit(std::vector<OpCtx>& ops, uint32_t nic, uint32_t target, uint64_t src, uint64_t dst, uint64_t len,
                 uint64_t max_msg) {
    uint64_t off = 0;
    do {
        OpCtx& op = ops.emplace_back();
        uint64_t piece = std::min(max_msg, len - off);
        op.nic = nic;
        op.target = target;
        op.src = src + off;
        op.dst_off = dst + off;
        op.len = piece;
        off += piece;
    } while (off < len);
}

// The shard rule of a single write: at most ``k`` shards of round_up(ceil(len / k), 4096)
// bytes on NICs first, first + 1, ... (mod n).
inline void shards(std::vector<OpCtx>& ops, uint32_t target, uint64_t src, uint64_t dst, uint64_t length, uint64_t k,
                   uint64_t first, uint64_t n, uint64_t max_msg) {
    if (length == 0) {
        emit(ops, static_cast<uint32_t>(first % n), target, src, dst, 0, max_msg);
        return;
    }
    uint64_t per_nic = length / k + (length % k != 0);
    uint64_t size = (per_nic + kShardAlign - 1) / kShardAlign * kShardAlign;
    uint64_t i = 0;
    for (uint64_t off = 0; off < length; off += size, i++) {
        emit(ops, static_cast<uint32_t>((first + i) % n), target, src + off, dst + off, std::min(size, length - off),
             max_msg);
    }
}

// Are the page indices pairwise distinct? ``lo``/``hi`` are their bounds.
template <class Get>
bool distinct(size_t count, int64_t lo, int64_t hi, Get at) {
    uint64_t range = static_cast<uint64_t>(hi - lo) + 1;
    if (range <= std::max<uint64_t>(1u << 16, 32 * static_cast<uint64_t>(count))) {
        std::vector<uint64_t> seen((range + 63) / 64, 0);
        for (size_t i = 0; i < count; i++) {
            uint64_t b = static_cast<uint64_t>(at(i) - lo);
            uint64_t bit = uint64_t(1) << (b % 64);
            if (seen[b / 64] & bit) return false;
            seen[b / 64] |= bit;
        }
        return true;
    }
    std::vector<int64_t> sorted(count);
    for (size_t i = 0; i < count; i++) sorted[i] = at(i);
    std::sort(sorted.begin(), sorted.end());
    return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

}  // namespace fabric::plan
