// The Python binding of the engine core, shared by every compiled backend.
//
// PyEngine<Domain> owns an Engine<Domain> (fabric/engine.hpp) and everything the Python side
// of a backend (a fabric_core.base.EngineBase subclass) calls: memory registration on every
// NIC, the submit fast path (fabric/pyfast.hpp), planned submissions from
// fabric_core.plan_request, control messages, completion batches, statistics and close. A
// backend's module derives from it to open its domains and add what is its own (provider
// details), and calls bind_engine() for the shared methods, so fabric-efa and fabric-verbs
// run the same binding code over different Domains.
//
// Beyond the engine core's Domain concept, a Domain here provides
//   using Mr = ...;                                    // a registration's handle
//   Mr register_memory(void* ptr, size_t len, uint64_t requested_key, bool remote_write,
//                      uint64_t& key, void*& desc);    // remote key and local descriptor out
//   void deregister_memory(Mr);
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "counters.hpp"
#include "engine.hpp"
#include "pycounters.hpp"
#include "pyfast.hpp"
#include "pyfastcall.hpp"

namespace fabric {

namespace py = pybind11;

template <class Mr>
struct Registration {
    std::vector<Mr> mrs;
    std::vector<void*> descs;
    std::vector<uint64_t> keys;
    uint64_t ptr = 0;
    uint64_t len = 0;
    uint64_t region_handle = 0;  // the MemoryRegion's handle, once bound to the fast path
};

constexpr py::ssize_t kReleaseGilOps = 256;

using TargetSpec = std::tuple<std::vector<py::bytes>, std::vector<uint64_t>, uint64_t>;

template <class Domain>
class PyEngine {
  public:
    using Mr = typename Domain::Mr;

    PyEngine(std::vector<std::unique_ptr<Domain>> domains, std::optional<uint64_t> chaos_seed, int cpu,
             size_t recv_depth, size_t max_send) {
        for (auto& d : domains) addresses_.push_back(d->address());
        engine_ = std::make_unique<Engine<Domain>>(std::move(domains), counters_, chaos_seed.value_or(0),
                                                   chaos_seed.has_value(), cpu, recv_depth, max_send);
    }

    virtual ~PyEngine() {
        close(kDestroyJoinS);
        if (wedged_) (void)engine_.release();  // see destroy()
    }
    PyEngine(const PyEngine&) = delete;
    PyEngine& operator=(const PyEngine&) = delete;

    // The imm counter table the worker fills (it outlives the engine: waits after close fail).
    std::shared_ptr<CounterTable> counters() const { return counters_; }

    std::vector<py::bytes> addresses() const {
        std::vector<py::bytes> out;
        for (auto& a : addresses_) out.emplace_back(a);
        return out;
    }

    std::pair<uint64_t, std::vector<uint64_t>> register_memory(uint64_t ptr, uint64_t len, bool remote_write) {
        check_open();
        Registration<Mr> reg;
        reg.ptr = ptr;
        reg.len = len;
        uint64_t handle = next_handle_++;
        try {
            for (size_t n = 0; n < engine_->num_nics(); n++) {
                uint64_t key = 0;
                void* desc = nullptr;
                Mr mr = engine_->nic(n).register_memory(reinterpret_cast<void*>(ptr), len, handle, remote_write, key,
                                                        desc);
                reg.mrs.push_back(mr);
                reg.descs.push_back(desc);
                reg.keys.push_back(key);
            }
        } catch (...) {
            for (size_t n = 0; n < reg.mrs.size(); n++) engine_->nic(n).deregister_memory(reg.mrs[n]);
            throw;
        }
        std::vector<uint64_t> keys = reg.keys;
        for (size_t n = 0; n < keys.size(); n++)  // what a writer the transport failed may ask of
            engine_->note_region(static_cast<uint32_t>(n), keys[n], ptr, len, remote_write);
        std::lock_guard<std::mutex> lock(mu_);
        regs_.emplace(handle, std::move(reg));
        return {handle, keys};
    }

    void deregister(uint64_t handle) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = regs_.find(handle);
        if (it == regs_.end()) return;  // (a wedged engine's are all gone: see close())
        if (fast_ && it->second.region_handle != 0) fast_->drop_region(it->second.region_handle);
        release(it->second);
        regs_.erase(it);
    }

