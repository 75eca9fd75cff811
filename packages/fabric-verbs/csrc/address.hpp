// The DomainAddress of one verbs NIC: what a peer needs to reach this domain's handshake
// queue pair (a UD QP) and to build an address handle for it.
//
// Fixed size (kAddressBytes), little-endian, versioned, with a CRC-32 over everything before
// it, so that a truncated, foreign or corrupted address is refused at decode time with the
// reason (ValueError in Python) instead of becoming a handshake to nowhere:
//
//   offset  size  field
//        0     2  magic "fv"
//        2     1  version (1)
//        3     1  flags: bit 0 Ethernet link layer (RoCE), bit 1 the GID is RoCE v2
//        4    16  GID (network byte order, as ibv_gid.raw)
//       20     2  LID (0 on RoCE)
//       22     1  port number (>= 1)
//       23     1  GID index
//       24     4  QPN of the handshake UD QP (24 bits, >= 2)
//       28     4  Q_Key of that QP (random per engine; bit 31 clear: not a privileged Q_Key)
//       32     1  active MTU of the port (enum ibv_mtu: 1 = 256 ... 5 = 4096)
//       33     3  reserved, zero
//       36     4  CRC-32 (IEEE, zlib's) of bytes [0, 36)
//
// Pure C++ (no libibverbs): the testing bindings exercise it on machines without a device.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

namespace fabric::verbs {

constexpr size_t kAddressBytes = 40;
constexpr uint8_t kAddressVersion = 1;
constexpr char kAddressMagic[2] = {'f', 'v'};

constexpr uint8_t kFlagEthernet = 1;
constexpr uint8_t kFlagRoceV2 = 2;
constexpr uint8_t kKnownFlags = kFlagEthernet | kFlagRoceV2;

// zlib's CRC-32 (reflected, polynomial 0xEDB88320), table built at compile time.
namespace detail {
constexpr std::array<uint32_t, 256> crc_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[i] = c;
    }
    return t;
}
inline constexpr std::array<uint32_t, 256> kCrcTable = crc_table();
}  // namespace detail

inline uint32_t crc32(const void* data, size_t len) {
    const auto* p = static_cast<const uint8_t*>(data);
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < len; i++) c = detail::kCrcTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

