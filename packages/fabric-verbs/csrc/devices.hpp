// RDMA devices as libibverbs and sysfs describe them: ports, GID tables (with their RoCE
// type), link speed, NUMA node and PCI address. The choice of port and GID index lives here:
// configured, or by default the first ACTIVE port and its RoCE v2 GID (IPv4-mapped first),
// never a hard-coded port 1 / GID index 0.
#pragma once

#include <dirent.h>
#include <endian.h>
#include <infiniband/verbs.h>
#include <limits.h>
#include <net/if.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "address.hpp"

namespace fabric::verbs {

class VerbsError : public std::runtime_error {
  public:
    VerbsError(const std::string& what, int err)
        : std::runtime_error(what + ": " + std::strerror(err < 0 ? -err : err) + " (errno " +
                             std::to_string(err < 0 ? -err : err) + ")"),
          err_(err < 0 ? -err : err) {}
    int err() const { return err_; }

  private:
    int err_;
};

enum GidType : int { kGidIb = 0, kGidRoceV1 = 1, kGidRoceV2 = 2 };

inline const char* gid_type_name(int t) {
    switch (t) {
        case kGidIb:
            return "IB";
        case kGidRoceV1:
            return "RoCE v1";
        case kGidRoceV2:
            return "RoCE v2";
    }
    return "unknown";
}

struct GidInfo {
    uint32_t index = 0;
    std::array<uint8_t, 16> gid{};
    int type = kGidIb;
    std::string netdev;  // the interface a RoCE GID belongs to
};

struct PortInfo {
    uint8_t port = 0;
    int state = 0;  // enum ibv_port_state
    int link_layer = IBV_LINK_LAYER_UNSPECIFIED;
    uint8_t active_mtu = 0;  // enum ibv_mtu
    uint32_t max_msg_sz = 0;
    uint16_t lid = 0;
    double speed_gbps = 0;
    int lanes = 0;
    std::vector<GidInfo> gids;
    bool ethernet() const { return link_layer == IBV_LINK_LAYER_ETHERNET; }
};

struct DeviceInfo {
    std::string name;
    std::string node_guid;
    std::string fw_ver;
    uint32_t vendor_id = 0;
    uint32_t vendor_part_id = 0;
    int numa_node = -1;
    std::string pci;
    std::string sysfs;
    int max_qp = 0, max_qp_wr = 0, max_srq_wr = 0, max_cqe = 0;
    std::vector<PortInfo> ports;
    std::string error;  // set when the device could not be opened or queried
};

inline const char* port_state_name(int s) {
    switch (s) {
        case IBV_PORT_DOWN:
            return "DOWN";
        case IBV_PORT_INIT:
            return "INIT";
        case IBV_PORT_ARMED:
            return "ARMED";
        case IBV_PORT_ACTIVE:
            return "ACTIVE";
        case IBV_PORT_ACTIVE_DEFER:
            return "ACTIVE_DEFER";
        default:
            return "NOP";
    }
}

inline uint32_t mtu_bytes(uint8_t mtu) { return mtu >= 1 && mtu <= 5 ? 128u << mtu : 0; }

// Per-lane data rate (Gbit/s) of ibv_port_attr.active_speed, lanes of active_width.
inline double lane_gbps(uint8_t speed) {
    switch (speed) {
        case 1:
            return 2.5;  // SDR
        case 2:
            return 5;  // DDR
        case 4:
        case 8:
            return 10;  // QDR, FDR10
        case 16:
            return 14;  // FDR
        case 32:
            return 25;  // EDR
        case 64:
            return 50;  // HDR
        case 128:
            return 100;  // NDR
        default:
            return 0;
    }
}
inline int width_lanes(uint8_t width) {
    switch (width) {
        case 1:
            return 1;
        case 2:
            return 4;
        case 4:
            return 8;
        case 8:
            return 12;
        case 16:
            return 2;
        default:
            return 0;
    }
}

inline std::string read_line(const std::string& path) {
    std::ifstream f(path);
    std::string s;
    if (f) std::getline(f, s);
    return s;
}

// /sys/class/infiniband/<dev>/device: NUMA node and PCI address of the function behind it.
inline void sysfs_location(const std::string& sysfs, int& numa, std::string& pci) {
    std::string n = read_line(sysfs + "/device/numa_node");
    numa = n.empty() ? -1 : std::atoi(n.c_str());
    char real[PATH_MAX];
    if (realpath((sysfs + "/device").c_str(), real)) {
        std::string r(real);
        pci = r.substr(r.find_last_of('/') + 1);
    }
}

inline std::string guid_text(__be64 guid) {
    uint64_t g = be64toh(guid);
    char buf[24];
    std::snprintf(buf, sizeof(buf), "%04x:%04x:%04x:%04x", unsigned((g >> 48) & 0xffff), unsigned((g >> 32) & 0xffff),
                  unsigned((g >> 16) & 0xffff), unsigned(g & 0xffff));
    return buf;
}

inline std::vector<GidInfo> query_gids(ibv_context* ctx, uint8_t port, int table_len) {
    std::vector<GidInfo> out;
    if (table_len <= 0) return out;
    for (int i = 0; i < table_len; i++) {
        ibv_gid_entry e{};
        if (ibv_query_gid_ex(ctx, port, static_cast<uint32_t>(i), &e, 0) != 0) continue;  // an empty slot
        GidInfo g;
        g.index = e.gid_index;
        std::memcpy(g.gid.data(), e.gid.raw, 16);
        bool zero = std::all_of(g.gid.begin(), g.gid.end(), [](uint8_t b) { return b == 0; });
        if (zero) continue;
        g.type = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? kGidRoceV2 : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? kGidRoceV1 : kGidIb;
        char name[IF_NAMESIZE + 1] = {};
        if (e.ndev_ifindex && if_indextoname(e.ndev_ifindex, name)) g.netdev = name;
        out.push_back(g);
    }
    return out;
}

inline PortInfo query_port(ibv_context* ctx, uint8_t port) {
    ibv_port_attr a{};
    int rc = ibv_query_port(ctx, port, &a);
    if (rc != 0) throw VerbsError("ibv_query_port(" + std::to_string(port) + ")", rc);
    PortInfo p;
    p.port = port;
    p.state = a.state;
    p.link_layer = a.link_layer;
    p.active_mtu = static_cast<uint8_t>(a.active_mtu);
    p.max_msg_sz = a.max_msg_sz;
    p.lid = a.lid;
    p.lanes = width_lanes(a.active_width);
    p.speed_gbps = p.lanes * lane_gbps(a.active_speed);
    p.gids = query_gids(ctx, port, a.gid_tbl_len);
    return p;
}

inline DeviceInfo describe(ibv_device* dev) {
    DeviceInfo d;
    d.name = ibv_get_device_name(dev);
    d.sysfs = dev->ibdev_path;
    d.node_guid = guid_text(ibv_get_device_guid(dev));
    sysfs_location(d.sysfs, d.numa_node, d.pci);
    ibv_context* ctx = ibv_open_device(dev);
    if (!ctx) {
        int err = errno ? errno : ENODEV;
        d.error = std::string("cannot open it: ") + std::strerror(err) +
                  (err == EACCES || err == EPERM || err == ENOENT
                       ? " (/dev/infiniband/uverbs* must be readable and writable; in a container pass "
                         "--device=/dev/infiniband)"
                       : "");
        return d;
    }
    ibv_device_attr a{};
    int rc = ibv_query_device(ctx, &a);
    if (rc != 0) {
        d.error = std::string("ibv_query_device: ") + std::strerror(rc);
    } else {
        d.fw_ver = a.fw_ver;
        d.vendor_id = a.vendor_id;
        d.vendor_part_id = a.vendor_part_id;
        d.max_qp = a.max_qp;
        d.max_qp_wr = a.max_qp_wr;
        d.max_srq_wr = a.max_srq_wr;
        d.max_cqe = a.max_cqe;
        try {
            for (uint8_t p = 1; p <= a.phys_port_cnt; p++) d.ports.push_back(query_port(ctx, p));
        } catch (const std::exception& e) {
            d.error = e.what();
        }
    }
    ibv_close_device(ctx);
    return d;
}

struct DeviceList {
    ibv_device** list = nullptr;
    int count = 0;
    int err = 0;
    DeviceList() {
        errno = 0;
        list = ibv_get_device_list(&count);
        if (!list) {
            err = errno ? errno : ENODEV;
            count = 0;
        }
    }
    ~DeviceList() {
        if (list) ibv_free_device_list(list);
    }
    DeviceList(const DeviceList&) = delete;
    DeviceList& operator=(const DeviceList&) = delete;
    ibv_device* find(const std::string& name) const {
        for (int i = 0; i < count; i++)
            if (name == ibv_get_device_name(list[i])) return list[i];
        return nullptr;
    }
    std::vector<std::string> names() const {
        std::vector<std::string> out;
        for (int i = 0; i < count; i++) out.emplace_back(ibv_get_device_name(list[i]));
        std::sort(out.begin(), out.end());
        return out;
    }
};

inline std::vector<DeviceInfo> list_devices() {
    DeviceList l;
    std::vector<DeviceInfo> out;
    for (const auto& name : l.names()) out.push_back(describe(l.find(name)));
    return out;
}

// Names of the RDMA devices the kernel knows (sysfs), whether libibverbs can open them or not.
inline std::vector<std::string> kernel_devices(const std::string& root = "/sys/class/infiniband") {
    std::vector<std::string> out;
    std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(root.c_str()), closedir);
    if (!dir) return out;
    while (dirent* e = readdir(dir.get())) {
        if (e->d_name[0] != '.') out.emplace_back(e->d_name);
    }
    std::sort(out.begin(), out.end());
    return out;
}

