// The compiled backends' submit fast path: a Python request in, a planned Request and its
// Transfer out, with no Python code run on the way.
//
// FastPlanner reads the request's attributes through the C API, checks them against its own
// tables (registered source regions by identity, destination descriptors by identity, cached
// with a strong reference) and cuts the request with fabric/plan.hpp. It accepts only plain
// input: exact ints in range, the routing classes themselves, int64 page arrays. Anything
// else, valid or not, returns null and the caller takes the validating Python path
// (fabric_core.plan_request), which either plans the request or raises its ConfigError. So
// the fast path never accepts what plan_request rejects, and every error message stays in
// one place. TransferMaker (below) makes the Transfer objects the Python side hands back.
//
// Every method runs with the GIL held: the GIL is the lock of the tables.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <structmember.h>  // T_OBJECT_EX, READONLY (TransferMaker)

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "closed.hpp"
#include "plan.hpp"

namespace fabric::fast {

namespace py = pybind11;

using fabric::ClosedSet;  // (fabric/closed.hpp)

struct Classes {
    py::object sharded, pinned, shard_peers, descriptor, scatter_target;
};

class FastPlanner {
  public:
    FastPlanner(size_t num_nics, uint64_t max_msg, Classes classes, bool guarded)
        : n_(num_nics), max_msg_(max_msg), classes_(std::move(classes)), guarded_(guarded) {}

    // Regions are found by the identity of the (frozen) MemoryRegion bound to them, which
    // the entry keeps alive: its address names no other object while it is here.
    void add_region(uint64_t handle, py::object region, uint64_t ptr, uint64_t len, std::vector<void*> descs) {
        drop_region(handle);
        PyObject* key = region.ptr();
        auto old = regions_.find(key);  // the same object bound before under another handle
        if (old != regions_.end()) handles_.erase(old->second.handle);
        handles_[handle] = key;
        regions_[key] = Region{std::move(region), ptr, len,
                               std::make_shared<const std::vector<void*>>(std::move(descs)), handle};
    }
    void drop_region(uint64_t handle) {
        auto it = handles_.find(handle);
        if (it == handles_.end()) return;
        regions_.erase(it->second);
        handles_.erase(it);
    }
    // The most pages of a list op NIC 0's domain takes for a key (Engine::list_pages; 0: none).
    void set_lists(std::function<size_t(uint64_t)> lists) { lists_ = std::move(lists); }

    // WriteRequest(src, src_offset, length, dst, dst_offset, imm, routing).
    std::unique_ptr<Request> write(uint64_t id, PyObject* src, PyObject* src_off, PyObject* length, PyObject* dst,
                                   PyObject* dst_off, PyObject* imm, PyObject* routing, uint64_t rotation) {
        const Region* reg = region(src);
        TargetEntry* t = target(dst);
        uint64_t so, len, dof;
        Route route;
        int64_t value;
        if (!reg || !t || !u63(src_off, so) || !u63(length, len) || !u63(dst_off, dof) || !imm_of(imm, true, value) ||
            !route_of(routing, false, route))
            return nullptr;
        if (!plan::span_ok(so, len, reg->len) || !plan::span_ok(dof, len, t->length)) return nullptr;
        auto req = start(id, value, reg, t);
        if (route.pin) {
            plan::emit(req->ops, route.k, 0, reg->ptr + so, dof, len, max_msg_);
        } else {
            plan::shards(req->ops, 0, reg->ptr + so, dof, len, route.k, rotation % n_, n_, max_msg_);
        }
        return req;
    }