// Little-endian field access (the wire format does not depend on the host).
inline void put16(uint8_t* p, uint16_t v) {
    p[0] = static_cast<uint8_t>(v);
    p[1] = static_cast<uint8_t>(v >> 8);
}
inline void put32(uint8_t* p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
inline uint32_t get32(const uint8_t* p) {
    return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

struct Address {
    std::array<uint8_t, 16> gid{};
    uint16_t lid = 0;
    uint8_t port = 1;
    uint8_t gid_index = 0;
    uint32_t ud_qpn = 0;
    uint32_t qkey = 0;
    uint8_t mtu = 3;  // IBV_MTU_1024
    uint8_t flags = 0;

    bool ethernet() const { return (flags & kFlagEthernet) != 0; }
    bool roce_v2() const { return (flags & kFlagRoceV2) != 0; }
    bool operator==(const Address& o) const {
        return gid == o.gid && lid == o.lid && port == o.port && gid_index == o.gid_index && ud_qpn == o.ud_qpn &&
               qkey == o.qkey && mtu == o.mtu && flags == o.flags;
    }
    bool operator!=(const Address& o) const { return !(*this == o); }
};

// The fields' own rules; empty when valid, else the reason.
inline std::string address_problem(const Address& a) {
    if (a.port == 0) return "port 0 is not a port (ports count from 1)";
    if (a.ud_qpn < 2 || a.ud_qpn >= (1u << 24)) return "QPN " + std::to_string(a.ud_qpn) + " is not a 24-bit QPN >= 2";
    if (a.qkey & 0x80000000u) return "Q_Key has bit 31 set (privileged)";
    if (a.mtu < 1 || a.mtu > 5) return "MTU code " + std::to_string(a.mtu) + " is not 1..5 (256..4096 bytes)";
    if (a.flags & ~kKnownFlags) return "unknown flag bits " + std::to_string(a.flags & ~kKnownFlags);
    if (a.roce_v2() && !a.ethernet()) return "a RoCE v2 GID on a port that is not Ethernet";
    return {};
}

inline std::string encode_address(const Address& a) {
    std::string why = address_problem(a);
    if (!why.empty()) throw std::invalid_argument("cannot encode a verbs address: " + why);
    uint8_t b[kAddressBytes] = {};
    b[0] = static_cast<uint8_t>(kAddressMagic[0]);
    b[1] = static_cast<uint8_t>(kAddressMagic[1]);
    b[2] = kAddressVersion;
    b[3] = a.flags;
    std::memcpy(b + 4, a.gid.data(), 16);
    put16(b + 20, a.lid);
    b[22] = a.port;
    b[23] = a.gid_index;
    put32(b + 24, a.ud_qpn);
    put32(b + 28, a.qkey);
    b[32] = a.mtu;
    put32(b + 36, crc32(b, 36));
    return std::string(reinterpret_cast<const char*>(b), kAddressBytes);
}

// Throws std::invalid_argument (ValueError in Python) with the reason for anything that is
// not an address this version encoded.
inline Address decode_address(std::string_view raw) {
    auto bad = [](const std::string& why) { return std::invalid_argument("not a fabric-verbs address: " + why); };
    if (raw.size() != kAddressBytes)
        throw bad(std::to_string(raw.size()) + " bytes, expected " + std::to_string(kAddressBytes));
    const auto* b = reinterpret_cast<const uint8_t*>(raw.data());
    if (b[0] != uint8_t(kAddressMagic[0]) || b[1] != uint8_t(kAddressMagic[1]))
        throw bad("wrong magic (another backend's address?)");
    if (b[2] != kAddressVersion) {
        throw bad("version " + std::to_string(b[2]) + (b[2] > kAddressVersion ? " is newer than" : " is not") +
                  " the version this fabric-verbs reads (" + std::to_string(kAddressVersion) + ")");
    }
    if (get32(b + 36) != crc32(b, 36)) throw bad("checksum mismatch (corrupted or truncated)");
    if (b[33] || b[34] || b[35]) throw bad("reserved bytes are not zero");
    Address a;
    a.flags = b[3];
    std::memcpy(a.gid.data(), b + 4, 16);
    a.lid = get16(b + 20);
    a.port = b[22];
    a.gid_index = b[23];
    a.ud_qpn = get32(b + 24);
    a.qkey = get32(b + 28);
    a.mtu = b[32];
    std::string why = address_problem(a);
    if (!why.empty()) throw bad(why);
    return a;
}

// "fe80::1" style text of a GID (for logs, fabric info and errors).
inline std::string gid_text(const std::array<uint8_t, 16>& g) {
    // IPv4-mapped (::ffff:a.b.c.d): how RoCE v2 GIDs of IPv4 interfaces look
    bool v4 = true;
    for (int i = 0; i < 10; i++) v4 &= g[i] == 0;
    v4 &= g[10] == 0xff && g[11] == 0xff;
    if (v4) {
        return "::ffff:" + std::to_string(g[12]) + "." + std::to_string(g[13]) + "." + std::to_string(g[14]) + "." +
               std::to_string(g[15]);
    }
    static const char* hex = "0123456789abcdef";
    std::string out;
    for (int i = 0; i < 16; i += 2) {
        if (i) out += ':';
        uint16_t w = static_cast<uint16_t>((g[i] << 8) | g[i + 1]);
        bool started = false;
        for (int s = 12; s >= 0; s -= 4) {
            int d = (w >> s) & 0xF;
            if (d || started || s == 0) {
                out += hex[d];
                started = true;
            }
        }
    }
    return out;
}

}  // namespace fabric::verbs