inline std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
    std::string s;
    for (size_t i = 0; i < v.size(); i++) s += (i ? sep : "") + v[i];
    return s;
}

constexpr const char* kNoDevice =
    "no RDMA device found (ibv_get_device_list returned none); on a host without an RDMA NIC, Soft-RoCE: "
    "sudo rdma link add rxe0 type rxe netdev eth0";

// The port to use on ``d``: ``requested`` (>= 1) if it exists and is ACTIVE, else (0) the
// first ACTIVE port. Throws with the ports' states otherwise.
inline const PortInfo& choose_port(const DeviceInfo& d, int requested) {
    std::string states;
    for (const auto& p : d.ports) {
        states += (states.empty() ? "" : ", ") + std::string("port ") + std::to_string(p.port) + " " +
                  port_state_name(p.state);
        if (requested > 0 && p.port != requested) continue;
        if (p.state == IBV_PORT_ACTIVE || p.state == IBV_PORT_ACTIVE_DEFER) return p;
        if (requested > 0) break;
    }
    if (requested > 0 && std::none_of(d.ports.begin(), d.ports.end(), [&](const PortInfo& p) { return p.port == requested; }))
        throw std::runtime_error(d.name + " has no port " + std::to_string(requested) + " (FABRIC_VERBS_PORT; it has " +
                                 std::to_string(d.ports.size()) + ")");
    throw std::runtime_error(d.name + ": no ACTIVE port" + (requested > 0 ? " " + std::to_string(requested) : "") +
                             " (" + (states.empty() ? "no ports" : states) +
                             "); bring the link up (for Soft-RoCE, the netdev under it: ip link set <if> up)");
}