    // --- the fast path (fabric/pyfast.hpp) ------------------------------------------------
    void configure_fast(uint64_t max_msg, py::object sharded, py::object pinned, py::object shard_peers,
                        py::object descriptor, py::object scatter_target, bool guarded) {
        fast_ = std::make_shared<fast::FastPlanner>(
            engine_->num_nics(), max_msg,
            fast::Classes{std::move(sharded), std::move(pinned), std::move(shard_peers), std::move(descriptor),
                          std::move(scatter_target)},
            guarded);
        fast_->set_lists([this](uint64_t rkey) { return engine_ ? engine_->list_pages(rkey) : size_t(0); });
    }

    // The MemoryRegion made for registration ``token``: requests naming it may take the fast path.
    void bind_region(uint64_t token, uint64_t region_handle, py::object region) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = regs_.find(token);
        if (it == regs_.end() || !fast_) return;
        it->second.region_handle = region_handle;
        fast_->add_region(region_handle, std::move(region), it->second.ptr, it->second.len, it->second.descs);
    }

    // How the fast path makes its transfers (fast::TransferMaker): copies of ``prototype``
    // with the ``fresh`` fields made anew, entered in ``inflight`` (id -> transfer).
    void configure_transfers(py::handle prototype, const py::dict& fresh, py::dict inflight) {
        maker_ = std::make_shared<fast::TransferMaker>(prototype, fresh, std::move(inflight));
    }

    // Each returns the submitted request's Transfer, in the in-flight table before the engine
    // can complete it, or None: take the Python path (nothing was made or submitted).
    py::object fast_write(py::handle src, py::handle src_offset, py::handle length, py::handle dst,
                          py::handle dst_offset, py::handle imm, py::handle routing, double timeout_s) {
        return fast_submit(timeout_s, [&](fast::FastPlanner& p, uint64_t id, py::object&) {
            return p.write(id, src.ptr(), src_offset.ptr(), length.ptr(), dst.ptr(), dst_offset.ptr(), imm.ptr(),
                           routing.ptr(), rotation_);
        });
    }

    py::object fast_paged(py::handle src, py::handle src_pages, py::handle src_stride, py::handle dst,
                          py::handle dst_pages, py::handle dst_stride, py::handle page_length, py::handle src_offset,
                          py::handle dst_offset, py::handle imm, py::handle routing, double timeout_s) {
        return fast_submit(timeout_s, [&](fast::FastPlanner& p, uint64_t id, py::object&) {
            return p.paged(id, src.ptr(), src_pages.ptr(), src_stride.ptr(), dst.ptr(), dst_pages.ptr(),
                           dst_stride.ptr(), page_length.ptr(), src_offset.ptr(), dst_offset.ptr(), imm.ptr(),
                           routing.ptr(), rotation_);
        });
    }

    py::object fast_imm(py::handle dst, py::handle imm, py::handle routing, double timeout_s) {
        return fast_submit(timeout_s, [&](fast::FastPlanner& p, uint64_t id, py::object&) {
            return p.imm_only(id, dst.ptr(), imm.ptr(), routing.ptr(), rotation_);
        });
    }

    // ``members``: the peer group's member set, or None. The transfer's imms_per_target has
    // one entry per target.
    py::object fast_scatter(py::handle src, py::handle targets, py::handle imm, py::handle routing,
                            py::handle members, double timeout_s) {
        return fast_submit(timeout_s, [&](fast::FastPlanner& p, uint64_t id, py::object& imms) {
            std::vector<int64_t> per_target;
            auto req = p.scatter(id, src.ptr(), targets.ptr(), imm.ptr(), routing.ptr(), members.ptr(), rotation_,
                                 per_target);
            if (req) {
                py::tuple t(per_target.size());
                for (size_t i = 0; i < per_target.size(); i++) t[i] = py::int_(per_target[i]);
                imms = std::move(t);
            }
            return req;
        });
    }

    uint64_t fast_submitted() const { return fast_submitted_; }

    // What the fast path would post for ``kind`` ("write", "paged", "imm", "scatter": src,
    // targets, imm, routing, members) with ``args`` (the fast_* arguments before the
    // timeout) at ``rotation``, without posting or making a transfer: None where it defers
    // to plan_request, else (nic, target, src, dst_off, length) arrays, src as an address.
    py::object plan_only(const std::string& kind, py::tuple args, uint64_t rotation) {
        auto planner = fast_;
        if (!planner) return py::none();
        auto at = [&](size_t i) { return args[i].ptr(); };
        std::unique_ptr<Request> req;
        if (kind == "write" && args.size() == 7) {
            req = planner->write(0, at(0), at(1), at(2), at(3), at(4), at(5), at(6), rotation);
        } else if (kind == "paged" && args.size() == 11) {
            req = planner->paged(0, at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10),
                                 rotation);
        } else if (kind == "imm" && args.size() == 3) {
            req = planner->imm_only(0, at(0), at(1), at(2), rotation);
        } else if (kind == "scatter" && args.size() == 5) {
            std::vector<int64_t> per_target;
            req = planner->scatter(0, at(0), at(1), at(2), at(3), at(4), rotation, per_target);
        } else {
            throw std::invalid_argument("plan_only: unknown kind or wrong number of arguments");
        }
        if (!req) return py::none();
        auto n = static_cast<py::ssize_t>(req->wrs());
        py::array_t<int64_t> nic(n), target(n), src(n), dst(n), len(n);
        py::ssize_t i = 0;
        for (const auto& op : req->ops) {
            for (uint64_t k = 0; k < op_wrs(op); k++, i++) {  // a list op: its pages, one by one
                nic.mutable_at(i) = op.nic;
                target.mutable_at(i) = op.target;
                src.mutable_at(i) = static_cast<int64_t>(op.pages ? req->list_src[op.first_page + k] : op.src);
                dst.mutable_at(i) = static_cast<int64_t>(op.pages ? req->list_dst[op.first_page + k] : op.dst_off);
                len.mutable_at(i) = static_cast<int64_t>(op.len);
            }
        }
        return py::make_tuple(nic, target, src, dst, len);
    }

    void submit_write(uint64_t id, uint64_t src_handle, uint64_t src_base, py::array_t<int64_t> nic,
                      py::array_t<int64_t> target, py::array_t<int64_t> src_off, py::array_t<int64_t> dst_off,
                      py::array_t<int64_t> length, int64_t imm, const std::vector<TargetSpec>& targets,
                      double timeout_s) {
        check_open();
        auto req = std::make_unique<Request>();
        req->id = id;
        req->timeout_s = timeout_s;
        req->has_imm = imm >= 0;
        req->imm = static_cast<uint32_t>(imm >= 0 ? imm : 0);
        if (src_handle != 0) {  // imm-only writes and barriers carry no source
            std::lock_guard<std::mutex> lock(mu_);
            auto it = regs_.find(src_handle);
            if (it == regs_.end()) throw std::invalid_argument("source registration is gone");
            req->src_desc = std::make_shared<const std::vector<void*>>(it->second.descs);
        }
        for (const auto& [addrs, keys, base] : targets) {
            auto t = std::make_shared<Target>();
            for (const auto& a : addrs) t->addresses.emplace_back(a);
            t->rkeys = keys;
            t->remote_base = base;
            req->targets.push_back(std::move(t));
        }
        auto n = nic.unchecked<1>();
        auto tg = target.unchecked<1>();
        auto so = src_off.unchecked<1>();
        auto dof = dst_off.unchecked<1>();
        auto ln = length.unchecked<1>();
        py::ssize_t count = n.shape(0);
        {
            // Releasing the GIL costs more than a short plan's work (and hands the GIL to the
            // completion thread mid-call): release it only for large plans.
            std::optional<py::gil_scoped_release> release;
            if (count >= kReleaseGilOps) release.emplace();
            req->ops.resize(static_cast<size_t>(count));
            for (py::ssize_t i = 0; i < count; i++) {
                OpCtx& op = req->ops[static_cast<size_t>(i)];
                op.nic = static_cast<uint32_t>(n(i));
                op.target = static_cast<uint32_t>(tg(i));
                op.src = src_base + static_cast<uint64_t>(so(i));
                op.dst_off = static_cast<uint64_t>(dof(i));
                op.len = static_cast<uint64_t>(ln(i));
            }
            if (release)
                engine_->submit(std::move(req));
            else
                submit_outside_gil(std::move(req));
        }
    }

    void submit_send(uint64_t id, py::bytes address, py::bytes payload, double timeout_s) {
        submit_to(id, address, payload, false, timeout_s);
    }

    // Resolves a peer on the worker (which owns the address cache); completes like a transfer.
    void check_peer(uint64_t id, py::bytes address) { submit_to(id, address, py::bytes(), true, -1); }

    // (ids completed successfully, (id, status, message) of failed ones, tokens of counter
    // waiters the imms fired, messages)
    py::tuple wait_batch(double timeout_s) {
        Batch b;
        {
            py::gil_scoped_release release;
            b = engine_->wait_batch(timeout_s);
        }
        return to_python(b);
    }

    // The completion thread is done with the non-empty batch wait_batch() gave it.
    void batch_done() {
        if (engine_) engine_->batch_done();
    }

    // (ok, failed, fired, messages) like wait_batch, taken by a thread that waits on a transfer
    // and runs progress itself meanwhile (Engine::drain).
    py::tuple drain(double timeout_s) {
        Batch b;
        {
            py::gil_scoped_release release;
            b = engine_->drain(timeout_s);
        }
        return to_python(b);
    }

    py::dict stats() const {
        auto s = engine_ ? engine_->stats() : final_stats_;
        py::dict d;
        d["posted"] = s.posted;
        d["completed_wrs"] = s.completed_wrs;
        d["bytes_written"] = s.bytes_written;
        d["eagain"] = s.eagain;
        d["probes"] = s.probes;
        d["peers_lost"] = s.peers_lost;
        d["timeouts"] = s.timeouts;
        d["retries"] = s.retries;
        d["reconciled"] = s.reconciled;
        d["landed_unacked"] = s.landed_unacked;
        d["makeups"] = s.makeups;
        d["unreconciled"] = s.unreconciled;
        d["eager_writes"] = s.eager_writes;
        d["eager_landed"] = s.eager_landed;
        d["frames_truncated"] = s.frames_truncated;
        d["frames_foreign"] = s.frames_foreign;
        d["list_ops"] = s.list_ops;
        return d;
    }

    // Per NIC: (work requests, bytes, errors, retries, in flight, imms received).
    std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>> nic_stats() const {
        std::vector<std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>> out;
        for (const auto& t : engine_ ? engine_->nic_traffic() : final_nics_)
            out.emplace_back(t.wrs, t.bytes, t.errors, t.retries, t.inflight, t.imms);
        return out;
    }

    // Per peer written to: (NIC 0 address, work requests, bytes, errors, in flight).
    std::vector<std::tuple<py::bytes, uint64_t, uint64_t, uint64_t, uint64_t>> peer_stats() {
        std::vector<PeerTrafficView> views;
        if (engine_ && !wedged_) {  // (a wedged engine's progress lock may never come free)
            py::gil_scoped_release release;
            views = engine_->peer_traffic();
        } else {
            views = final_peers_;
        }
        std::vector<std::tuple<py::bytes, uint64_t, uint64_t, uint64_t, uint64_t>> out;
        for (const auto& v : views) out.emplace_back(py::bytes(v.address), v.wrs, v.bytes, v.errors, v.inflight);
        return out;
    }

    // See Engine::cancel: (whether it was running, the peers it was writing to).
    // Throws RuntimeError if the engine's progress lock stays taken ``timeout_s`` (wedged).
    std::pair<bool, std::vector<py::bytes>> cancel(uint64_t id, double timeout_s) {
        if (!engine_ || closed_) return {false, {}};
        std::vector<std::string> peers;
        bool running;
        {
            py::gil_scoped_release release;
            running = engine_->cancel(id, peers, timeout_s);
        }
        return {running, std::vector<py::bytes>(peers.begin(), peers.end())};
    }

    // See Engine::fence: the peers that did not answer in time.
    std::vector<py::bytes> fence(const std::vector<py::bytes>& addresses, double timeout_s) {
        check_open();
        std::vector<std::string> a(addresses.begin(), addresses.end()), left;
        {
            py::gil_scoped_release release;
            left = engine_->fence(a, timeout_s);
        }
        return std::vector<py::bytes>(left.begin(), left.end());
    }

    // See Engine::probe_peer.
    void probe_peer(py::bytes address) {
        if (engine_ && !closed_) engine_->probe_peer(std::string(address));
    }

    // See Engine::speak_wire (tests of mixed fabric releases).
    void speak_wire(int version) {
        check_open();
        if (version < 0 || version > 0xff) throw py::value_error("a wire byte is 0..255");
        engine_->speak_wire(static_cast<uint8_t>(version));
    }

    // See Engine::configure_liveness.
    void configure_liveness(double interval_s, double timeout_s, double transfer_timeout_s) {
        check_open();
        engine_->configure_liveness(interval_s, timeout_s, transfer_timeout_s);
    }

    // See Engine::configure_queue.
    void configure_queue(uint64_t per_peer_and_nic, uint64_t bytes_per_peer_and_nic) {
        check_open();
        engine_->configure_queue(per_peer_and_nic, bytes_per_peer_and_nic);
    }

    // What is outstanding in the engine core (Engine::dump), as plain data.
    py::dict dump_state() {
        py::dict d;
        py::list requests, peers;
        if (engine_ && !closed_) {
            EngineDump e;
            {
                py::gil_scoped_release release;
                e = engine_->dump();
            }
            for (auto& r : e.requests) {
                py::dict v;
                v["id"] = r.id;
                v["age_s"] = r.age_s;
                v["deadline_in_s"] = r.deadline_in_s < 0 ? py::object(py::none()) : py::object(py::float_(r.deadline_in_s));
                v["work_requests"] = r.ops;
                v["outstanding"] = r.left;
                v["unposted"] = r.unposted;
                v["outstanding_per_nic"] = r.left_per_nic;
                py::list ps;
                for (auto& p : r.peers) ps.append(py::bytes(p));
                v["peers"] = ps;
                v["imm"] = r.has_imm ? py::object(py::int_(r.imm)) : py::object(py::none());
                v["failed_early"] = r.abandoned;
                requests.append(v);
            }
            for (auto& p : e.peers) {
                py::dict v;
                v["address"] = py::bytes(p.address);
                v["heard_s_ago"] = p.heard_s_ago < 0 ? py::object(py::none()) : py::object(py::float_(p.heard_s_ago));
                v["probe_outstanding_s"] =
                    p.probe_out_s < 0 ? py::object(py::none()) : py::object(py::float_(p.probe_out_s));
                v["probes"] = p.probes;
                v["lost"] = p.lost;
                v["session"] = p.session;
                v["down_nics"] = p.down_nics;
                peers.append(v);
            }
            py::list checks;
            for (auto& c : e.access_checks) {
                py::dict v;
                v["peer"] = py::bytes(c.peer);
                v["nic"] = c.nic;
                v["key"] = c.key;
                v["age_s"] = c.age_s;
                v["writes_held"] = c.writes;
                checks.append(v);
            }
            d["access_checks"] = checks;
            py::list foreign;
            for (auto& [address, wire] : e.foreign) {
                py::dict v;
                v["address"] = py::bytes(address);
                v["wire"] = wire_text(wire);
                foreign.append(v);
            }
            d["foreign_peers"] = foreign;
            if (e.progress_stuck_s >= 0) d["progress_stuck_s"] = e.progress_stuck_s;
            d["inflight_work_requests"] = e.inflight_wrs;
            d["unposted_per_nic"] = e.unposted_per_nic;
            d["pokes_sent"] = e.pokes_sent;
            d["paths_cut"] = e.paths_cut;
            d["eager_waiting"] = e.eager_waiting;
            d["acks_due"] = e.acks_due;
            d["imms_without_source"] = e.imms_without_source;
            d["imms_unattributed"] = e.imms_unattributed;
            d["counter_spinners"] = e.counter_spinners;
            d["drainers"] = e.drainers;
            d["worker_deferring"] = e.worker_deferring;
            d["spinner_wakes"] = e.spinner_wakes;
            d["worker_naps"] = e.worker_naps;
            d["worker_yields"] = e.worker_yields;
            d["lone_yields"] = e.lone_yields;
            d["provider_steps"] = e.provider_steps;
        }
        d["requests"] = requests;
        d["peers"] = peers;
        return d;
    }

    // Idempotent and safe from several threads: a second caller (destroy() on another thread,
    // say) waits, GIL released, until the first is done with the engine. Waits for the
    // engine's threads at most ``join_timeout_s`` (negative: for ever) and returns false if one
    // is stuck inside the provider (Engine::close: the engine is wedged). A wedged engine's
    // registrations are not released and the engine is not destroyed (destroy() leaks it):
    // the stuck call may still use them, and the process can exit.
    bool close(double join_timeout_s = -1.0) {
        std::unique_lock<std::mutex> closing(close_mu_, std::defer_lock);
        {
            py::gil_scoped_release release;
            closing.lock();
        }
        if (!engine_ || closed_) return !wedged_;
        closed_ = true;
        {
            py::gil_scoped_release release;
            wedged_ = !engine_->close(join_timeout_s);
        }
        // (a fast call under way holds its own: see fast_submit) The maker's prototype holds the
        // Python engine's hooks, a reference cycle through this object.
        fast_.reset();
        maker_.reset();
        std::lock_guard<std::mutex> lock(mu_);
        if (!wedged_)
            for (auto& [h, reg] : regs_) release(reg);
        regs_.clear();
        return !wedged_;
    }

    void destroy() {
        close(kDestroyJoinS);
        if (!engine_) return;
        {
            // a submit that released the GIL (submit_outside_gil) may still be inside the
            // engine; one that stays there is inside the provider: the engine is wedged
            py::gil_scoped_release release;
            auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kDestroyJoinS);
            while (submitting_.load(std::memory_order_seq_cst) > 0 && std::chrono::steady_clock::now() < deadline)
                std::this_thread::sleep_for(std::chrono::microseconds(100));
            if (submitting_.load(std::memory_order_seq_cst) > 0) wedged_ = true;
        }
        final_stats_ = engine_->stats();
        final_nics_ = engine_->nic_traffic();
        if (wedged_) {
            (void)engine_.release();  // leaked on purpose: a thread may return into it (close())
            return;
        }
        py::gil_scoped_release release;
        final_peers_ = engine_->peer_traffic();
        engine_.reset();
    }

    bool wedged() const { return wedged_; }

    // When the engine's current progress step began (steady-clock ticks; 0: none runs; see
    // Engine::progress_since). Lock-free, so the GIL is kept: the completion thread asks it
    // every time it finds nothing to hand over (NativeEngine._watch).
    int64_t progress_since() const { return !closed_ && engine_ ? engine_->progress_since() : 0; }

  protected:
    Engine<Domain>& engine() { return *engine_; }

  private:
    static py::tuple to_python(Batch& b) {
        py::list ok, failed, messages;
        for (auto& c : b.done) {
            if (c.status == kOk) {
                ok.append(py::int_(c.id));
            } else {
                failed.append(py::make_tuple(c.id, c.status, c.message, py::bytes(c.peer), c.nic));
            }
        }
        for (auto& m : b.messages) messages.append(py::bytes(m));
        py::list lost, revived;
        for (auto& [peer, why, status] : b.lost) lost.append(py::make_tuple(py::bytes(peer), why, status));
        for (auto& a : b.revived) revived.append(py::bytes(a));
        return py::make_tuple(ok, failed, py::cast(b.fired), messages, lost, revived);
    }

    void release(Registration<Mr>& reg) {
        for (size_t n = 0; n < reg.keys.size(); n++) engine_->forget_region(static_cast<uint32_t>(n), reg.keys[n]);
        for (size_t n = 0; n < reg.mrs.size(); n++) engine_->nic(n).deregister_memory(reg.mrs[n]);
        reg.mrs.clear();
    }

    // The fast path's submit: ``plan(planner, id, imms)`` plans the request (null: take the
    // Python path) and may set ``imms``, the transfer's imms_per_target (else it is (the imms
    // its one target counts,)). The Transfer is made and in the in-flight table before the
    // engine has the request, since a submit that posts inline releases the GIL, and the
    // completion thread may then take the completion.
    // Python code can run inside a fast call (an attribute the planner reads, a finalizer
    // that an allocation's collection runs), and another thread with it: one that closes
    // this engine drops fast_ and maker_, which each call therefore holds for itself. An
    // engine that closed meanwhile gets nothing: the caller takes the Python path, which
    // raises EngineClosed.
    template <class Plan>
    py::object fast_submit(double timeout_s, Plan&& plan) {
        auto planner = fast_;
        auto maker = maker_;
        if (closed_ || !planner || !maker) return py::none();
        uint64_t id;
        py::object id_obj = maker->next_id(id);
        py::object imms;
        std::unique_ptr<Request> req = plan(*planner, id, imms);
        if (!req || closed_) return py::none();
        req->timeout_s = timeout_s;
        if (!imms) imms = py::make_tuple(req->has_imm ? static_cast<int64_t>(req->wrs()) : 0);
        py::object transfer = maker->make(id_obj, std::move(imms));
        if (closed_) {
            maker->forget(id_obj);
            return py::none();
        }
        rotation_++;
        fast_submitted_++;
        submit_outside_gil(std::move(req));
        return transfer;
    }

    // Submits with the GIL held, except that a request the engine would post from this
    // thread (its worker naps) is posted with the GIL released: a provider call may block (on
    // shm, spin on a peer's lock; forever if the peer died holding it), and the GIL held
    // through it stopped every Python thread of the process, bounded waits included. The
    // push alone is O(1) and lock-free: releasing the GIL for it costs more than it does.
    // While the GIL is released another thread may close and destroy this engine: destroy()
    // waits until no submit is inside the engine (``submitting_``) before freeing it.
    void submit_outside_gil(std::unique_ptr<Request> req) {
        if (engine_->would_post_inline(req->wrs())) {
            submitting_.fetch_add(1, std::memory_order_seq_cst);
            py::gil_scoped_release release;
            engine_->submit(std::move(req));
            submitting_.fetch_sub(1, std::memory_order_seq_cst);
        } else {
            engine_->submit(std::move(req), /*inline_ok=*/false);
        }
    }

    // A request naming one peer (a control message, or a resolution): see submit_outside_gil.
    void submit_to(uint64_t id, const py::bytes& address, const py::bytes& payload, bool resolve_only,
                   double timeout_s) {
        check_open();
        auto req = std::make_unique<Request>();
        req->id = id;
        req->timeout_s = timeout_s;
        req->send_to = address;
        req->payload = payload;
        req->resolve_only = resolve_only;
        submit_outside_gil(std::move(req));
    }

    void check_open() const {
        if (closed_) throw std::runtime_error("engine is closed");
    }

    std::vector<std::string> addresses_;
    std::shared_ptr<CounterTable> counters_ = std::make_shared<CounterTable>();
    std::unique_ptr<Engine<Domain>> engine_;
    std::mutex mu_;
    std::mutex close_mu_;
    std::unordered_map<uint64_t, Registration<Mr>> regs_;
    uint64_t next_handle_ = 1;
    bool closed_ = false;
    bool wedged_ = false;  // close() left a thread inside the provider: the engine is leaked
    std::atomic<int> submitting_{0};  // submits inside the engine with the GIL released
    // destroy() without an earlier close(): how long it waits for the engine's threads
    static constexpr double kDestroyJoinS = 10.0;
    EngineStats final_stats_;  // what stats() reports once the engine is destroyed
    std::vector<NicTrafficView> final_nics_;    // and nic_stats()
    std::vector<PeerTrafficView> final_peers_;  // and peer_stats()
    std::shared_ptr<fast::FastPlanner> fast_;     // guarded by the GIL; null once closed
    std::shared_ptr<fast::TransferMaker> maker_;  // guarded by the GIL; null once closed
    uint64_t rotation_ = 0;                           // guarded by the GIL
    uint64_t fast_submitted_ = 0;                     // guarded by the GIL
};

