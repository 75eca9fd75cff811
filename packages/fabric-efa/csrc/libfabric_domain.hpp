// One NIC through libfabric: an RDM endpoint with its own fabric, domain, address vector and
// completion queue. The same code drives the efa provider on AWS and shm / tcp;ofi_rxm here.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fabric/cuda.hpp>
#include <fabric/engine.hpp>
#include <fabric/region_table.hpp>
#include <fabric/shm_orphans.hpp>

#include "tcp_abort.hpp"

namespace fabric::efa {

class LibfabricError : public std::runtime_error {
  public:
    LibfabricError(const std::string& what, int code)
        : std::runtime_error(what + ": " + fi_strerror(code < 0 ? -code : code)), code_(code < 0 ? -code : code) {}
    int code() const { return code_; }

  private:
    int code_;
};

inline void check(int rc, const char* what) {
    if (rc != 0) throw LibfabricError(what, rc);
}

// Keeps the process's handlers of the fatal and interrupt signals across a libfabric call that
// may load and initialise providers: some provider libraries (PSM) install handlers that
// print a backtrace and exit(1), which would turn Python's Ctrl-C into a silent exit.
class SignalGuard {
  public:
    SignalGuard() {
        for (size_t i = 0; i < kCount; i++) saved_[i] = sigaction(kSignals[i], nullptr, &old_[i]) == 0;
    }
    ~SignalGuard() {
        for (size_t i = 0; i < kCount; i++)
            if (saved_[i]) sigaction(kSignals[i], &old_[i], nullptr);
    }
    SignalGuard(const SignalGuard&) = delete;
    SignalGuard& operator=(const SignalGuard&) = delete;

  private:
    static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGFPE};
    static constexpr size_t kCount = sizeof(kSignals) / sizeof(kSignals[0]);
    struct sigaction old_[kCount] = {};
    bool saved_[kCount] = {};
};

// fi_getinfo with the process's signal handlers kept (the first call initialises providers).
// ``source``: a local address to bind to (the interface of an IP provider), or empty.
inline int getinfo(fi_info* hints, fi_info** out, const std::string& source = std::string()) {
    SignalGuard guard;
    if (!source.empty()) return fi_getinfo(FI_VERSION(1, 17), source.c_str(), nullptr, FI_SOURCE, hints, out);
    return fi_getinfo(FI_VERSION(1, 17), nullptr, nullptr, 0, hints, out);
}

// The hints every endpoint starts from, and the probe and list_domains use: an RDM endpoint with
// RMA writes and messages on ``provider``, in any of the registration modes this backend
// handles. The caller frees them (fi_freeinfo).
inline fi_info* rdm_hints(const std::string& provider) {
    fi_info* hints = fi_allocinfo();
    if (!hints) throw std::bad_alloc();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    return hints;
}

// One domain (NIC) a provider offers, as fi_getinfo lists it: its name, its fabric, and where
// the provider says so (real NICs: efa, verbs), the PCI function, device name and link speed.
struct DomainEntry {
    std::string name;
    std::string fabric;
    std::string pci;     // "dddd:bb:dd.f", or "" (shm, tcp: no NIC attributes)
    std::string device;  // the NIC's device name, or ""
    uint64_t speed_bps = 0;
};

// The domains fi_getinfo lists for an RDM endpoint on ``provider``, each once, in its order
// (empty where there is none).
inline std::vector<DomainEntry> list_domains(const std::string& provider) {
    fi_info* hints = rdm_hints(provider);
    fi_info* info = nullptr;
    int rc = getinfo(hints, &info);
    fi_freeinfo(hints);
    std::vector<DomainEntry> out;
    if (rc != 0) return out;
    for (fi_info* e = info; e; e = e->next) {
        if (!e->domain_attr || !e->domain_attr->name) continue;
        std::string name = e->domain_attr->name;
        bool seen = false;
        for (const auto& d : out) seen = seen || d.name == name;
        if (seen) continue;
        DomainEntry d;
        d.name = name;
        d.fabric = e->fabric_attr && e->fabric_attr->name ? e->fabric_attr->name : "";
        if (e->nic) {
            const fi_bus_attr* bus = e->nic->bus_attr;
            if (bus && bus->bus_type == FI_BUS_PCI) {
                char pci[32];
                std::snprintf(pci, sizeof(pci), "%04x:%02x:%02x.%x", unsigned(bus->attr.pci.domain_id),
                              unsigned(bus->attr.pci.bus_id), unsigned(bus->attr.pci.device_id),
                              unsigned(bus->attr.pci.function_id));
                d.pci = pci;
            }
            if (e->nic->device_attr && e->nic->device_attr->name) d.device = e->nic->device_attr->name;
            if (e->nic->link_attr) d.speed_bps = e->nic->link_attr->speed;
        }
        out.push_back(std::move(d));
    }
    fi_freeinfo(info);
    return out;
}

// An operation the provider cancelled (FI_ECANCELED) is about the peer, whatever the
// provider's own errno says: the engine never cancels an operation it posted, so the provider
// gave up on it because the connection to that peer went. tcp usually says ENOTCONN or
// ECONNRESET for the writes under way to a killed process, but some came back with ENOENT,
// and their transfers ended as a plain TransportError instead of PeerUnreachable
// (test_a_dead_peer_costs_the_survivors_no_counts failed so in two of four efa-suite runs).
inline int32_t status_of(int err) {
    // (the engine asks the target whether it refused the write first: tcp cancels the work
    // on a connection that the target dropped over a refused key the same way)
    if (err == FI_ECANCELED) return kConnectionDropped;
    switch (err) {
        case FI_EHOSTUNREACH:
        case FI_ECONNREFUSED:
        case FI_ECONNRESET:
        case FI_ECONNABORTED:
        case FI_ENOTCONN:
        case FI_EIO:
            return kPeerUnreachable;
        case FI_EACCES:
        case FI_EKEYREJECTED:
        case FI_EINVAL:
        case FI_EREMOTEIO:
            return kRemoteAccess;
        default:
            return kTransport;
    }
}

