// fabric_verbs._verbs: the libibverbs backend's compiled module.
//
// The engine binding is fabric-core's (fabric/pyengine.hpp), shared with every compiled
// backend; what is verbs' is here: opening one VerbsDomain per NIC (verbs_domain.hpp), the
// devices' details, the probe, and bindings of the parts that need no device (the address
// encoding, the handshake state machine, the work-request chain builder) for the tests.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fabric/pyengine.hpp>

#include "address.hpp"
#include "devices.hpp"
#include "handshake.hpp"
#include "verbs_domain.hpp"
#include "wr_chain.hpp"

namespace py = pybind11;
using namespace fabric::verbs;

namespace {

py::bytes as_bytes(const std::array<uint8_t, 16>& a) {
    return py::bytes(reinterpret_cast<const char*>(a.data()), a.size());
}

std::array<uint8_t, 16> gid_of(const py::bytes& b) {
    std::string s = b;
    if (s.size() != 16) throw std::invalid_argument("a GID is 16 bytes, got " + std::to_string(s.size()));
    std::array<uint8_t, 16> g{};
    std::memcpy(g.data(), s.data(), 16);
    return g;
}

const char* link_layer_name(int ll) {
    switch (ll) {
        case IBV_LINK_LAYER_ETHERNET:
            return "Ethernet";
        case IBV_LINK_LAYER_INFINIBAND:
            return "InfiniBand";
        default:
            return "unspecified";
    }
}

// --- engine -------------------------------------------------------------------------------

template <class T>
T option(const py::dict& d, const char* key, T fallback, T lo, T hi) {
    if (!d.contains(key)) return fallback;
    T v = d[key].cast<T>();
    if (v < lo || v > hi) {
        throw std::invalid_argument(std::string("verbs option ") + key + " = " + std::to_string(v) + " is out of range [" +
                                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return v;
}

DomainConfig config_from(const py::dict& o) {
    static const char* known[] = {"port",          "gid_index",      "sq_depth",          "imm_depth",
                                  "cq_depth",      "chain_max",      "signal_every",      "traffic_class",
                                  "service_level", "hop_limit",      "timeout",           "retry_cnt",
                                  "rnr_retry",     "min_rnr_timer",  "connect_timeout_s", "retry_initial_s",
                                  "retry_max_s",   "fail_hold_s"};
    for (auto item : o) {
        std::string k = py::str(item.first);
        if (std::find_if(std::begin(known), std::end(known), [&](const char* n) { return k == n; }) == std::end(known))
            throw std::invalid_argument("unknown verbs option '" + k + "'");
    }
    DomainConfig c;
    c.port = option<int>(o, "port", 0, 0, 255);
    c.gid_index = option<int>(o, "gid_index", -1, -1, 255);
    c.sq_depth = option<uint32_t>(o, "sq_depth", c.sq_depth, 16, 1u << 20);
    c.imm_depth = option<uint32_t>(o, "imm_depth", c.imm_depth, 16, 1u << 22);
    c.cq_depth = option<uint32_t>(o, "cq_depth", c.cq_depth, 256, 1u << 24);
    c.chain_max = option<uint32_t>(o, "chain_max", c.chain_max, 1, VerbsDomain::kMaxChain);
    c.signal_every = option<uint32_t>(o, "signal_every", c.signal_every, 1, 1u << 20);
    c.traffic_class = static_cast<uint8_t>(option<int>(o, "traffic_class", 0, 0, 255));
    c.service_level = static_cast<uint8_t>(option<int>(o, "service_level", 0, 0, 15));
    c.hop_limit = static_cast<uint8_t>(option<int>(o, "hop_limit", 64, 1, 255));
    c.timeout = static_cast<uint8_t>(option<int>(o, "timeout", 14, 0, 31));
    c.retry_cnt = static_cast<uint8_t>(option<int>(o, "retry_cnt", 7, 0, 7));
    c.rnr_retry = static_cast<uint8_t>(option<int>(o, "rnr_retry", 7, 0, 7));
    c.min_rnr_timer = static_cast<uint8_t>(option<int>(o, "min_rnr_timer", 1, 0, 31));
    c.timing.timeout_s = option<double>(o, "connect_timeout_s", c.timing.timeout_s, 1e-3, 3600);
    c.timing.retry_initial_s = option<double>(o, "retry_initial_s", c.timing.retry_initial_s, 1e-5, 60);
    c.timing.retry_max_s = option<double>(o, "retry_max_s", c.timing.retry_max_s, 1e-5, 600);
    c.fail_hold_s = option<double>(o, "fail_hold_s", c.fail_hold_s, 0, 3600);
    return c;
}

py::dict stats_dict(const DomainStats& s) {
    py::dict d;
    d["peers"] = s.peers;
    d["handshakes"] = s.handshakes;
    d["connected"] = s.connected;
    d["handshake_failures"] = s.handshake_failures;
    d["qp_errors"] = s.qp_errors;
    d["wrs_posted"] = s.wrs_posted;
    d["wrs_signaled"] = s.wrs_signaled;
    d["doorbells"] = s.doorbells;
    d["ud_sent"] = s.ud_sent;
    d["ud_received"] = s.ud_received;
    d["ud_dropped"] = s.ud_dropped;
    d["ud_garbage"] = s.ud_garbage;
    d["imm_low_water"] = s.imm_low_water;
    d["dmabuf_registrations"] = s.dmabuf_registrations;
    d["peer_memory_registrations"] = s.peer_memory_registrations;
    return d;
}

// The verbs engine: one VerbsDomain per NIC of the group; NIC i on devices[i % len(devices)]
// (several domains share a device where there are fewer devices than NICs, e.g. Soft-RoCE).
class VerbsEngine : public fabric::PyEngine<VerbsDomain> {
  public:
    VerbsEngine(const std::vector<std::string>& devices, int nics, std::optional<uint64_t> chaos_seed, int cpu,
                size_t recv_depth, size_t max_send, const py::dict& options)
        : PyEngine(open(devices, nics, recv_depth, config_from(options)), chaos_seed, cpu, recv_depth, max_send) {
        for (int i = 0; i < nics; i++) {
            VerbsDomain& d = engine().nic(static_cast<size_t>(i));
            py::dict info;
            info["device"] = d.device().name;
            info["port"] = d.port().port;
            info["link_layer"] = link_layer_name(d.port().link_layer);
            info["gid_index"] = d.gid().index;
            info["gid"] = gid_text(d.gid().gid);
            info["gid_type"] = gid_type_name(d.gid().type);
            info["netdev"] = d.gid().netdev;
            info["lid"] = d.port().lid;
            info["mtu"] = mtu_bytes(d.port().active_mtu);
            info["max_msg_sz"] = d.port().max_msg_sz;
            info["max_wr_bytes"] = d.max_wr();
            info["speed_gbps"] = d.port().speed_gbps;
            info["lanes"] = d.port().lanes;
            info["numa_node"] = d.device().numa_node;
            info["pci"] = d.device().pci;
            info["fw_ver"] = d.device().fw_ver;
            info["sq_depth"] = d.sq_depth();
            info["imm_depth"] = d.imm_depth();
            infos_.append(info);
        }
    }

    py::list domain_info() const { return infos_; }

    py::list domain_stats() {
        if (destroyed_) return final_stats_;
        py::list out;
        for (size_t i = 0; i < engine().num_nics(); i++) out.append(stats_dict(engine().nic(i).stats()));
        return out;
    }

    void destroy() {
        if (!destroyed_) {
            final_stats_ = domain_stats();
            destroyed_ = true;
        }
        PyEngine::destroy();
    }

  private:
    static std::vector<std::unique_ptr<VerbsDomain>> open(const std::vector<std::string>& devices, int nics,
                                                          size_t recv_depth, DomainConfig cfg) {
        if (devices.empty()) throw std::invalid_argument("no RDMA device to open");
        if (nics < 1) throw std::invalid_argument("nics must be at least 1");
        std::vector<std::unique_ptr<VerbsDomain>> domains;
        py::gil_scoped_release release;  // opening devices takes a while; other threads may run
        for (int i = 0; i < nics; i++) {
            DomainConfig c = cfg;
            c.device = devices[static_cast<size_t>(i) % devices.size()];
            c.control = i == 0;
            c.recv_depth = static_cast<uint32_t>(recv_depth);
            domains.push_back(std::make_unique<VerbsDomain>(c));
        }
        return domains;
    }

    py::list infos_;
    py::list final_stats_;
    bool destroyed_ = false;
};

// --- devices ------------------------------------------------------------------------------

py::list devices_list() {
    py::list out;
    for (const auto& d : list_devices()) {
        py::dict dev;
        dev["name"] = d.name;
        dev["node_guid"] = d.node_guid;
        dev["fw_ver"] = d.fw_ver;
        dev["vendor_id"] = d.vendor_id;
        dev["vendor_part_id"] = d.vendor_part_id;
        dev["numa_node"] = d.numa_node;
        dev["pci"] = d.pci;
        dev["sysfs"] = d.sysfs;
        dev["max_qp"] = d.max_qp;
        dev["max_qp_wr"] = d.max_qp_wr;
        dev["max_srq_wr"] = d.max_srq_wr;
        dev["max_cqe"] = d.max_cqe;
        dev["error"] = d.error;
        py::list ports;
        for (const auto& p : d.ports) {
            py::dict port;
            port["port"] = p.port;
            port["state"] = port_state_name(p.state);
            port["link_layer"] = link_layer_name(p.link_layer);
            port["mtu"] = mtu_bytes(p.active_mtu);
            port["max_msg_sz"] = p.max_msg_sz;
            port["lid"] = p.lid;
            port["speed_gbps"] = p.speed_gbps;
            port["lanes"] = p.lanes;
            py::list gids;
            for (const auto& g : p.gids) {
                py::dict gd;
                gd["index"] = g.index;
                gd["gid"] = gid_text(g.gid);
                gd["type"] = gid_type_name(g.type);
                gd["netdev"] = g.netdev;
                gids.append(gd);
            }
            port["gids"] = gids;
            ports.append(port);
        }
        dev["ports"] = ports;
        out.append(dev);
    }
    return out;
}

// The port and GID a domain on ``device`` would use with these settings.
py::dict select_port(const std::string& device, int port, int gid_index) {
    DeviceList l;
    ibv_device* dev = l.find(device);
    if (!dev) throw std::runtime_error("no RDMA device named '" + device + "'");
    DeviceInfo d = describe(dev);
    if (!d.error.empty()) throw std::runtime_error(device + ": " + d.error);
    const PortInfo& p = choose_port(d, port);
    const GidInfo& g = choose_gid(d.name, p, gid_index);
    py::dict out;
    out["port"] = p.port;
    out["gid_index"] = g.index;
    out["gid"] = gid_text(g.gid);
    out["gid_type"] = gid_type_name(g.type);
    out["max_wr_bytes"] = max_wr_bytes(p.max_msg_sz, 0);
    return out;
}

// --- testing bindings ---------------------------------------------------------------------

py::dict params_dict(const QpParams& p) {
    py::dict d;
    d["qpn"] = p.qpn;
    d["ctrl_qpn"] = p.ctrl_qpn;
    d["psn"] = p.psn;
    d["gid"] = as_bytes(p.gid);
    d["lid"] = p.lid;
    d["mtu"] = p.mtu;
    return d;
}

QpParams params_of(const py::dict& d) {
    QpParams p;
    p.qpn = d["qpn"].cast<uint32_t>();
    p.ctrl_qpn = d["ctrl_qpn"].cast<uint32_t>();
    p.psn = d["psn"].cast<uint32_t>();
    p.gid = gid_of(d["gid"].cast<py::bytes>());
    p.lid = d["lid"].cast<uint16_t>();
    p.mtu = d["mtu"].cast<uint8_t>();
    return p;
}

MsgType type_of(const std::string& t) {
    if (t == "REQ") return MsgType::kReq;
    if (t == "REP") return MsgType::kRep;
    if (t == "ACK") return MsgType::kAck;
    throw std::invalid_argument("handshake message type must be REQ, REP or ACK, got '" + t + "'");
}

// A host for the machine that makes up queue pairs and records what it was asked to do.
class FakeHost final : public HandshakeHost {
  public:
    FakeHost(uint64_t seed, const std::string& local) : rng_(seed) {
        Address a = decode_address(local);
        gid_ = a.gid;
        lid_ = a.lid;
        mtu_ = a.mtu;
    }
    QpParams open_qp(uint32_t epoch) override {
        QpParams p;
        p.qpn = 2 + static_cast<uint32_t>(rng_() % ((1u << 24) - 2));
        p.ctrl_qpn = 2 + static_cast<uint32_t>(rng_() % ((1u << 24) - 2));
        p.psn = static_cast<uint32_t>(rng_()) & 0xffffff;
        p.gid = gid_;
        p.lid = lid_;
        p.mtu = mtu_;
        events.push_back("open_qp " + std::to_string(epoch));
        return p;
    }
    bool connect_qp(const QpParams& remote, std::string& why) override {
        if (fail_connect) {
            why = "connect refused (injected)";
            return false;
        }
        events.push_back("connect " + std::to_string(remote.qpn));
        return true;
    }
    void teardown(const std::string& why) override { events.push_back("teardown: " + why); }
    void send(const std::string& bytes) override { outbox.push_back(bytes); }
    void connected() override { events.push_back("connected"); }
    void failed(const std::string& why) override { events.push_back("failed: " + why); }

    std::vector<std::string> outbox;
    std::vector<std::string> events;
    bool fail_connect = false;

  private:
    std::mt19937_64 rng_;
    std::array<uint8_t, 16> gid_{};
    uint16_t lid_ = 0;
    uint8_t mtu_ = 3;
};

class PyHandshake {
  public:
    PyHandshake(const py::bytes& local, const py::bytes& peer, uint64_t seed, double retry_initial_s,
                double retry_max_s, double timeout_s)
        : local_(local),
          peer_(peer),
          host_(seed, local_),
          machine_(local_, peer_, HsTiming{retry_initial_s, retry_max_s, timeout_s}, host_) {
        decode_address(peer_);
    }

    void start(double now) { machine_.start(now); }

    // Hands ``data`` to the machine if it is a well-formed message between the two ends.
    bool deliver(const py::bytes& data, double now) {
        HsMessage m;
        try {
            m = decode_message(std::string(data));
        } catch (const std::invalid_argument&) {
            return false;
        }
        if (m.to != local_ || m.from != peer_) return false;
        machine_.on_message(m, now);
        return true;
    }

    void tick(double now) { machine_.tick(now); }
    void reset() { machine_.reset(); }
    double next_timer() const { return machine_.next_timer(); }

    std::vector<py::bytes> outbox() {
        std::vector<py::bytes> out;
        for (auto& m : host_.outbox) out.emplace_back(m);
        host_.outbox.clear();
        return out;
    }
    std::vector<std::string> events() {
        std::vector<std::string> out;
        out.swap(host_.events);
        return out;
    }
    std::string state() const { return state_name(machine_.state()); }
    bool active() const { return machine_.active(); }
    uint32_t local_epoch() const { return machine_.local_epoch(); }
    uint32_t remote_epoch() const { return machine_.remote_epoch(); }
    py::dict local_params() const { return params_dict(machine_.local_params()); }
    py::object remote_params() const {
        if (machine_.remote_epoch() == 0) return py::none();
        return params_dict(machine_.remote_params());
    }
    std::string failure() const { return machine_.failure(); }
    uint64_t sent() const { return machine_.sent(); }
    uint64_t retries() const { return machine_.retries(); }
    bool fail_connect() const { return host_.fail_connect; }
    void set_fail_connect(bool v) { host_.fail_connect = v; }

  private:
    std::string local_;
    std::string peer_;
    FakeHost host_;
    HandshakeMachine machine_;
};

}  // namespace

PYBIND11_MODULE(_verbs, m) {
    m.doc() = "libibverbs engine of fabric-verbs (compiled)";
    static py::exception<VerbsError> error(m, "VerbsError", PyExc_RuntimeError);
    fabric::bind_counter_table(m);

    m.attr("ADDRESS_BYTES") = kAddressBytes;
    m.attr("HANDSHAKE_BYTES") = kMessageBytes;
    m.attr("MAX_SGE_BYTES") = kMaxSgeBytes;
    m.attr("NO_DEVICE") = kNoDevice;

    m.def(
        "probe",
        [](const std::vector<std::string>& devices, int port) -> std::optional<std::string> {
            py::gil_scoped_release release;
            return probe(devices, port);
        },
        py::arg("devices"), py::arg("port"));
    m.def("list_devices", &devices_list);
    m.def("select_port", &select_port, py::arg("device"), py::arg("port"), py::arg("gid_index"));
    m.def("cuda_driver", [] { return fabric::cuda::Driver::get().present(); });
    m.def("max_wr_bytes", &max_wr_bytes, py::arg("port_max_msg_sz"), py::arg("cap"));

    m.def(
        "encode_address",
        [](const py::bytes& gid, uint16_t lid, uint8_t port, uint8_t gid_index, uint32_t ud_qpn, uint32_t qkey,
           uint8_t mtu, bool ethernet, bool roce_v2) {
            Address a;
            a.gid = gid_of(gid);
            a.lid = lid;
            a.port = port;
            a.gid_index = gid_index;
            a.ud_qpn = ud_qpn;
            a.qkey = qkey;
            a.mtu = mtu;
            a.flags = static_cast<uint8_t>((ethernet ? kFlagEthernet : 0) | (roce_v2 ? kFlagRoceV2 : 0));
            return py::bytes(encode_address(a));
        },
        py::arg("gid"), py::arg("lid"), py::arg("port"), py::arg("gid_index"), py::arg("ud_qpn"), py::arg("qkey"),
        py::arg("mtu"), py::arg("ethernet"), py::arg("roce_v2"));
    m.def(
        "decode_address",
        [](const py::bytes& raw) {
            Address a = decode_address(std::string(raw));
            py::dict d;
            d["gid"] = as_bytes(a.gid);
            d["lid"] = a.lid;
            d["port"] = a.port;
            d["gid_index"] = a.gid_index;
            d["ud_qpn"] = a.ud_qpn;
            d["qkey"] = a.qkey;
            d["mtu"] = a.mtu;
            d["ethernet"] = a.ethernet();
            d["roce_v2"] = a.roce_v2();
            d["gid_text"] = gid_text(a.gid);
            return d;
        },
        py::arg("raw"));
    m.def(
        "encode_handshake",
        [](const std::string& type, uint32_t epoch, uint32_t echo, const py::bytes& sender, const py::bytes& receiver,
           const py::dict& params) {
            HsMessage msg;
            msg.type = type_of(type);
            msg.epoch = epoch;
            msg.echo = echo;
            msg.from = sender;
            msg.to = receiver;
            msg.params = params_of(params);
            return py::bytes(encode_message(msg));
        },
        py::arg("type"), py::arg("epoch"), py::arg("echo"), py::arg("sender"), py::arg("receiver"), py::arg("params"));
    m.def(
        "decode_handshake",
        [](const py::bytes& raw) {
            HsMessage msg = decode_message(std::string(raw));
            py::dict d;
            d["type"] = type_name(msg.type);
            d["epoch"] = msg.epoch;
            d["echo"] = msg.echo;
            d["sender"] = py::bytes(msg.from);
            d["receiver"] = py::bytes(msg.to);
            d["params"] = params_dict(msg.params);
            return d;
        },
        py::arg("raw"));
    m.def(
        "build_chains",
        [](py::array_t<int64_t> nic, py::array_t<int64_t> target, py::array_t<int64_t> length, uint64_t max_wr,
           uint32_t chain_max, uint32_t signal_every) {
            auto n = nic.unchecked<1>();
            auto t = target.unchecked<1>();
            auto l = length.unchecked<1>();
            if (t.shape(0) != n.shape(0) || l.shape(0) != n.shape(0))
                throw std::invalid_argument("nic, target and length differ in length");
            std::vector<uint32_t> nv, tv;
            std::vector<uint64_t> lv;
            for (py::ssize_t i = 0; i < n.shape(0); i++) {
                if (n(i) < 0 || t(i) < 0 || l(i) < 0) throw std::invalid_argument("negative nic, target or length");
                nv.push_back(static_cast<uint32_t>(n(i)));
                tv.push_back(static_cast<uint32_t>(t(i)));
                lv.push_back(static_cast<uint64_t>(l(i)));
            }
            std::vector<PlannedWr> wrs = build_chains(nv, tv, lv, max_wr, chain_max, signal_every);
            auto count = static_cast<py::ssize_t>(wrs.size());
            py::array_t<int64_t> index(count), chain(count);
            py::array_t<bool> signaled(count);
            for (py::ssize_t i = 0; i < count; i++) {
                const auto& w = wrs[static_cast<size_t>(i)];
                index.mutable_at(i) = static_cast<int64_t>(w.index);
                chain.mutable_at(i) = w.chain;
                signaled.mutable_at(i) = w.signaled;
            }
            return py::make_tuple(index, chain, signaled);
        },
        py::arg("nic"), py::arg("target"), py::arg("length"), py::arg("max_wr"), py::arg("chain_max"),
        py::arg("signal_every"));

    py::class_<PyHandshake>(m, "HandshakeMachine", py::module_local())
        .def(py::init<const py::bytes&, const py::bytes&, uint64_t, double, double, double>(), py::arg("local"),
             py::arg("peer"), py::arg("seed"), py::arg("retry_initial_s"), py::arg("retry_max_s"),
             py::arg("timeout_s"))
        .def("start", &PyHandshake::start, py::arg("now"))
        .def("deliver", &PyHandshake::deliver, py::arg("data"), py::arg("now"))
        .def("tick", &PyHandshake::tick, py::arg("now"))
        .def("reset", &PyHandshake::reset)
        .def("next_timer", &PyHandshake::next_timer)
        .def("outbox", &PyHandshake::outbox)
        .def("events", &PyHandshake::events)
        .def("local_params", &PyHandshake::local_params)
        .def("remote_params", &PyHandshake::remote_params)
        .def_property_readonly("state", &PyHandshake::state)
        .def_property_readonly("active", &PyHandshake::active)
        .def_property_readonly("local_epoch", &PyHandshake::local_epoch)
        .def_property_readonly("remote_epoch", &PyHandshake::remote_epoch)
        .def_property_readonly("failure", &PyHandshake::failure)
        .def_property_readonly("sent", &PyHandshake::sent)
        .def_property_readonly("retries", &PyHandshake::retries)
        .def_property("fail_connect", &PyHandshake::fail_connect, &PyHandshake::set_fail_connect);

    py::class_<VerbsEngine> engine(m, "Engine", py::module_local());
    engine
        .def(py::init<const std::vector<std::string>&, int, std::optional<uint64_t>, int, size_t, size_t,
                      const py::dict&>(),
             py::arg("devices"), py::arg("nics"), py::arg("chaos_seed"), py::arg("cpu"), py::arg("recv_depth"),
             py::arg("max_send"), py::arg("options"))
        .def("domain_info", &VerbsEngine::domain_info)
        .def("domain_stats", &VerbsEngine::domain_stats);
    fabric::bind_engine(engine);
}