// fast_write and fast_imm, the calls on the path of every small transfer, as METH_FASTCALL
// methods (pyfastcall.hpp). Positional arguments only, as NativeEngine passes them; the
// timeout last, a float.
template <class Cls>
struct FastCalls {
    static PyObject* write(PyObject* self, PyObject* const* a, Py_ssize_t n) {
        return fastcall::call<Cls>(self, a, n, 8, "fast_write", [a](Cls& e, double t) {
            return e.fast_write(a[0], a[1], a[2], a[3], a[4], a[5], a[6], t);
        });
    }
    static PyObject* imm(PyObject* self, PyObject* const* a, Py_ssize_t n) {
        return fastcall::call<Cls>(self, a, n, 4, "fast_imm",
                                   [a](Cls& e, double t) { return e.fast_imm(a[0], a[1], a[2], t); });
    }

    static void add(py::handle cls) {
        static PyMethodDef defs[] = {
            {"fast_write", fastcall::method(&write), METH_FASTCALL,
             "fast_write($self, src, src_offset, length, dst, dst_offset, imm, routing, timeout_s, /)\n--\n\n"
             "Plans and submits a plain write: its Transfer, or None for the Python path."},
            {"fast_imm", fastcall::method(&imm), METH_FASTCALL,
             "fast_imm($self, dst, imm, routing, timeout_s, /)\n--\n\n"
             "Plans and submits a plain imm: its Transfer, or None for the Python path."},
        };
        fastcall::add(cls, defs);
    }
};

