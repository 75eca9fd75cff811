// fabric_efa._efa: the libfabric backend's compiled module.
//
// The engine binding is fabric-core's (fabric/pyengine.hpp), shared with every compiled
// backend; what is libfabric's is here: opening the endpoints (libfabric_domain.hpp), the
// provider's details, the probe, and the table of endpoints closed in this process.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <fabric/cuda_ipc.hpp>
#include <fabric/pyengine.hpp>

#include "libfabric_domain.hpp"

namespace py = pybind11;
using fabric::efa::LibfabricDomain;
using fabric::efa::LibfabricError;
// Each endpoint, with CUDA memory carried over CUDA IPC where asked (one host: shm).
using Domain = fabric::cuda_ipc::CudaIpcDomain<LibfabricDomain>;

namespace {

// The libfabric engine: one RDM endpoint per emulated or real NIC on ``provider``.
class EfaEngine : public fabric::PyEngine<Domain> {
  public:
    EfaEngine(const std::string& provider, int nics, std::optional<uint64_t> chaos_seed, int cpu, size_t recv_depth,
              size_t max_send, const std::vector<std::string>& sources, bool hmem, int ipc_device, bool markers,
              bool strict_mr, const std::vector<std::string>& domains, size_t eager_max, size_t list_pages)
        : PyEngine(open(provider, nics, sources, hmem, ipc_device, markers, strict_mr, domains, eager_max, list_pages),
                   chaos_seed,
                   cpu,
                   recv_depth, max_send),
          info_(engine().nic(0).info()),
          cuda_ipc_(engine().nic(0).cuda_ipc()),
          kernel_off_(engine().nic(0).copy_kernel_off()),
          inbox_off_(engine().nic(0).inbox_off()) {
        info_.eager_max = engine().eager_max();  // (the domain's, as far as the engine's frames hold it)
    }

    py::dict provider_info() const {
        py::dict d;
        d["provider"] = info_.provider;
        d["fabric"] = info_.fabric;
        d["domain"] = info_.domain;
        d["max_msg_size"] = info_.max_msg_size;
        d["mr_mode"] = info_.mr_mode;
        d["inject_size"] = info_.inject_size;
        d["cq_data_size"] = info_.cq_data_size;
        d["tx_size"] = info_.max_tx;
        d["hmem"] = info_.hmem;
        // whether NIC 0 confirms small writes that go with others by delivery markers (shm)
        // instead of asking each for delivery complete (libfabric_domain.hpp)
        d["delivery_markers"] = info_.markers;
        // local registration as the efa provider wants it, checked at every post (a test mode)
        d["strict_mr"] = info_.strict_mr;
        // lone writes of up to this many bytes go as eager frames (tcp; 0: none)
        d["eager_max"] = info_.eager_max;
        // a paged request's pages go up to this many a write, one imm counting them all (tcp;
        // 0: a write each)
        d["list_pages"] = info_.list_pages;
        // the version of the engines' control frames: engines of another one cannot talk to
        // this one (docs/concepts/failures.md, "A peer of another fabric release")
        d["wire_protocol"] = int(fabric::kWireVersion);
        d["cuda_ipc"] = cuda_ipc_;
        // why small CUDA IPC copies are not batched into kernel launches, or why imms take the
        // provider rather than the inbox ("" where they are, or where there is no CUDA IPC)
        d["cuda_copy_kernel_off"] = kernel_off_;
        d["cuda_inbox_off"] = inbox_off_;
        return d;
    }

    // Fault injection for tests (the harness's kill_nic / restore_nic).
    void inject_nic_failure(int nic, bool failed, uint64_t seed) {
        if (nic < 0 || size_t(nic) >= engine().num_nics()) throw py::index_error("no such NIC");
        engine().nic(size_t(nic)).inject_failure(failed, seed);
    }

  private:
    // ``sources``: empty, or the local address each NIC binds to. ``hmem``: ask for FI_HMEM
    // (there is a GPU whose memory to register). ``ipc_device``: >= 0: carry CUDA memory over
    // CUDA IPC, with that device's primary context (fabric/cuda_ipc.hpp). ``markers``: delivery
    // markers where the provider allows. ``strict_mr``: FI_MR_LOCAL's registrations, checked.
    // ``names``: empty, or the provider's domain each NIC opens ("": its first) (LibfabricDomain).
    // ``eager_max``: lone writes of up to this many bytes as eager frames, where allowed.
    // ``list_pages``: a paged request's pages up to this many a write, where allowed.
    static std::vector<std::unique_ptr<Domain>> open(const std::string& provider, int nics,
                                                     const std::vector<std::string>& sources, bool hmem,
                                                     int ipc_device, bool markers, bool strict_mr,
                                                     const std::vector<std::string>& names, size_t eager_max,
                                                     size_t list_pages) {
        std::vector<std::unique_ptr<Domain>> domains;
        for (size_t i = 0; i < size_t(nics); i++)
            domains.push_back(std::make_unique<Domain>(ipc_device, provider, int(i), 4096,
                                                       i < sources.size() ? sources[i] : std::string(), hmem,
                                                       markers, strict_mr, i < names.size() ? names[i] : std::string(),
                                                       eager_max, list_pages));
        return domains;
    }