    // PagedWriteRequest; the page lists come as int64 arrays (fabric_core.memory.index_array).
    std::unique_ptr<Request> paged(uint64_t id, PyObject* src, PyObject* src_pages, PyObject* src_stride, PyObject* dst,
                                   PyObject* dst_pages, PyObject* dst_stride, PyObject* page_length,
                                   PyObject* src_offset, PyObject* dst_offset, PyObject* imm, PyObject* routing,
                                   uint64_t rotation) {
        using Pages = py::array_t<int64_t, 0>;
        const Region* reg = region(src);
        TargetEntry* t = target(dst);
        uint64_t ss, ds, plen, so, dof;
        Route route;
        int64_t value;
        if (!reg || !t || !u63(src_stride, ss) || !u63(dst_stride, ds) || !u63(page_length, plen) ||
            !u63(src_offset, so) || !u63(dst_offset, dof) || !imm_of(imm, true, value) ||
            !route_of(routing, false, route))
            return nullptr;
        py::handle sp_h(src_pages), dp_h(dst_pages);
        if (!py::isinstance<Pages>(sp_h) || !py::isinstance<Pages>(dp_h)) return nullptr;
        auto sp_arr = py::reinterpret_borrow<Pages>(sp_h);
        auto dp_arr = py::reinterpret_borrow<Pages>(dp_h);
        if (sp_arr.ndim() != 1 || dp_arr.ndim() != 1) return nullptr;
        auto sp = sp_arr.unchecked<1>();
        auto dp = dp_arr.unchecked<1>();
        size_t count = static_cast<size_t>(sp.shape(0));
        if (count == 0 || static_cast<size_t>(dp.shape(0)) != count) return nullptr;
        int64_t s_lo = sp(0), s_hi = sp(0), d_lo = dp(0), d_hi = dp(0);
        for (size_t i = 1; i < count; i++) {
            s_lo = std::min(s_lo, sp(i));
            s_hi = std::max(s_hi, sp(i));
            d_lo = std::min(d_lo, dp(i));
            d_hi = std::max(d_hi, dp(i));
        }
        if (s_lo < 0 || d_lo < 0) return nullptr;
        using plan::u128;
        if (!plan::span_ok(so + u128(s_hi) * ss, plen, reg->len) || !plan::span_ok(dof + u128(d_hi) * ds, plen, t->length))
            return nullptr;
        if (plen && count > 1) {
            if (ds < plen) return nullptr;
            if (!plan::distinct(count, d_lo, d_hi, [&](size_t i) { return dp(i); })) return nullptr;
        }
        auto req = start(id, value, reg, t);
        const std::vector<uint64_t>& rkeys = t->target->rkeys;
        const size_t per_list = plen > 0 && plen <= max_msg_ && count > 1 && count < (size_t(1) << 32) &&
                                        (route.pin ? route.k == 0 : n_ == 1) && lists_ && !rkeys.empty()
                                    ? std::min(lists_(rkeys[0]), kMaxListPages)
                                    : 0;
        if (per_list > 1) {
            // NIC 0's domain takes the pages as lists (the CUDA IPC domain: one kernel launch
            // moves them, one inbox record counts their imms; tcp: a write of several pages
            // whose one imm counts them all): up to per_list pages a work request of the engine
            // instead of one each
            req->list_src.resize(count);
            req->list_dst.resize(count);
            for (size_t i = 0; i < count; i++) {
                req->list_src[i] = reg->ptr + so + static_cast<uint64_t>(sp(i)) * ss;
                req->list_dst[i] = dof + static_cast<uint64_t>(dp(i)) * ds;
            }
            req->ops.reserve((count + per_list - 1) / per_list);
            for (size_t at = 0; at < count; at += per_list) {
                OpCtx& op = req->ops.emplace_back();
                op.len = plen;
                op.first_page = static_cast<uint32_t>(at);
                op.pages = static_cast<uint32_t>(std::min(per_list, count - at));
                req->list_extra += op.pages - 1;
            }
            return req;
        }
        req->ops.reserve(plen <= max_msg_ ? count : 0);
        uint64_t first = rotation % n_;
        for (size_t i = 0; i < count; i++) {
            uint64_t nic = route.pin ? route.k : (first + (i * route.k) / count) % n_;
            // in range: the span checks above bound every offset below 2**63
            plan::emit(req->ops, static_cast<uint32_t>(nic), 0, reg->ptr + so + static_cast<uint64_t>(sp(i)) * ss,
                       dof + static_cast<uint64_t>(dp(i)) * ds, plen, max_msg_);
        }
        return req;
    }