struct ProviderInfo {
    std::string provider;
    std::string fabric;
    std::string domain;
    uint64_t max_msg_size = 0;
    uint64_t mr_mode = 0;
    uint64_t inject_size = 0;
    uint64_t cq_data_size = 0;
    uint64_t max_tx = 0;
    bool hmem = false;
    bool markers = false;  // small writes confirmed by delivery markers (LibfabricDomain: markers_)
    bool strict_mr = false;  // local registration checked at every post (LibfabricDomain: strict_mr_)
    uint64_t eager_max = 0;  // lone writes of up to this many bytes go as eager frames (eager_max_)
    uint64_t list_pages = 0;  // pages of a paged request per write, at most (list_pages_; 0: one each)
};

// shm's regions are files in /dev/shm named after their process: "<pid>:<uid>:<n>", or
// "fabric-<pid>-<nonce>-<nic>" where this domain named its endpoint itself (below). A process
// killed outright (a test's peer, a crashed rank) never unlinks them, and each holds 16 MiB
// of the host's memory (tmpfs) for good: a development host was found with 3,806 of them,
// 15 GB. Opening an shm domain removes those of processes that are gone, and of this user
// (kill(pid, 0) says ESRCH); a live process's are never touched. Returns how many went.
inline size_t remove_orphan_regions(const char* dir_path = "/dev/shm") {
    return remove_orphans(dir_path, [](const char* name) {
        // (and the region tables of their endpoints: fabric-acl.<endpoint name>, see
        // fabric/region_table.hpp)
        constexpr char kTable[] = "fabric-acl.";
        if (std::strncmp(name, kTable, sizeof(kTable) - 1) == 0) name += sizeof(kTable) - 1;
        int pid = 0, a = 0, b = 0, used = 0;
        if (std::sscanf(name, "%d:%d:%d%n", &pid, &a, &b, &used) == 3 && name[used] == '\0') return pid;
        if (std::sscanf(name, "fabric-%d-%*[0-9a-f]-%d%n", &pid, &a, &used) == 2 && name[used] == '\0') return pid;
        return 0;
    });
}