// Defines the shared methods of a PyEngine<Domain> subclass ``Cls`` on its Python class.
template <class Cls, class... Options>
void bind_engine(py::class_<Cls, Options...>& c) {
    FastCalls<Cls>::add(c);
    c.def("addresses", &Cls::addresses)
        .def("counters", &Cls::counters)
        .def("register_memory", &Cls::register_memory, py::arg("ptr"), py::arg("length"), py::arg("remote_write"))
        .def("deregister", &Cls::deregister, py::arg("handle"))
        .def("submit_write", &Cls::submit_write, py::arg("id"), py::arg("src_handle"), py::arg("src_base"),
             py::arg("nic"), py::arg("target"), py::arg("src_off"), py::arg("dst_off"), py::arg("length"),
             py::arg("imm"), py::arg("targets"), py::arg("timeout_s") = -1.0)
        .def("submit_send", &Cls::submit_send, py::arg("id"), py::arg("address"), py::arg("payload"),
             py::arg("timeout_s") = -1.0)
        .def("check_peer", &Cls::check_peer, py::arg("id"), py::arg("address"))
        .def("wait_batch", &Cls::wait_batch, py::arg("timeout_s"))
        .def("drain", &Cls::drain, py::arg("timeout_s"))
        .def("batch_done", &Cls::batch_done)
        .def("configure_fast", &Cls::configure_fast, py::arg("max_msg"), py::arg("sharded"), py::arg("pinned"),
             py::arg("shard_peers"), py::arg("descriptor"), py::arg("scatter_target"), py::arg("guarded"))
        .def("bind_region", &Cls::bind_region, py::arg("token"), py::arg("region_handle"), py::arg("region"))
        .def("configure_transfers", &Cls::configure_transfers, py::arg("prototype"), py::arg("fresh"),
             py::arg("inflight"))
        .def("fast_paged", &Cls::fast_paged, py::arg("src"), py::arg("src_pages"), py::arg("src_stride"),
             py::arg("dst"), py::arg("dst_pages"), py::arg("dst_stride"), py::arg("page_length"),
             py::arg("src_offset"), py::arg("dst_offset"), py::arg("imm"), py::arg("routing"),
             py::arg("timeout_s") = -1.0)
        .def("fast_scatter", &Cls::fast_scatter, py::arg("src"), py::arg("targets"), py::arg("imm"),
             py::arg("routing"), py::arg("members"), py::arg("timeout_s") = -1.0)
        .def("fast_submitted", &Cls::fast_submitted)
        .def("plan_only", &Cls::plan_only, py::arg("kind"), py::arg("args"), py::arg("rotation"))
        .def("stats", &Cls::stats)
        .def("nic_stats", &Cls::nic_stats)
        .def("peer_stats", &Cls::peer_stats)
        .def("configure_liveness", &Cls::configure_liveness, py::arg("interval_s"), py::arg("timeout_s"),
             py::arg("transfer_timeout_s"))
        .def("configure_queue", &Cls::configure_queue, py::arg("per_peer_and_nic"),
             py::arg("bytes_per_peer_and_nic") = 0)
        .def("dump_state", &Cls::dump_state)
        .def("probe_peer", &Cls::probe_peer, py::arg("address"))
        .def("_speak_wire", &Cls::speak_wire, py::arg("wire_byte"))
        .def("fence", &Cls::fence, py::arg("addresses"), py::arg("timeout_s"))
        .def("cancel", &Cls::cancel, py::arg("id"), py::arg("timeout_s") = -1.0)
        .def("close", &Cls::close, py::arg("join_timeout_s") = -1.0)
        .def("wedged", &Cls::wedged)
        .def("progress_since", &Cls::progress_since)
        .def("destroy", &Cls::destroy);
}

}  // namespace fabric