    // ScatterRequest(src, targets, imm, routing, group): ``targets`` a tuple or list of
    // ScatterTarget, ``members`` the peer group's member set (raw addresses; the caller has
    // checked the group is this engine's) or None for no group. ``per_target`` gets the imms
    // each target will count.
    std::unique_ptr<Request> scatter(uint64_t id, PyObject* src, PyObject* targets, PyObject* imm, PyObject* routing,
                                     PyObject* members, uint64_t rotation, std::vector<int64_t>& per_target) {
        const Region* reg = region(src);
        Route route;
        int64_t value;
        if (!reg || !imm_of(imm, true, value) || !route_of(routing, true, route)) return nullptr;
        bool peers = !route.pin && reinterpret_cast<PyObject*>(Py_TYPE(routing)) == classes_.shard_peers.ptr();
        if (members != Py_None && !PyAnySet_CheckExact(members)) return nullptr;
        if (!PyTuple_CheckExact(targets) && !PyList_CheckExact(targets)) return nullptr;
        py::object seq = py::reinterpret_borrow<py::object>(targets);  // a list may not shrink under us
        Py_ssize_t count = PySequence_Fast_GET_SIZE(targets);
        if (count == 0) return nullptr;
        const Names& nm = names();
        auto req = std::make_unique<Request>();
        req->id = id;
        req->has_imm = value >= 0;
        req->imm = static_cast<uint32_t>(value >= 0 ? value : 0);
        req->src_desc = reg->descs;
        req->targets.reserve(static_cast<size_t>(count));
        per_target.assign(static_cast<size_t>(count), 0);
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject* item = PySequence_Fast_GET_ITEM(targets, j);
            if (reinterpret_cast<PyObject*>(Py_TYPE(item)) != classes_.scatter_target.ptr()) return nullptr;
            py::object dst = attr(item, nm.dst), length = attr(item, nm.length), so_o = attr(item, nm.src_offset),
                       do_o = attr(item, nm.dst_offset);
            TargetEntry* t = dst ? target(dst.ptr()) : nullptr;
            uint64_t len, so, dof;
            if (!t || !u63(length.ptr(), len) || !u63(so_o.ptr(), so) || !u63(do_o.ptr(), dof)) return nullptr;
            if (!plan::span_ok(so, len, reg->len) || !plan::span_ok(dof, len, t->length)) return nullptr;
            if (members != Py_None) {
                int in = PySet_Contains(members, t->peer_raw.ptr());
                if (in != 1) {
                    if (in < 0) PyErr_Clear();
                    return nullptr;
                }
            }
            req->targets.push_back(t->target);
            size_t before = req->ops.size();
            auto tj = static_cast<uint32_t>(j);
            uint64_t first = rotation + static_cast<uint64_t>(j);
            if (route.pin) {
                plan::emit(req->ops, route.k, tj, reg->ptr + so, dof, len, max_msg_);
            } else if (peers) {
                plan::emit(req->ops, static_cast<uint32_t>(first % n_), tj, reg->ptr + so, dof, len, max_msg_);
            } else {
                plan::shards(req->ops, tj, reg->ptr + so, dof, len, route.k, first % n_, n_, max_msg_);
            }
            if (req->has_imm) per_target[static_cast<size_t>(j)] = static_cast<int64_t>(req->ops.size() - before);
        }
        return req;
    }

    // ImmRequest(dst, imm, routing): one zero-length write carrying the imm.
    std::unique_ptr<Request> imm_only(uint64_t id, PyObject* dst, PyObject* imm, PyObject* routing,
                                      uint64_t rotation) {
        TargetEntry* t = target(dst);
        Route route;
        int64_t value;
        if (!t || !imm_of(imm, false, value) || !route_of(routing, true, route)) return nullptr;
        auto req = start(id, value, nullptr, t);
        plan::emit(req->ops, route.pin ? route.k : static_cast<uint32_t>(rotation % n_), 0, 0, 0, 0, max_msg_);
        return req;
    }

