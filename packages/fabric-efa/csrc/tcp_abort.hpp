// Aborting the kernel TCP connections that tcp;ofi_rxm holds to one peer address.
//
// Why: libfabric 1.17's tcp provider keeps an established connection, and the writes queued
// on it, for as long as TCP retransmits (minutes) when a link goes down in silence. Nothing in
// the libfabric API makes it give them up short of closing the endpoint (every peer's
// connections with it). A connection reset does: the provider fails the writes it holds for
// that connection, and rxm fails those waiting for a connection that cannot come up. So the
// engine, once it has taken a path for lost in silence, resets that path's connections from
// outside libfabric, as the network would have had it said anything.
//
// How: the process's TCP sockets are listed from /proc/self/net/tcp{,6} (addresses, state and
// inode, connecting sockets included, which getpeername cannot name) and matched against the
// two endpoints' addresses (each its listening ip:port, as libfabric names it): a connection
// this side opened goes from this endpoint's ip to the peer's ip and port, one the peer
// opened from the peer's ip to this endpoint's ip and port. Those found among the process's
// descriptors by inode are reset with connect(AF_UNSPEC): Linux's tcp_disconnect, which
// purges the socket's send and retransmit queues (nothing of them can reach the peer
// afterwards) and sends a reset; then shutdown() marks the (now closed) socket read-shut,
// which sends nothing, so that the provider, polling it, reads end-of-stream and fails what
// it holds for the connection, the writes that wait on the peer's acknowledgement included.
//
// Matched beyond the path: where this side opened no connection to the peer, those opened to
// this endpoint from the peer's ip are all taken for the peer's (a source port cannot be told
// from that of another process of that host), and another engine of this process on the same
// ip with a connection to the same peer endpoint is matched too. Their writes on it fail with
// a reset, and are retried and reconciled as after any NIC failure
// (docs/concepts/failures.md).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

namespace fabric::efa::tcp_abort {

// An address as /proc/net/tcp{,6} prints it: the raw 32-bit words of the ip as stored in
// memory (%08X of each), and the port in host order.
struct Endpoint {
    bool v6 = false;
    uint32_t words[4] = {0, 0, 0, 0};
    uint16_t port = 0;

    bool same_ip(const Endpoint& o) const {
        return v6 == o.v6 && std::memcmp(words, o.words, sizeof(words)) == 0;
    }
};

// Parses a libfabric FI_SOCKADDR_IN / FI_SOCKADDR_IN6 address (what tcp;ofi_rxm's
// fi_getname gives); false for anything else.
inline bool from_sockaddr(const std::string& raw, Endpoint& out) {
    if (raw.size() >= sizeof(sockaddr_in) && reinterpret_cast<const sockaddr*>(raw.data())->sa_family == AF_INET) {
        sockaddr_in sin;
        std::memcpy(&sin, raw.data(), sizeof(sin));
        out = Endpoint{};
        std::memcpy(&out.words[0], &sin.sin_addr, 4);
        out.port = ntohs(sin.sin_port);
        return true;
    }
    if (raw.size() >= sizeof(sockaddr_in6) && reinterpret_cast<const sockaddr*>(raw.data())->sa_family == AF_INET6) {
        sockaddr_in6 sin6;
        std::memcpy(&sin6, raw.data(), sizeof(sin6));
        out = Endpoint{};
        out.v6 = true;
        std::memcpy(out.words, &sin6.sin6_addr, 16);
        out.port = ntohs(sin6.sin6_port);
        return true;
    }
    return false;
}

// "0100007F:1F90" (or 32 hex digits for v6) -> Endpoint.
inline bool parse_proc(const char* text, bool v6, Endpoint& out) {
    const char* colon = std::strchr(text, ':');
    size_t digits = v6 ? 32 : 8;
    if (colon == nullptr || size_t(colon - text) != digits) return false;
    out = Endpoint{};
    out.v6 = v6;
    for (size_t w = 0; w < digits / 8; w++) {
        char word[9];
        std::memcpy(word, text + 8 * w, 8);
        word[8] = '\0';
        out.words[w] = static_cast<uint32_t>(std::strtoul(word, nullptr, 16));
    }
    out.port = static_cast<uint16_t>(std::strtoul(colon + 1, nullptr, 16));
    return true;
}

// Inodes of this network namespace's TCP sockets, not listening, between ``local`` and
// ``peer``: from local's ip (any port) to exactly peer's ip and port (the connections this
// side opened); where there is none, from peer's ip (any port) to exactly local's ip and port
// (those opened to this endpoint's listening port from the peer's host). rxm keeps one
// connection per pair of endpoints, so one this side opened is the path's, and those opened
// to it from the peer's ip, which may be other processes', are left alone.
inline std::set<unsigned long> inodes_between(const Endpoint& local, const Endpoint& peer) {
    std::set<unsigned long> out, accepted;
    const char* path = peer.v6 ? "/proc/self/net/tcp6" : "/proc/self/net/tcp";
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) return out;
    char line[512];
    if (std::fgets(line, sizeof(line), f) == nullptr) {  // the header
        std::fclose(f);
        return out;
    }
    while (std::fgets(line, sizeof(line), f) != nullptr) {
        char here[64], there[64];
        unsigned state = 0;
        unsigned long inode = 0;
        // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
        if (std::sscanf(line, " %*s %63s %63s %x %*s %*s %*s %*s %*s %lu", here, there, &state, &inode) != 4)
            continue;
        if (state == 0x0A || inode == 0) continue;  // listening, or gone (TIME_WAIT)
        Endpoint l, r;
        if (!parse_proc(here, peer.v6, l) || !parse_proc(there, peer.v6, r)) continue;
        if (l.same_ip(local) && r.same_ip(peer) && r.port == peer.port) {
            out.insert(inode);
        } else if (l.same_ip(local) && l.port == local.port && r.same_ip(peer)) {
            accepted.insert(inode);
        }
    }
    std::fclose(f);
    return out.empty() ? accepted : out;
}

// Resets every connection of this process between ``local`` (this endpoint's address) and
// ``peer`` (the peer endpoint's), as inodes_between matches them. Returns how many.
inline size_t abort_connections(const std::string& local, const std::string& peer) {
    Endpoint l, r;
    if (!from_sockaddr(local, l) || !from_sockaddr(peer, r) || l.v6 != r.v6) return 0;
    std::set<unsigned long> inodes = inodes_between(l, r);
    if (inodes.empty()) return 0;
    size_t aborted = 0;
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    while (dirent* e = readdir(dir)) {
        char* end = nullptr;
        long fd = std::strtol(e->d_name, &end, 10);
        if (end == e->d_name || *end != '\0' || fd < 0) continue;
        struct stat st;
        if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
        if (inodes.count(static_cast<unsigned long>(st.st_ino)) == 0) continue;
        sockaddr unspec{};
        unspec.sa_family = AF_UNSPEC;
        if (connect(static_cast<int>(fd), &unspec, sizeof(unspec)) != 0) continue;
        // The reset socket is closed, and its owner sees that only when it next sends on it:
        // writes it has sent and waits on the peer's acknowledgement for would wait for good.
        // A shutdown marks it read-shut (on a closed socket it sends nothing and returns
        // ENOTCONN), so polling reports it readable, and the read meets end-of-stream.
        shutdown(static_cast<int>(fd), SHUT_RDWR);
        aborted++;
    }
    closedir(dir);
    return aborted;
}

}  // namespace fabric::efa::tcp_abort