    fabric::efa::ProviderInfo info_;
    bool cuda_ipc_;
    std::string kernel_off_, inbox_off_;
};

// Cheap check: can fi_getinfo find an RDM endpoint with RMA and remote CQ data here?
std::optional<std::string> probe(const std::string& provider) {
    fi_info* hints = fabric::efa::rdm_hints(provider);
    fi_info* info = nullptr;
    int rc = fabric::efa::getinfo(hints, &info);
    fi_freeinfo(hints);
    if (info) fi_freeinfo(info);
    if (rc != 0) return std::string("fi_getinfo found no RDM endpoint on provider '") + provider + "': " + fi_strerror(-rc);
    return std::nullopt;
}

// What strict local registration (LibfabricDomain::strict_problem) says of five buffers: one
// inside a registration of the endpoint, with its descriptor; none; another endpoint's
// registration; one past the end of its registration; a registration closed since. Two
// endpoints on ``provider``, each with a 64-byte buffer registered ("" where nothing is wrong).
// ``then_abort``: then a send without a descriptor, as a post would check it: the process
// aborts with the reason on stderr.
std::vector<std::string> strict_mr_selftest(const std::string& provider, bool then_abort) {
    LibfabricDomain a(provider, 0, 64, std::string(), false, false, true);
    LibfabricDomain b(provider, 1, 64, std::string(), false, false, true);
    alignas(64) static char buf_a[64], buf_b[64];
    uint64_t key = 0;
    void *desc_a = nullptr, *desc_b = nullptr;
    fid_mr* mr_a = a.register_memory(buf_a, sizeof(buf_a), 1, true, key, desc_a);
    fid_mr* mr_b = b.register_memory(buf_b, sizeof(buf_b), 2, true, key, desc_b);
    std::vector<std::string> out;
    void* d = desc_a;
    out.push_back(a.strict_problem(buf_a + 8, 56, d));
    d = nullptr;
    out.push_back(a.strict_problem(buf_a, 8, d));
    d = desc_b;
    out.push_back(a.strict_problem(buf_b, 8, d));
    d = desc_a;
    out.push_back(a.strict_problem(buf_a + 8, 57, d));
    a.deregister_memory(mr_a);
    d = desc_a;
    out.push_back(a.strict_problem(buf_a, 8, d));
    b.deregister_memory(mr_b);
    if (then_abort) {
        d = nullptr;
        a.strict_check(buf_a, 8, d, "a send");
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_efa, m) {
    m.doc() = "libfabric engine of fabric-efa (compiled)";
    static py::exception<LibfabricError> error(m, "LibfabricError", PyExc_RuntimeError);
    static py::exception<fabric::cuda_ipc::IpcError> ipc_error(m, "CudaIpcError", PyExc_RuntimeError);
    fabric::bind_counter_table(m);
    m.def("probe", &probe, py::arg("provider"));
    m.def(
        "list_domains",
        [](const std::string& provider) {
            std::vector<fabric::efa::DomainEntry> found;
            {
                py::gil_scoped_release release;
                found = fabric::efa::list_domains(provider);
            }
            py::list out;
            for (const auto& d : found) {
                py::dict e;
                e["name"] = d.name;
                e["fabric"] = d.fabric;
                e["pci"] = d.pci;
                e["device"] = d.device;
                e["speed_bps"] = d.speed_bps;
                out.append(e);
            }
            return out;
        },
        py::arg("provider"));
    m.def(
        "_strict_mr_selftest",
        [](const std::string& provider, bool then_abort) {
            py::gil_scoped_release release;
            return strict_mr_selftest(provider, then_abort);
        },
        py::arg("provider"), py::arg("then_abort") = false);
    m.def("close_address", [](py::bytes a) { fabric::fast::ClosedSet::instance().add(a); }, py::arg("address"));
    m.def("reopen_address", [](py::bytes a) { fabric::fast::ClosedSet::instance().remove(a); }, py::arg("address"));
    m.def("is_closed", [](py::bytes a) { return fabric::fast::ClosedSet::instance().contains(a); }, py::arg("address"));
    // (tests: the connection reset a path lost in silence gets; tcp_abort.hpp)
    m.def(
        "abort_tcp_connections",
        [](py::bytes local, py::bytes peer) {
            std::string l = local, p = peer;
            py::gil_scoped_release release;
            return fabric::efa::tcp_abort::abort_connections(l, p);
        },
        py::arg("local"), py::arg("peer"));
    m.def("libfabric_version", [] {
        uint32_t v = fi_version();
        return py::make_tuple(FI_MAJOR(v), FI_MINOR(v));
    });
    py::class_<EfaEngine> engine(m, "Engine", py::module_local());
    engine
        .def(py::init<const std::string&, int, std::optional<uint64_t>, int, size_t, size_t,
                      const std::vector<std::string>&, bool, int, bool, bool, const std::vector<std::string>&,
                      size_t, size_t>(),
             py::arg("provider"), py::arg("nics"), py::arg("chaos_seed"), py::arg("cpu"), py::arg("recv_depth"),
             py::arg("max_send"), py::arg("sources") = std::vector<std::string>(), py::arg("hmem") = false,
             py::arg("ipc_device") = -1, py::arg("markers") = true, py::arg("strict_mr") = false,
             py::arg("domains") = std::vector<std::string>(), py::arg("eager_max") = 0, py::arg("list_pages") = 0)
        .def("provider_info", &EfaEngine::provider_info)
        .def("inject_nic_failure", &EfaEngine::inject_nic_failure, py::arg("nic"), py::arg("failed"),
             py::arg("seed") = 0);
    fabric::bind_engine(engine);
}