  private:
    struct Region {
        py::object obj;  // the MemoryRegion handed to the user: identity is the check
        uint64_t ptr;
        uint64_t len;
        std::shared_ptr<const std::vector<void*>> descs;
        uint64_t handle;
    };
    struct TargetEntry {
        py::object desc;  // keeps the descriptor alive, so its id is never reused while cached
        std::shared_ptr<Target> target;
        uint64_t length;
        py::object peer_raw;  // NIC 0's raw address (bytes): the descriptor's ``peer``
        uint64_t epoch = 0;  // ClosedSet epoch ``gone`` was computed at
        bool gone = false;
    };
    struct Route {
        bool pin = false;
        uint32_t k = 0;
    };

    static constexpr size_t kMaxTargets = 4096;

    struct Names {
        PyObject *nics, *nic, *writable, *length, *ptr, *address, *raw, *rkey, *dst, *src_offset, *dst_offset;
    };
    static const Names& names() {
        static const Names n{PyUnicode_InternFromString("nics"),
                             PyUnicode_InternFromString("nic"),      PyUnicode_InternFromString("writable"),
                             PyUnicode_InternFromString("length"),   PyUnicode_InternFromString("ptr"),
                             PyUnicode_InternFromString("address"),  PyUnicode_InternFromString("raw"),
                             PyUnicode_InternFromString("rkey"),     PyUnicode_InternFromString("dst"),
                             PyUnicode_InternFromString("src_offset"), PyUnicode_InternFromString("dst_offset")};
        return n;
    }

    static py::object attr(PyObject* obj, PyObject* name) {
        PyObject* v = PyObject_GetAttr(obj, name);
        if (v == nullptr) PyErr_Clear();
        return py::reinterpret_steal<py::object>(v);
    }

    // An exact int in [0, 2**63) (bools and numpy ints take the slow path).
    static bool u63(PyObject* o, uint64_t& out) {
        if (o == nullptr || !PyLong_CheckExact(o)) return false;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        if (overflow != 0 || v < 0) return false;
        out = static_cast<uint64_t>(v);
        return true;
    }

    static bool u64(PyObject* o, uint64_t& out) {
        if (o == nullptr || !PyLong_CheckExact(o)) return false;
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        out = v;
        return true;
    }

    // None (when allowed: no imm, -1) or an exact int in [0, 2**32).
    static bool imm_of(PyObject* o, bool allow_none, int64_t& out) {
        if (o == Py_None) {
            out = -1;
            return allow_none;
        }
        uint64_t v;
        if (!u63(o, v) || v >= (uint64_t(1) << 32)) return false;
        out = static_cast<int64_t>(v);
        return true;
    }