inline bool ipv4_mapped(const std::array<uint8_t, 16>& g) {
    for (int i = 0; i < 10; i++)
        if (g[i]) return false;
    return g[10] == 0xff && g[11] == 0xff;
}
inline bool link_local(const std::array<uint8_t, 16>& g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

// The GID to use on port ``p``: ``requested`` (>= 0) if valid; by default on RoCE the first
// RoCE v2 GID of an IPv4 address, then any routable RoCE v2 GID, then any RoCE v2, then RoCE
// v1; on InfiniBand the first GID (the port GID).
inline const GidInfo& choose_gid(const std::string& device, const PortInfo& p, int requested) {
    auto describe_table = [&] {
        std::string s;
        for (const auto& g : p.gids)
            s += (s.empty() ? "" : "; ") + std::to_string(g.index) + " " + gid_text(g.gid) + " (" +
                 gid_type_name(g.type) + ")";
        return s.empty() ? std::string("the table is empty") : "valid: " + s;
    };
    if (requested >= 0) {
        for (const auto& g : p.gids)
            if (g.index == uint32_t(requested)) return g;
        throw std::runtime_error("GID index " + std::to_string(requested) + " is not valid on " + device + " port " +
                                 std::to_string(p.port) + " (FABRIC_VERBS_GID_INDEX; " + describe_table() + ")");
    }
    if (p.gids.empty())
        throw std::runtime_error(device + " port " + std::to_string(p.port) +
                                 " has no GID (on RoCE: give the netdev an IP address)");
    if (!p.ethernet()) return p.gids.front();
    auto pick = [&](auto pred) -> const GidInfo* {
        for (const auto& g : p.gids)
            if (pred(g)) return &g;
        return nullptr;
    };
    for (auto* g : {pick([](const GidInfo& g) { return g.type == kGidRoceV2 && ipv4_mapped(g.gid); }),
                    pick([](const GidInfo& g) { return g.type == kGidRoceV2 && !link_local(g.gid); }),
                    pick([](const GidInfo& g) { return g.type == kGidRoceV2; }),
                    pick([](const GidInfo& g) { return g.type == kGidRoceV1; })}) {
        if (g) return *g;
    }
    return p.gids.front();
}

// None when the backend can run with these devices (all when ``wanted`` is empty), else why not.
inline std::optional<std::string> probe(const std::vector<std::string>& wanted, int port) {
    DeviceList l;
    if (l.err == ENOSYS) {  // no uverbs ABI in sysfs: no RDMA stack loaded, so no device either
        return std::string(kNoDevice) +
               ". The kernel has no RDMA support loaded (ibv_get_device_list: " + std::strerror(l.err) +
               "): sudo modprobe ib_uverbs (and for Soft-RoCE: sudo modprobe rdma_rxe)";
    }
    if (l.err) return std::string("libibverbs cannot list RDMA devices: ") + std::strerror(l.err);
    if (l.count == 0) {
        std::string reason = kNoDevice;
        auto kernel = kernel_devices();
        if (!kernel.empty())
            reason += "; the kernel has RDMA devices (" + join(kernel) +
                      ") but libibverbs has no provider library for them: sudo apt-get install ibverbs-providers";
        return reason;
    }
    std::vector<std::string> names = wanted.empty() ? l.names() : wanted;
    std::vector<std::string> problems;
    int usable = 0;
    for (const auto& name : names) {
        ibv_device* dev = l.find(name);
        if (!dev) {
            problems.push_back("no RDMA device named '" + name + "' (FABRIC_VERBS_DEVICE; present: " + join(l.names()) +
                               ")");
            continue;
        }
        DeviceInfo d = describe(dev);
        if (!d.error.empty()) {
            problems.push_back(name + ": " + d.error);
            continue;
        }
        try {
            choose_port(d, port);
            usable++;
        } catch (const std::exception& e) {
            problems.push_back(e.what());
        }
    }
    if (!wanted.empty() && !problems.empty()) return join(problems, "; ");
    if (usable == 0) return join(problems, "; ");
    return std::nullopt;
}

}  // namespace fabric::verbs