class LibfabricDomain {
  public:
    // Opens the index-th endpoint on `provider` (several per process emulate several NICs).
    // ``source``: the local address to bind to (see getinfo), or empty.
    // ``hmem``: ask for FI_HMEM (CUDA memory), where the provider has it. ``markers``: delivery
    // markers where the provider allows (the end of the constructor); off, every write with
    // bytes goes delivery complete. ``strict_mr``: local registration as the efa provider
    // wants it, checked (a test mode: "Strict local registration" below). ``domain``: the
    // provider's domain (NIC) to open, by name (list_domains); empty: the first it lists.
    // ``eager_max``: lone writes of up to this many bytes go as eager frames where the
    // provider is tcp's (eager_write_max()). ``list_pages``: the pages of a paged request go
    // up to this many a write where the provider is tcp's (list_pages()).
    LibfabricDomain(const std::string& provider, int index, size_t cq_size, const std::string& source = std::string(),
                    bool hmem = false, bool markers = true, bool strict_mr = false,
                    const std::string& domain = std::string(), size_t eager_max = 0, size_t list_pages = 0)
        : strict_mr_(strict_mr) {
        fi_info* hints = rdm_hints(provider);
        hints->caps |= FI_SEND | FI_RECV;
        hints->domain_attr->threading = FI_THREAD_SAFE;
        hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
        // FI_SOURCE where the provider has it and reports it right: an imm's source, for exact
        // counts across a lost NIC (fabric/engine.hpp, "NIC loss"). Not on rxm: libfabric
        // 1.17's reported a second sender's remote writes as coming from the first (measured:
        // every imm of the peer at handle 1 came as handle 0, on NIC 0 and NIC 1), and 2.x's
        // leaves the source out of every remote write (rxm_handle_remote_write). Without it
        // the engine attributes a NIC's imms only while one sender uses it (Engine::attribute).
        const bool rxm = provider.find("rxm") != std::string::npos;
        if (!rxm) hints->caps |= FI_SOURCE;
        // FI_HMEM, when asked (a GPU is there), where the provider has it: CUDA memory
        // registered as such (FI_HMEM_CUDA), which the provider moves itself (shm: CUDA IPC
        // between the processes of a host). Each wish is dropped in turn where refused.
        if (hmem) {
            hints->caps |= FI_HMEM;
            hints->domain_attr->mr_mode |= FI_MR_HMEM;
        }
        // shm: writes, and a send after writes, applied in the order posted (delivery markers,
        // see the end of the constructor); dropped where refused. Asked for with markers off
        // too: shm's entries differ in their memory-registration mode (virtual addresses or
        // offsets), and peers on different entries would misread each other's addresses.
        const bool ordered = provider == "shm";
        if (ordered) hints->tx_attr->msg_order = FI_ORDER_RMA_WAW | FI_ORDER_SAW;
        int rc = getinfo(hints, &info_, source);
        if (rc != 0 && ordered) {
            hints->tx_attr->msg_order = 0;
            rc = getinfo(hints, &info_, source);
        }
        if (rc != 0 && hmem) {
            hints->caps &= ~FI_HMEM;
            hints->domain_attr->mr_mode &= ~FI_MR_HMEM;
            rc = getinfo(hints, &info_, source);
        }
        if (rc != 0) {
            hints->caps &= ~FI_SOURCE;
            rc = getinfo(hints, &info_, source);
        }
        fi_freeinfo(hints);
        if (rc != 0)
            throw LibfabricError("fi_getinfo(" + provider + (source.empty() ? "" : " at " + source) + ")", rc);
        if (!domain.empty()) keep_domain(domain, provider);
        shm_ = info_->fabric_attr->prov_name && std::string(info_->fabric_attr->prov_name) == "shm";
        stale_peers_ = info_->fabric_attr->prov_name &&
                       std::string(info_->fabric_attr->prov_name).find("ofi_rxm") != std::string::npos;
        sources_ = (info_->caps & FI_SOURCE) != 0 && !stale_peers_;  // (rxm: above)
        if (shm_ && index == 0) remove_orphan_regions();
        try {
            SignalGuard guard;
            check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
            check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain");
            fi_av_attr av_attr{};
            av_attr.type = FI_AV_TABLE;
            check(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open");
            fi_cq_attr cq_attr{};
            cq_attr.format = FI_CQ_FORMAT_DATA;
            cq_attr.size = cq_size;
            check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open");
            check(fi_endpoint(domain_, info_, &ep_, nullptr), "fi_endpoint");
            check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)");
            check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
            int enabled = fi_enable(ep_);
            if (enabled == -FI_EBUSY && shm_) {
                // shm names its segment after the pid (/dev/shm/<pid>:<uid>:<n>), and a
                // process killed outright leaves its segments behind: once its pid comes round
                // again, the name is taken. A name of this endpoint's own then.
                fi_close(&ep_->fid);
                ep_ = nullptr;
                check(fi_endpoint(domain_, info_, &ep_, nullptr), "fi_endpoint");
                check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)");
                check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
                std::random_device rd;
                char unique[64];
                std::snprintf(unique, sizeof(unique), "fabric-%d-%08x%08x-%d", int(getpid()), unsigned(rd()),
                              unsigned(rd()), index);
                check(fi_setname(&ep_->fid, unique, std::strlen(unique) + 1), "fi_setname");
                enabled = fi_enable(ep_);
            }
            check(enabled, "fi_enable");
            char name[256];
            size_t len = sizeof(name);
            check(fi_getname(&ep_->fid, name, &len), "fi_getname");
            address_.assign(name, len);
            // shm: what this endpoint's registrations take, for writers to read before they
            // post (fabric/region_table.hpp); made before anyone can know the address
            if (shm_) table_ = std::make_unique<region_table::Owner>(address_);
        } catch (...) {
            close();
            throw;
        }
        index_ = static_cast<uint32_t>(index);
        // shm sends a delivery-complete write of at most its inject size through its bounce
        // buffers, one such transfer in flight per peer (smr_select_proto, smr_format_sar in
        // libfabric 1.17 and 2.x): a stream of small writes to one peer went one at a time,
        // each waiting for the target to copy the one before. Where the provider applies
        // writes, and a send after writes, in the order they were posted (FI_ORDER_RMA_WAW,
        // FI_ORDER_SAW: shm has one command queue per peer, taken in order), such writes go
        // as injects instead, many in flight, and each one's completion is held back until a
        // delivery-complete marker (a two-byte control frame to the peer engine's NIC 0,
        // where its receives are) posted after it completes: the target has then applied it.
        // So a completed write's bytes are still in place at the target. For the writes of
        // requests of several only (post_write). NIC 0 only: the target engine posts receives
        // there alone.
        const uint64_t order = info_->tx_attr->msg_order;
        inject_size_ = info_->tx_attr->inject_size;
        markers_ = markers && shm_ && index == 0 && inject_size_ > 0 && (order & FI_ORDER_RMA_WAW) &&
                   (order & FI_ORDER_SAW);
        if (markers_ && local_mr()) {  // the marker frame's registration, once
            try {
                marker_desc_ = local_desc(marker_frame_, sizeof(marker_frame_));
            } catch (const LibfabricError&) {
                markers_ = false;  // every write delivery complete, as without markers
            }
        }
        // Eager writes (fabric/engine.hpp, Engine::post_eager): on rxm, whose delivery-complete
        // write costs an acknowledgement the target's provider sends before it reports the
        // imm, a lone small write goes as a frame to the target's engine, which copies it in
        // and acknowledges it after counting its imm. NIC 0 only (the target engine's
        // receives are there), and host memory only: not where the provider carries device
        // memory (FI_HMEM), whose regions the target's engine could not copy into.
        eager_max_ = stale_peers_ && index == 0 && !(info_->caps & FI_HMEM) ? eager_max : 0;
        // Lists (post_write_list): on rxm, a paged request's pages go several a write, each
        // write one scatter of up to list_pages_ pages (the provider's iov limits) whose one
        // remote CQ data carries the imm and, in its upper 32 bits, how many pages it stands
        // for; the target's poll counts the imm that many times (poll_cq). Every tcp write with
        // bytes pays the target's acknowledgement and two socket calls a side: four pages a
        // write took the raw program's delivery-complete 4 KiB pages from about 160k to 270k
        // pages/s on the 2-core machine (docs/backends/efa.md). Where the remote CQ data has
        // no room for the count (efa: 4 bytes), each page stays a write.
        {
            const size_t limit = std::min({info_->tx_attr->iov_limit, info_->tx_attr->rma_iov_limit, kMaxListIov});
            list_pages_ = stale_peers_ && info_->domain_attr->cq_data_size >= 8 ? std::min(list_pages, limit) : 0;
            if (list_pages_ < 2) list_pages_ = 0;
        }
        // the local buffer a zero-length write names (post_write), registered where the
        // provider wants every buffer registered (a refusal closes what the constructor opened)
        if (local_mr()) {
            try {
                zero_desc_ = local_desc(zero_src_, sizeof(zero_src_));
            } catch (...) {
                close();
                throw;
            }
        }
    }

    ~LibfabricDomain() { close(); }
    LibfabricDomain(const LibfabricDomain&) = delete;
    LibfabricDomain& operator=(const LibfabricDomain&) = delete;

    ProviderInfo info() const {
        ProviderInfo p;
        p.provider = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "";
        p.fabric = info_->fabric_attr->name ? info_->fabric_attr->name : "";
        p.domain = info_->domain_attr->name ? info_->domain_attr->name : "";
        p.max_msg_size = info_->ep_attr->max_msg_size;
        p.mr_mode = static_cast<uint64_t>(info_->domain_attr->mr_mode);
        p.inject_size = info_->tx_attr->inject_size;
        p.cq_data_size = info_->domain_attr->cq_data_size;
        p.max_tx = info_->tx_attr->size;
        p.hmem = (info_->caps & FI_HMEM) != 0;
        p.markers = markers_;
        p.strict_mr = strict_mr_;
        p.eager_max = eager_max_;
        p.list_pages = list_pages_;
        return p;
    }

    const std::string& address() const { return address_; }
    // rxm keeps a connection per peer, and one the peer dropped unseen (a reset this side
    // never sent into) stays "connected" here: the peer's next connect from the same process
    // is then refused (rxm: "simultaneous, reject peer") until this side sends on it and
    // meets the reset. fi_av_remove does not close it (the connection holds the peer).
    bool stale_peers() const { return stale_peers_; }

    // Resets this endpoint's connections to the peer endpoint at ``peer`` (its address), so
    // that the provider fails the writes it holds for them (fabric/engine.hpp: a path lost in
    // silence; tcp_abort.hpp says how and what is matched). Where connections are rxm's on
    // tcp only; returns how many were reset.
    size_t abort_path(const std::string& peer) {
        if (!stale_peers_) return 0;
        return tcp_abort::abort_connections(address_, peer);
    }

    // Fault injection (tests: the harness's kill_nic): while failed, every write this NIC
    // completes is reported failed (its bytes and imm landed: an acknowledgement lost with
    // the NIC), and each new write is, at random, either posted and then reported failed
    // the same way or dropped unposted and reported failed: the sender cannot tell the two.
    void inject_failure(bool failed, uint64_t seed) {
        std::lock_guard<std::mutex> lock(inject_mu_);
        failed_.store(failed, std::memory_order_release);
        inject_rng_ = seed;
    }
    bool virt_addr() const { return (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0; }
    // shm: the target's own polls move a write's bytes (copied out of the inject buffer or
    // out of the writer's memory with CMA), so an idle target worker lingers after work
    // (Engine::run). tcp's kernel and EFA's device move them without the target's polls.
    bool target_copies() const { return shm_; }
    // The largest write that goes as an eager frame (0: none; see the constructor).
    size_t eager_write_max() const { return eager_max_; }
    // The most pages of a paged request one write carries (engine.hpp's lists; 0: each page
    // its own write; see the constructor). Every key alike: the target's provider checks it.
    size_t list_pages(uint64_t) const { return list_pages_; }
    // Whether a fault is injected (inject_failure): the engine sends no eager write then.
    bool nic_down() const { return failed_.load(std::memory_order_acquire); }
    // Whether every local buffer handed to the provider must be registered on this domain and
    // passed with its descriptor (FI_MR_LOCAL: the efa provider; or strict_mr).
    bool local_mr() const { return strict_mr_ || (info_->domain_attr->mr_mode & FI_MR_LOCAL) != 0; }
    bool strict_mr() const { return strict_mr_; }

    uint64_t insert_peer(const std::string& address) {
        // Providers read their own address length from the buffer, whatever the caller holds:
        // copy into a zero-padded buffer so that a short (foreign or forged) address is never
        // read past its end. No provider's address comes close to kMaxAddress bytes.
        constexpr size_t kMaxAddress = 512;
        if (address.empty() || address.size() > kMaxAddress) throw LibfabricError("fi_av_insert", -FI_EINVAL);
        // shm names a peer by its shared-memory segment: an empty name (a forged or corrupt
        // address) is inserted all the same and the first write to it crashes the provider
        // (SIGSEGV in its spinlock, found by fuzzing), so it is refused here.
        if (shm_ && address[0] == '\0') throw LibfabricError("fi_av_insert", -FI_EINVAL);
        char padded[kMaxAddress + 64] = {};
        std::memcpy(padded, address.data(), address.size());
        fi_addr_t out = FI_ADDR_UNSPEC;
        std::lock_guard<std::mutex> lock(av_mu_);
        int n = fi_av_insert(av_, padded, 1, &out, 0, nullptr);
        if (n != 1) throw LibfabricError("fi_av_insert", n < 0 ? n : -FI_EINVAL);
        if (shm_ && out != FI_ADDR_NOTAVAIL && out < (uint64_t(1) << 24)) {  // its region table
            auto& view = views_by_name_[address];
            if (!view) view = std::make_shared<region_table::View>(address);
            if (views_.size() <= out) views_.resize(out + 1);
            views_[out] = view->mapped() ? view : nullptr;
        }
        return out;
    }

    // Forgets a lost peer: the provider drops its connection state (rxm closes the
    // connection), so the same address inserted again reaches whatever process owns it now.
    // Not on shm: its address-vector entry maps the peer's shared-memory region, which a
    // peer that was only silent (stopped) still writes commands through once it resumes;
    // removing it under those commands crashes the provider (seen: SIGSEGV, and a spinlock
    // never released). A restarted shm process has a new address, so nothing is lost.
    void remove_peer(uint64_t peer) {
        if (shm_) return;
        fi_addr_t addr = peer;
        std::lock_guard<std::mutex> lock(av_mu_);
        fi_av_remove(av_, &addr, 1, 0);
    }

    using Mr = fid_mr*;

    // Registers [ptr, ptr+len) for local use and remote writes; returns (mr, key, desc).
    fid_mr* register_memory(void* ptr, size_t len, uint64_t requested_key, bool remote_write, uint64_t& key,
                            void*& desc) {
        fid_mr* mr = nullptr;
        uint64_t access = FI_WRITE | FI_SEND | FI_RECV | (remote_write ? FI_REMOTE_WRITE : 0);
        int device = (info_->caps & FI_HMEM) ? cuda::device_ordinal(ptr) : -1;
        if (device >= 0) {
            // CUDA memory: the provider must know it is device memory (it cannot touch it
            // with the CPU); fabric_core checked at registration that it is one allocation.
            iovec iov{ptr, len};
            fi_mr_attr attr{};
            attr.mr_iov = &iov;
            attr.iov_count = 1;
            attr.access = access;
            attr.requested_key = requested_key;
            attr.iface = FI_HMEM_CUDA;
            attr.device.cuda = device;
            int rc = fi_mr_regattr(domain_, &attr, 0, &mr);
            if (rc != 0) throw LibfabricError("fi_mr_regattr(FI_HMEM_CUDA, cuda:" + std::to_string(device) + ")", rc);
        } else {
            int rc = fi_mr_reg(domain_, ptr, len, access, 0, requested_key, 0, &mr, nullptr);
            if (rc != 0) throw LibfabricError("fi_mr_reg", rc);
        }
        key = fi_mr_key(mr);
        desc = fi_mr_desc(mr);
        if (strict_mr_) desc = strict_record(mr, ptr, len, desc);
        if (table_) table_->add(key, virt_addr() ? reinterpret_cast<uint64_t>(ptr) : 0, len, remote_write);
        return mr;
    }

    // On shm the region table's entry goes first, and the writes that checked it complete
    // (region_table::Owner::revoke), so that no write reaches the closed registration.
    void deregister_memory(fid_mr* mr) {
        if (table_) table_->revoke(fi_mr_key(mr));
        if (strict_mr_) strict_forget(mr);
        fi_close(&mr->fid);
    }

    // Registers an engine-owned buffer for local access (control-message bounce buffers):
    // providers with FI_MR_LOCAL (efa) take no unregistered buffer. Closed with the domain.
    void* local_desc(void* buf, size_t len) {
        fid_mr* mr = nullptr;
        uint64_t key = kLocalKeyBase + local_mrs_.size();  // apart from user keys (FI_MR_PROV_KEY unset)
        int rc = fi_mr_reg(domain_, buf, len, FI_SEND | FI_RECV | FI_WRITE | FI_READ, 0, key, 0, &mr, nullptr);
        if (rc != 0) throw LibfabricError("fi_mr_reg(control buffers)", rc);
        local_mrs_.push_back(mr);
        void* desc = fi_mr_desc(mr);
        return strict_mr_ ? strict_record(mr, buf, len, desc) : desc;
    }

    // --- Strict local registration (a test mode: FABRIC_EFA_STRICT_MR) ------------------
    // The efa provider wants every local buffer it is handed registered on its own domain and
    // the registration's descriptor passed with it (FI_MR_LOCAL). shm and tcp want neither
    // and ignore the descriptors they get, so one left out, or taken from another endpoint's
    // registration, goes unnoticed on them and fails only on EFA. Strict, this domain takes
    // FI_MR_LOCAL's path whatever its provider says (local_mr()), and the descriptors it hands
    // out are its own records of each registration: its range, and whether it is still
    // registered. Every post looks its descriptor up among this domain's records, checks that
    // the registration covers the buffer, and passes the provider's descriptor on. A post
    // that fails the check aborts the process with the reason on stderr, as a sanitizer
    // does: its caller has a bug that only EFA would have shown.
    struct StrictMr {
        uintptr_t lo = 0, hi = 0;
        void* desc = nullptr;  // the provider's
        bool live = true;
    };

    // Why [buf, buf + len) with ``desc`` would break FI_MR_LOCAL ("" where it would not, and
    // ``desc`` is then the provider's descriptor). Not strict: "" and ``desc`` as it was.
    std::string strict_problem(const void* buf, size_t len, void*& desc) const {
        if (!strict_mr_) return std::string();
        if (desc == nullptr) return "no descriptor";
        std::lock_guard<std::mutex> lock(strict_mu_);
        auto it = strict_records_.find(desc);
        if (it == strict_records_.end()) return "a descriptor that is no registration of this endpoint";
        const StrictMr& r = *it->second;
        if (!r.live) return "the descriptor of a registration closed since";
        const uintptr_t lo = reinterpret_cast<uintptr_t>(buf);
        if (lo < r.lo || lo > r.hi || len > r.hi - lo) return "a buffer its descriptor's registration does not cover";
        desc = r.desc;
        return std::string();
    }

    // (strict_mr) Swaps ``desc`` for the provider's, or aborts with why ``what`` breaks
    // FI_MR_LOCAL.
    void strict_check(const void* buf, size_t len, void*& desc, const char* what) const {
        if (!strict_mr_) return;
        std::string why = strict_problem(buf, len, desc);
        if (why.empty()) return;
        std::fprintf(stderr, "fabric-efa (strict_mr): %s of %zu bytes at %p on endpoint %u names %s\n", what, len,
                     buf, index_, why.c_str());
        std::fflush(stderr);
        std::abort();
    }

    // While a fault is injected (inject_failure): whether a new write is dropped unposted
    // (at random; it is then reported failed by the next poll).
    bool dropped_unposted(void* ctx) {
        if (!failed_.load(std::memory_order_acquire)) return false;
        std::lock_guard<std::mutex> lock(inject_mu_);
        uint64_t z = (inject_rng_ += 0x9e3779b97f4a7c15ULL);  // splitmix64
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        if (!((z ^ (z >> 31)) & 1)) return false;
        dropped_.push_back(ctx);
        return true;
    }

    int post_write(const WriteOp& w, void* ctx) {
        if (dropped_unposted(ctx)) return 0;  // dropped before it left
        auto* op = static_cast<OpCtx*>(ctx);  // (the engine's context for every post)
        op->domain_peer = 0;
        // shm: a write the target would refuse is never posted (its region table says so),
        // and one that is posted holds its table entry until it completes (see region_table).
        std::atomic<int64_t>* hold = nullptr;
        if (w.peer < views_.size() && views_[w.peer]) {
            std::string why;
            if (views_[w.peer]->check(w.rkey, w.raddr, w.len, index_, hold, why) == region_table::View::kRefused) {
                refused_.emplace_back(ctx, std::move(why));
                return 0;
            }
        }
        // A zero-length write (imm only) still names a valid local buffer and remote range:
        // some providers dereference them. The buffer is this endpoint's own, registered where
        // the provider wants every buffer registered (a make-up imm after a lost NIC has its
        // request's source registration, which does not cover it).
        void* src = w.len == 0 ? static_cast<void*>(zero_src_) : const_cast<void*>(w.src);
        void* desc = w.len == 0 ? zero_desc_ : w.desc;
        strict_check(src, static_cast<size_t>(w.len), desc, "a write");
        iovec iov{src, static_cast<size_t>(w.len)};
        fi_rma_iov rma{w.raddr, static_cast<size_t>(w.len), w.rkey};
        fi_msg_rma msg{};
        msg.msg_iov = &iov;
        msg.desc = &desc;
        msg.iov_count = 1;
        msg.addr = w.peer;
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.context = ctx;
        msg.data = w.imm;
        // Delivery-complete: a completed write's bytes are in place at the target. A zero-length
        // write has no bytes, and shm never completes one asked to deliver-complete. A small
        // write on shm gets there under a delivery marker instead (markers_, post_markers).
        // Only writes of requests of several (WriteOp::batch): a lone one still goes delivery
        // complete, as a marker behind it cost a round trip of 8-byte writes twice the time
        // (fabric bench, alternated; docs/backends/efa.md).
        const bool marked = markers_ && w.batch && w.len > 0 && w.len <= inject_size_;
        uint64_t flags = FI_COMPLETION | (w.len && !marked ? FI_DELIVERY_COMPLETE : 0) |
                         (w.has_imm ? FI_REMOTE_CQ_DATA : 0);
        if (marked) op->domain_peer = w.peer + 1;
        ssize_t rc = fi_writemsg(ep_, &msg, flags);
        if (hold) {
            if (rc == 0) {
                op->domain_word = hold;
                op->domain_index = held_.size();
                held_.push_back(op);
            } else {
                region_table::View::release(hold);
            }
        }
        return rc == -FI_EAGAIN ? -EAGAIN : static_cast<int>(rc);
    }

    // ``n`` pages of ``w.len`` bytes (at most list_pages_), from ``srcs[i]`` to
    // ``w.raddr + dsts[i]``, as one delivery-complete write: one scatter, whose remote CQ data
    // is the imm with ``n`` in its upper 32 bits, so that the target counts the imm once per
    // page. The provider reports it once, and ``ctx`` with it; -EAGAIN: nothing was posted.
    int post_write_list(const WriteOp& w, const uint64_t* srcs, const uint64_t* dsts, size_t n, void* ctx) {
        if (n == 0 || n > list_pages_ || w.len == 0) return -EINVAL;
        if (dropped_unposted(ctx)) return 0;
        static_cast<OpCtx*>(ctx)->domain_peer = 0;
        std::array<iovec, kMaxListIov> iov;
        std::array<fi_rma_iov, kMaxListIov> rma;
        std::array<void*, kMaxListIov> desc;
        for (size_t i = 0; i < n; i++) {
            iov[i] = {reinterpret_cast<void*>(uintptr_t(srcs[i])), static_cast<size_t>(w.len)};
            desc[i] = w.desc;
            strict_check(iov[i].iov_base, iov[i].iov_len, desc[i], "a page of a list");
            rma[i] = {w.raddr + dsts[i], static_cast<size_t>(w.len), w.rkey};
        }
        fi_msg_rma msg{};
        msg.msg_iov = iov.data();
        msg.desc = desc.data();
        msg.iov_count = n;
        msg.addr = w.peer;
        msg.rma_iov = rma.data();
        msg.rma_iov_count = n;
        msg.context = ctx;
        msg.data = uint64_t(w.imm) | (n > 1 ? uint64_t(n) << 32 : 0);
        ssize_t rc = fi_writemsg(ep_, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE | (w.has_imm ? FI_REMOTE_CQ_DATA : 0));
        return rc == -FI_EAGAIN ? -EAGAIN : static_cast<int>(rc);
    }

    // Control messages complete on transmit, not on delivery: the contract promises a send
    // no more than that it reaches a live peer, and a delivery-complete send needs the peer's
    // answer. On shm that answer goes into one response queue per endpoint, read in order:
    // a send to a peer that died before answering blocked the completion of every later send
    // and write of this endpoint to every peer, for good (libfabric 1.17 smr_progress_resp).
    // Transmit-complete sends of at most the inject size never enter that queue.
    int post_send(const void* buf, size_t len, void* desc, uint64_t peer, void* ctx) {
        ssize_t rc = send_msg(buf, len, desc, peer, ctx, FI_COMPLETION | FI_TRANSMIT_COMPLETE);
        return rc == -FI_EAGAIN ? -EAGAIN : static_cast<int>(rc);
    }

    ssize_t send_msg(const void* buf, size_t len, void* desc, uint64_t peer, void* ctx, uint64_t flags) {
        iovec iov{const_cast<void*>(buf), len};
        void* d = desc;
        strict_check(buf, len, d, "a send");
        fi_msg msg{};
        msg.msg_iov = &iov;
        msg.desc = &d;
        msg.iov_count = 1;
        msg.addr = peer;
        msg.context = ctx;
        return fi_sendmsg(ep_, &msg, flags);
    }

    int post_recv(void* buf, size_t len, void* desc, void* ctx) {
        strict_check(buf, len, desc, "a receive");
        ssize_t rc;
        do {
            rc = fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, ctx);
            if (rc == -FI_EAGAIN) fi_cq_read(cq_, nullptr, 0);
        } while (rc == -FI_EAGAIN);
        return static_cast<int>(rc);
    }

    template <class Sink>
    size_t poll(Sink& sink) {
        size_t n = poll_cq(sink);
        if (!unmarked_.empty()) n += post_markers(sink);
        return n;
    }

  private:
    template <class Sink>
    size_t poll_cq(Sink& sink) {
        bool failed = failed_.load(std::memory_order_acquire);
        if (failed || !dropped_.empty()) {
            std::vector<void*> dropped;
            {
                std::lock_guard<std::mutex> lock(inject_mu_);
                dropped.swap(dropped_);
            }
            for (void* ctx : dropped) sink.on_error(ctx, kTransport, "NIC down (injected): dropped");
            if (!dropped.empty()) return dropped.size();
        }
        if (!refused_.empty()) {  // (reported from here, as a provider reports its errors)
            std::vector<std::pair<void*, std::string>> refused;
            refused.swap(refused_);
            for (auto& [ctx, why] : refused) sink.on_error(ctx, kRemoteAccess, why);
            return refused.size();
        }
        fi_cq_data_entry entries[64];
        fi_addr_t srcs[64];
        ssize_t got = sources_ ? fi_cq_readfrom(cq_, entries, 64, srcs) : fi_cq_read(cq_, entries, 64);
        if (got == -FI_EAGAIN) return 0;
        if (got == -FI_EAVAIL) {
            fi_cq_err_entry err{};
            if (fi_cq_readerr(cq_, &err, 0) == 1) {
                char buf[256] = {0};
                const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
                std::string message = std::string(fi_strerror(err.err)) + (detail ? std::string(" (") + detail + ")" : "");
                if (is_marker(err.op_context)) {
                    marker_done(static_cast<Marker*>(err.op_context), sink, status_of(err.err), message);
                    return 1;
                }
                if (err.err == FI_ETRUNC && (err.flags & FI_RECV)) {  // a control frame too large
                    sink.on_recv_truncated(err.op_context);
                    return 1;
                }
                unhold(err.op_context);
                sink.on_error(err.op_context, status_of(err.err), message);
            }
            return 1;
        }
        if (got < 0) return 0;
        for (ssize_t i = 0; i < got; i++) {
            const fi_cq_data_entry& e = entries[i];
            if (e.flags & FI_REMOTE_CQ_DATA) {
                uint64_t src = sources_ && srcs[i] != FI_ADDR_NOTAVAIL ? uint64_t(srcs[i]) : kNoSource;
                // a write of several pages (post_write_list) counts its imm once per page; an
                // upper half no writer of this wire protocol sends counts once
                const uint64_t pages = e.data >> 32;
                if (pages > 1 && pages <= kMaxListIov) {
                    sink.on_imms(static_cast<uint32_t>(e.data), src, static_cast<uint32_t>(pages));
                } else {
                    sink.on_imm(static_cast<uint32_t>(e.data), src);
                }
                if (!(e.flags & FI_RECV)) continue;
            }
            if (e.flags & FI_RECV) {
                sink.on_recv(e.op_context, e.len);
            } else if (e.flags & FI_SEND) {
                if (is_marker(e.op_context)) {
                    marker_done(static_cast<Marker*>(e.op_context), sink, 0, std::string());
                } else {
                    sink.on_send_done(e.op_context);
                }
            } else if (e.flags & (FI_WRITE | FI_RMA)) {
                auto* op = static_cast<OpCtx*>(e.op_context);
                if (op != nullptr && op->domain_peer != 0 && !failed) {  // sent, not yet known applied
                    PeerMarks& pm = marks_for(op->domain_peer - 1);
                    pm.waiting.push_back(op);
                    if (pm.waiting.size() == 1 && !pm.marker.out) unmarked_.push_back(op->domain_peer - 1);
                    continue;
                }
                if (op != nullptr) op->domain_peer = 0;
                unhold(e.op_context);
                if (failed) {
                    sink.on_error(e.op_context, kTransport, "NIC down (injected): acknowledgement lost");
                } else {
                    sink.on_write_done(e.op_context);
                }
            }
        }
        return static_cast<size_t>(got);
    }

    // Delivery markers (markers_). Per peer: the small writes whose injects completed and that
    // wait for a marker, and the one marker in flight with the writes it covers (everything
    // the peer was sent before it). The marker's context is the Marker itself.
    struct Marker {
        alignas(16) unsigned char provider_scratch[64];
        uint64_t peer = 0;
        bool out = false;
        std::vector<OpCtx*> covered;
    };
    struct PeerMarks {
        std::vector<OpCtx*> waiting;
        Marker marker;
    };

    PeerMarks& marks_for(uint64_t peer) {
        auto& slot = marks_[peer];
        if (!slot) {
            slot = std::make_unique<PeerMarks>();
            slot->marker.peer = peer;
        }
        return *slot;
    }

    bool is_marker(void* ctx) const { return !marker_ctxs_.empty() && marker_ctxs_.count(ctx) > 0; }

    // Posts a marker to each peer with writes waiting and none in flight; a peer whose queue
    // is full (-FI_EAGAIN) is tried again at the next poll. A marker the provider refuses
    // outright fails the writes it would have covered (whether they landed is unknown, as for
    // any write that fails).
    template <class Sink>
    size_t post_markers(Sink& sink) {
        std::vector<uint64_t> peers;
        peers.swap(unmarked_);
        size_t posted = 0;
        for (uint64_t peer : peers) {
            PeerMarks& pm = marks_for(peer);
            if (pm.marker.out || pm.waiting.empty()) continue;  // (its marker's completion comes back for them)
            ssize_t rc = send_msg(marker_frame_, sizeof(marker_frame_), marker_desc_, peer, &pm.marker,
                                  FI_COMPLETION | FI_DELIVERY_COMPLETE);
            if (rc == -FI_EAGAIN) {
                unmarked_.push_back(peer);
                continue;
            }
            if (rc != 0) {
                std::vector<OpCtx*> lost;
                lost.swap(pm.waiting);
                const int32_t status = rc == -FI_EHOSTUNREACH || rc == -FI_ECONNREFUSED || rc == -FI_ENOTCONN
                                           ? int32_t(kPeerUnreachable)
                                           : int32_t(kTransport);
                const std::string why = std::string("confirming delivery failed: ") + fi_strerror(int(-rc));
                for (OpCtx* op : lost) {
                    op->domain_peer = 0;
                    unhold(op);
                    sink.on_error(op, status, why);
                }
                posted += lost.size();
                continue;
            }
            pm.marker.out = true;
            pm.marker.covered.swap(pm.waiting);
            marker_ctxs_.insert(&pm.marker);
            posted++;
        }
        return posted;
    }

    // A marker completed (``status`` 0) or failed: the writes it covers are reported so.
    template <class Sink>
    void marker_done(Marker* m, Sink& sink, int32_t status, const std::string& message) {
        marker_ctxs_.erase(m);
        m->out = false;
        std::vector<OpCtx*> covered;
        covered.swap(m->covered);
        const bool failed = failed_.load(std::memory_order_acquire);
        for (OpCtx* op : covered) {
            op->domain_peer = 0;
            unhold(op);
            if (status != 0) {
                sink.on_error(op, status, message);
            } else if (failed) {
                sink.on_error(op, kTransport, "NIC down (injected): acknowledgement lost");
            } else {
                sink.on_write_done(op);  // (may free the op: not touched after)
            }
        }
        PeerMarks& pm = marks_for(m->peer);
        if (!pm.waiting.empty()) unmarked_.push_back(m->peer);
    }

    // A posted write has completed (or failed): the region-table hold it took is given back.
    void unhold(void* ctx) {
        if (held_.empty() || ctx == nullptr) return;
        auto* op = static_cast<OpCtx*>(ctx);
        if (op->domain_word == nullptr || op->domain_index >= held_.size() || held_[op->domain_index] != op) return;
        region_table::View::release(static_cast<std::atomic<int64_t>*>(op->domain_word));
        op->domain_word = nullptr;
        held_[op->domain_index] = held_.back();  // (order does not matter)
        held_[op->domain_index]->domain_index = op->domain_index;
        held_.pop_back();
    }

    // Keeps, of the entries fi_getinfo gave (info_), the first of the domain ``name``; none:
    // LibfabricError naming the domains there are.
    void keep_domain(const std::string& name, const std::string& provider) {
        fi_info* found = nullptr;
        std::vector<std::string> there;
        for (fi_info* e = info_; e && !found; e = e->next) {
            const char* d = e->domain_attr ? e->domain_attr->name : nullptr;
            if (d == nullptr) continue;
            if (name == d) found = e;
            else if (std::find(there.begin(), there.end(), std::string(d)) == there.end()) there.emplace_back(d);
        }
        fi_info* one = found ? fi_dupinfo(found) : nullptr;
        fi_freeinfo(info_);
        info_ = nullptr;
        if (found == nullptr) {
            std::string listed;
            for (const auto& d : there) listed += (listed.empty() ? "" : ", ") + d;
            throw LibfabricError("no domain '" + name + "' on provider " + provider + " (it has: " +
                                     (listed.empty() ? std::string("none") : listed) + ")",
                                 -FI_ENODATA);
        }
        if (one == nullptr) throw std::bad_alloc();
        info_ = one;
    }

    // (strict_mr) Records the registration ``mr`` of [ptr, ptr + len); its record is the
    // descriptor handed out. Records stay until the domain closes, so that a descriptor of a
    // closed registration is still told apart.
    void* strict_record(fid_mr* mr, const void* ptr, size_t len, void* desc) {
        auto r = std::make_unique<StrictMr>();
        r->lo = reinterpret_cast<uintptr_t>(ptr);
        r->hi = r->lo + len;
        r->desc = desc;
        StrictMr* raw = r.get();
        std::lock_guard<std::mutex> lock(strict_mu_);
        strict_records_.emplace(raw, std::move(r));
        strict_by_mr_[mr] = raw;
        return raw;
    }

    void strict_forget(fid_mr* mr) {
        std::lock_guard<std::mutex> lock(strict_mu_);
        auto it = strict_by_mr_.find(mr);
        if (it == strict_by_mr_.end()) return;
        it->second->live = false;
        strict_by_mr_.erase(it);
    }

    void close() {
        if (ep_) fi_close(&ep_->fid);
        for (OpCtx* op : held_) {  // never to be reported
            region_table::View::release(static_cast<std::atomic<int64_t>*>(op->domain_word));
            op->domain_word = nullptr;
        }
        held_.clear();
        marks_.clear();  // (writes held back there are never reported, as those held above)
        marker_ctxs_.clear();
        unmarked_.clear();
        views_.clear();
        views_by_name_.clear();
        table_.reset();
        for (auto* mr : local_mrs_) fi_close(&mr->fid);
        local_mrs_.clear();
        if (cq_) fi_close(&cq_->fid);
        if (av_) fi_close(&av_->fid);
        if (domain_) fi_close(&domain_->fid);
        if (fabric_) fi_close(&fabric_->fid);
        if (info_) fi_freeinfo(info_);
        ep_ = nullptr;
        cq_ = nullptr;
        av_ = nullptr;
        domain_ = nullptr;
        fabric_ = nullptr;
        info_ = nullptr;
    }

    fi_info* info_ = nullptr;
    fid_fabric* fabric_ = nullptr;
    fid_domain* domain_ = nullptr;
    fid_av* av_ = nullptr;
    fid_cq* cq_ = nullptr;
    fid_ep* ep_ = nullptr;
    std::mutex av_mu_;
    bool shm_ = false;  // the shm provider (see remove_peer)
    bool stale_peers_ = false;  // connections over rxm (see stale_peers)
    bool sources_ = false;  // FI_SOURCE: completions name their source
    std::atomic<bool> failed_{false};  // inject_failure
    std::mutex inject_mu_;
    uint64_t inject_rng_ = 0;
    std::vector<void*> dropped_;
    std::string address_;
    std::vector<fid_mr*> local_mrs_;
    uint32_t index_ = 0;  // which of its group's NICs (messages)
    // shm (fabric/region_table.hpp): this endpoint's table; the peers' tables, by address-vector
    // handle (null: none, posted unchecked) and by address; the writes posted holding an entry
    // of one (the hold in their OpCtx::domain_word); writes refused before posting, reported
    // by the next poll. Views, holds and refusals are touched under the engine's progress lock.
    std::unique_ptr<region_table::Owner> table_;
    std::unordered_map<std::string, std::shared_ptr<region_table::View>> views_by_name_;
    std::vector<std::shared_ptr<region_table::View>> views_;
    std::vector<OpCtx*> held_;  // each at its domain_index
    std::vector<std::pair<void*, std::string>> refused_;
    static constexpr uint64_t kLocalKeyBase = uint64_t(1) << 48;
    // Delivery markers for small writes on shm (see the end of the constructor; touched under
    // the engine's progress lock): the peers with writes waiting for one, and those in flight.
    bool markers_ = false;
    size_t inject_size_ = 0;
    std::unordered_map<uint64_t, std::unique_ptr<PeerMarks>> marks_;
    std::vector<uint64_t> unmarked_;
    std::unordered_set<void*> marker_ctxs_;  // the markers in flight (their contexts)
    char marker_frame_[3] = {kWireByte, kFrameDeliveryMarker, 0};  // (Engine::got_message ignores it)
    void* marker_desc_ = nullptr;  // its registration where the provider wants one (FI_MR_LOCAL)
    // what a zero-length write names (post_write), and its registration where wanted
    char zero_src_[8] = {};
    void* zero_desc_ = nullptr;
    // strict_mr: the records handed out as descriptors (by record, and the live ones by
    // registration); taken by registering threads and by whoever posts
    bool strict_mr_ = false;
    size_t eager_max_ = 0;  // eager_write_max()
    static constexpr size_t kMaxListIov = 8;  // pages a list write carries at most (any provider)
    size_t list_pages_ = 0;                   // list_pages()
    mutable std::mutex strict_mu_;
    std::unordered_map<const void*, std::unique_ptr<StrictMr>> strict_records_;
    std::unordered_map<fid_mr*, StrictMr*> strict_by_mr_;
};

}  // namespace fabric::efa