    bool route_of(PyObject* r, bool allow_peers, Route& out) const {
        PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(r));
        if (type == classes_.sharded.ptr()) {
            py::object k = attr(r, names().nics);
            if (!k) return false;
            if (k.ptr() == Py_None) {
                out.k = static_cast<uint32_t>(n_);
                return true;
            }
            uint64_t v;
            if (!u63(k.ptr(), v) || v < 1 || v > n_) return false;
            out.k = static_cast<uint32_t>(v);
            return true;
        }
        if (type == classes_.pinned.ptr()) {
            py::object k = attr(r, names().nic);
            uint64_t v;
            if (!k || !u63(k.ptr(), v) || v >= n_) return false;
            out.pin = true;
            out.k = static_cast<uint32_t>(v);
            return true;
        }
        return allow_peers && type == classes_.shard_peers.ptr();  // one destination: NIC ``rotation``
    }

    const Region* region(PyObject* src) const {
        auto it = regions_.find(src);
        return it == regions_.end() ? nullptr : &it->second;
    }

    TargetEntry* target(PyObject* desc) {
        auto it = targets_.find(desc);
        TargetEntry* t = it != targets_.end() ? &it->second : insert_target(desc);
        if (t == nullptr) return nullptr;
        if (guarded_) {
            auto& closed = ClosedSet::instance();
            uint64_t epoch = closed.epoch();
            if (t->epoch != epoch) {
                t->gone = closed.contains(t->target->addresses[0]);
                t->epoch = epoch;
            }
            if (t->gone) return nullptr;
        }
        return t;
    }

    // A descriptor seen for the first time: check it as plan_request does, then cache it.
    TargetEntry* insert_target(PyObject* desc) {
        if (reinterpret_cast<PyObject*>(Py_TYPE(desc)) != classes_.descriptor.ptr()) return nullptr;
        const Names& nm = names();
        py::object writable = attr(desc, nm.writable), length = attr(desc, nm.length), ptr = attr(desc, nm.ptr),
                   nics = attr(desc, nm.nics);
        uint64_t len, base;
        if (!writable || writable.ptr() != Py_True || !u63(length.ptr(), len) || !u64(ptr.ptr(), base) || !nics ||
            !PyTuple_CheckExact(nics.ptr()) || static_cast<size_t>(PyTuple_GET_SIZE(nics.ptr())) != n_)
            return nullptr;
        auto target = std::make_shared<Target>();
        target->remote_base = base;
        py::object peer_raw;
        for (size_t i = 0; i < n_; i++) {
            PyObject* key = PyTuple_GET_ITEM(nics.ptr(), static_cast<Py_ssize_t>(i));
            py::object address = attr(key, nm.address), rkey = attr(key, nm.rkey);
            py::object raw = address ? attr(address.ptr(), nm.raw) : py::object();
            uint64_t k;
            if (!raw || !PyBytes_CheckExact(raw.ptr()) || !u64(rkey.ptr(), k)) return nullptr;
            target->addresses.emplace_back(PyBytes_AS_STRING(raw.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(raw.ptr())));
            target->rkeys.push_back(k);
            if (i == 0) peer_raw = raw;
        }
        if (targets_.size() >= kMaxTargets) targets_.clear();
        auto [it, _] = targets_.emplace(
            desc, TargetEntry{py::reinterpret_borrow<py::object>(desc), std::move(target), len, std::move(peer_raw)});
        return &it->second;
    }

    static std::unique_ptr<Request> start(uint64_t id, int64_t imm, const Region* reg, TargetEntry* t) {
        auto req = std::make_unique<Request>();
        req->id = id;
        req->has_imm = imm >= 0;
        req->imm = static_cast<uint32_t>(imm >= 0 ? imm : 0);
        if (reg != nullptr) req->src_desc = reg->descs;
        req->targets.push_back(t->target);
        return req;
    }

    size_t n_;
    uint64_t max_msg_;
    Classes classes_;
    bool guarded_;
    std::function<size_t(uint64_t)> lists_;
    std::unordered_map<PyObject*, Region> regions_;  // by the bound MemoryRegion's identity
    std::unordered_map<uint64_t, PyObject*> handles_;  // region handle -> its key in regions_
    std::unordered_map<PyObject*, TargetEntry> targets_;
};

