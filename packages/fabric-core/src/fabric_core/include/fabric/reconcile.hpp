// Exact imm accounting across a lost NIC (the C++ twin of fabric_core/reconcile.py; read its
// docstring for the argument). Per path (one peer, one NIC) both ends keep the power sums
// S_j = sum (imm + 1)^j mod P, j < kDegree, of the imms moved on it: the target of those it
// counted, the sender of those whose work requests completed. Once the path is quiet, their
// difference is the power sums of the failed work requests that were counted anyway, and
// with the failed requests' imm values known, how many landed per value follows. The sums are
// kept in kBuckets independent sets (an imm's set: a hash of it), each solved on its own, so
// up to kDegree distinct values per set are told apart.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace fabric {

constexpr uint64_t kPrime = (uint64_t(1) << 61) - 1;
constexpr int kDegree = 8;
constexpr int kBucketBits = 4;
constexpr int kBuckets = 1 << kBucketBits;

inline int bucket_of(uint32_t imm) { return static_cast<int>((imm * 0x9E3779B1u) >> (32 - kBucketBits)); }

using SumSet = std::array<uint64_t, kDegree>;
using Sums = std::array<SumSet, kBuckets>;

inline uint64_t mod_add(uint64_t a, uint64_t b) {
    uint64_t s = a + b;  // both < 2^61: no overflow
    return s >= kPrime ? s - kPrime : s;
}
inline uint64_t mod_sub(uint64_t a, uint64_t b) { return a >= b ? a - b : a + kPrime - b; }
inline uint64_t mod_mul(uint64_t a, uint64_t b) {
    unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
    uint64_t r = static_cast<uint64_t>(p & kPrime) + static_cast<uint64_t>(p >> 61);  // < 2^62
    r = (r & kPrime) + (r >> 61);
    return r >= kPrime ? r - kPrime : r;
}
inline uint64_t mod_pow(uint64_t a, uint64_t e) {
    uint64_t r = 1;
    while (e) {
        if (e & 1) r = mod_mul(r, a);
        a = mod_mul(a, a);
        e >>= 1;
    }
    return r;
}

inline void add_sums(SumSet& s, uint32_t imm, uint64_t times) {
    uint64_t x = uint64_t(imm) + 1, v = times % kPrime;
    for (int j = 0; j < kDegree; j++) {
        s[j] = mod_add(s[j], v);
        v = mod_mul(v, x);
    }
}

struct PowerSums {
    Sums s{};
    void add(uint32_t imm, uint64_t times = 1) { add_sums(s[bucket_of(imm)], imm, times); }
    Sums minus(const PowerSums& o) const {
        Sums d{};
        for (int b = 0; b < kBuckets; b++)
            for (int j = 0; j < kDegree; j++) d[b][j] = mod_sub(s[b][j], o.s[b][j]);
        return d;
    }
};

// One set: how many of its failed values landed.
inline std::optional<std::map<uint32_t, uint64_t>> landed_in_set(const SumSet& delta,
                                                                 const std::map<uint32_t, uint64_t>& failed) {
    SumSet all{};
    uint64_t total = 0;
    for (const auto& [x, n] : failed) {
        add_sums(all, x, n);
        total += n;
    }
    bool zero = true;
    for (uint64_t d : delta) zero &= d == 0;
    std::map<uint32_t, uint64_t> out;
    if (zero) {
        for (const auto& [x, n] : failed) out[x] = 0;
        return out;
    }
    if (delta == all) return failed;
    size_t m = failed.size();
    if (m == 0 || m > size_t(kDegree) || delta[0] > total) return std::nullopt;
    // Vandermonde rows j < m over the nodes (x + 1), Gaussian elimination mod kPrime.
    std::vector<uint32_t> values;
    for (const auto& [x, n] : failed) values.push_back(x);
    std::vector<std::vector<uint64_t>> a(m, std::vector<uint64_t>(m + 1));
    for (size_t j = 0; j < m; j++) {
        for (size_t i = 0; i < m; i++) a[j][i] = mod_pow(uint64_t(values[i]) + 1, j);
        a[j][m] = delta[j];
    }
    for (size_t col = 0; col < m; col++) {
        size_t pivot = col;
        while (pivot < m && a[pivot][col] == 0) pivot++;
        if (pivot == m) return std::nullopt;
        std::swap(a[col], a[pivot]);
        uint64_t inv = mod_pow(a[col][col], kPrime - 2);
        for (auto& v : a[col]) v = mod_mul(v, inv);
        for (size_t r = 0; r < m; r++) {
            if (r == col || a[r][col] == 0) continue;
            uint64_t f = a[r][col];
            for (size_t c = 0; c <= m; c++) a[r][c] = mod_sub(a[r][c], mod_mul(f, a[col][c]));
        }
    }
    SumSet check{};
    for (size_t i = 0; i < m; i++) {
        uint64_t l = a[i][m];
        if (l > failed.at(values[i])) return std::nullopt;
        out[values[i]] = l;
        add_sums(check, values[i], l);
    }
    if (check != delta) return std::nullopt;  // the rows not used must agree too
    return out;
}

// How many of the failed work requests landed, per imm value (``failed``: imm -> how many
// failed carrying it); nullopt where the sums do not determine it or do not fit ``failed``.
inline std::optional<std::map<uint32_t, uint64_t>> landed_per_imm(const Sums& delta,
                                                                  const std::map<uint32_t, uint64_t>& failed) {
    std::array<std::map<uint32_t, uint64_t>, kBuckets> per_set;
    for (const auto& [x, n] : failed) per_set[bucket_of(x)][x] = n;
    std::map<uint32_t, uint64_t> out;
    for (int b = 0; b < kBuckets; b++) {
        if (per_set[b].empty()) {
            for (uint64_t d : delta[b])
                if (d != 0) return std::nullopt;  // counts of values that did not fail here
            continue;
        }
        auto got = landed_in_set(delta[b], per_set[b]);
        if (!got) return std::nullopt;
        out.insert(got->begin(), got->end());
    }
    return out;
}

}  // namespace fabric