// Makes the fast path's Transfer objects in C++: one Python object allocation and a store per
// field, with none of the Python calls that making one there takes (0.5-0.6 us of a submit's
// 1.7-3 on the 2-core machine). A transfer is a copy of ``prototype``, which the Python side
// made with the engine's hooks by the constructor's own code (fabric_core.transfer._fill), so
// that code stays the one definition of a transfer's fields. The fields named in ``fresh``
// are made anew for each copy by their factories (callables taking no arguments: its id, its
// lock, its callback list); ``imms_per_target`` is each copy's own; every other field is the
// prototype's value, shared (None, False, the engine's dispatcher, timeout and hooks).
//
// Fields are written at the slot offsets of the type's member descriptors, so the type must
// be a plain __slots__ class (no __dict__, every slot an object slot), and the constructor
// checks that each slot is either made anew, is imms_per_target, or is set in the prototype:
// a field added to Transfer and not to _fill fails here, at the engine's open.
//
// Every method runs with the GIL held.
class TransferMaker {
  public:
    TransferMaker(py::handle prototype, const py::dict& fresh, py::dict inflight) : inflight_(std::move(inflight)) {
        type_ = Py_TYPE(prototype.ptr());
        if (type_->tp_dictoffset != 0 || type_->tp_itemsize != 0)
            throw std::invalid_argument("TransferMaker: the transfer type must be a __slots__ class");
        py::object imms_name = py::str("imms_per_target"), id_name = py::str("id");
        size_t used = 0;
        // (each class's __dict__ through the attribute: a static builtin type's tp_dict is
        // null from Python 3.12 on)
        for (py::handle cls : py::reinterpret_borrow<py::tuple>(type_->tp_mro)) {
            py::object items = cls.attr("__dict__").attr("items")();
            for (py::handle pair : items) {
                py::object name = pair[py::int_(0)], descr = pair[py::int_(1)];
                if (Py_TYPE(descr.ptr()) != &PyMemberDescr_Type) continue;
                const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(descr.ptr())->d_member;
                if (m->type != T_OBJECT_EX || (m->flags & READONLY))
                    throw std::invalid_argument("TransferMaker: a slot of the transfer type is not an object slot");
                auto offset = static_cast<Py_ssize_t>(m->offset);
                if (name.equal(imms_name)) {
                    imms_off_ = offset;
                } else if (fresh.contains(name)) {
                    used++;
                    if (name.equal(id_name)) {
                        id_off_ = offset;
                        id_factory_ = fresh[name];
                    } else {
                        fields_.push_back(Field{offset, py::object(), fresh[name]});
                    }
                } else {
                    py::object value = prototype.attr(name);  // AttributeError: a field _fill does not set
                    fields_.push_back(Field{offset, std::move(value), py::object()});
                }
            }
        }
        if (imms_off_ < 0 || id_off_ < 0 || used != fresh.size())
            throw std::invalid_argument("TransferMaker: id and imms_per_target must be slots, and every fresh field one");
    }

    // A fresh id, as the Python int the transfer will carry and as the engine's request id.
    py::object next_id(uint64_t& id) const {
        auto obj = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(id_factory_.ptr()));
        if (!obj) throw py::error_already_set();
        id = PyLong_AsUnsignedLongLong(obj.ptr());
        if (PyErr_Occurred()) throw py::error_already_set();
        return obj;
    }

    // A transfer with ``id`` (from next_id) and ``imms`` (a tuple), entered in the in-flight table.
    py::object make(const py::object& id, py::object imms) const {
        auto obj = py::reinterpret_steal<py::object>(type_->tp_alloc(type_, 0));
        if (!obj) throw py::error_already_set();
        char* base = reinterpret_cast<char*>(obj.ptr());
        for (const Field& f : fields_) {
            PyObject* v = f.factory ? PyObject_CallNoArgs(f.factory.ptr()) : Py_NewRef(f.value.ptr());
            if (v == nullptr) throw py::error_already_set();
            *reinterpret_cast<PyObject**>(base + f.offset) = v;
        }
        *reinterpret_cast<PyObject**>(base + id_off_) = Py_NewRef(id.ptr());
        *reinterpret_cast<PyObject**>(base + imms_off_) = imms.release().ptr();
        if (PyDict_SetItem(inflight_.ptr(), id.ptr(), obj.ptr()) != 0) throw py::error_already_set();
        return obj;
    }

    // Takes a transfer make() entered back out of the in-flight table (it was never submitted).
    void forget(const py::object& id) const {
        if (PyDict_DelItem(inflight_.ptr(), id.ptr()) != 0) PyErr_Clear();
    }

  private:
    struct Field {
        Py_ssize_t offset;
        py::object value;    // shared by every copy (no factory)
        py::object factory;  // or made anew for each
    };
    PyTypeObject* type_;
    std::vector<Field> fields_;
    Py_ssize_t id_off_ = -1, imms_off_ = -1;
    py::object id_factory_;
    py::dict inflight_;
};

}  // namespace fabric::fast
