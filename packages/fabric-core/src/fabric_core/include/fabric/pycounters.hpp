// The counter table's Python binding, shared by every compiled backend: fabric_core's
// NativeCounterTable drives it (see fabric_core/counters.py for the semantics it keeps).
//
// wait() is the latency path: it queues a blocking waiter with the GIL held, then releases the
// GIL and spins, then sleeps, until the engine's worker counts enough imms. It wakes every
// 100 ms to let Python handle signals (Ctrl-C withdraws the waiter and raises). It is a
// METH_FASTCALL method (pyfastcall.hpp) and a satisfied wait returns None, its time tallied in
// C++ (WaitTally): on an imm round trip, one wait on each side, this took a satisfied wait
// from about 0.85 to 0.3 us of the calling thread on the 2-core machine. Token waiters
// (asyncio waits, expect callbacks) are fired by the worker, which hands their tokens to the
// binding's completion thread.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "counters.hpp"
#include "pyfastcall.hpp"

namespace fabric {

namespace py = pybind11;

// A wait's deadline, ``timeout_s`` seconds after ``start``. Past about 31 years (infinite
// included) a timeout is as good as none: no deadline, and no clock arithmetic to overflow.
inline std::chrono::steady_clock::time_point wait_deadline(std::chrono::steady_clock::time_point start,
                                                           double timeout_s) {
    constexpr double kForever = 1e9;
    if (!(timeout_s < kForever)) return std::chrono::steady_clock::time_point::max();
    return start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                       std::chrono::duration<double>(std::max(timeout_s, 0.0)));
}

// A blocking wait for n counts of imm (peer: b"" or the peer it depends on): None once the
// counts are consumed (the wait's time tallied in t.waits()); otherwise (code, seen, fired,
// exc, seconds): kCountTimeout with the count seen at the deadline, kCountPeerLost or
// kCountFailed, the tokens that withdrawing it fired, the exception a signal handler raised
// (Ctrl-C: the waiter left the queue first), and how long it took, for Python to settle and
// tally. A satisfied wait returns its tuple only if it fired tokens or met an exception.
inline py::object wait_one(CounterTable& t, uint32_t imm, uint64_t n, std::string peer, double timeout_s) {
    using Clock = std::chrono::steady_clock;
    constexpr auto kSlice = std::chrono::milliseconds(100);
    auto start = Clock::now();
    auto w = std::make_shared<CounterTable::Waiter>();
    w->n = n;
    w->peer = std::move(peer);
    CounterTable::Tokens fired;
    auto out = [&](int code, uint64_t seen, py::object exc = py::none()) -> py::object {
        auto took = Clock::now() - start;
        if (code == kCountOk && fired.empty() && exc.is_none()) {
            t.waits().record(std::chrono::duration_cast<std::chrono::nanoseconds>(took));
            return py::none();
        }
        return py::make_tuple(code, seen, py::cast(fired), std::move(exc), std::chrono::duration<double>(took).count());
    };
    int code = t.enqueue(imm, w);
    if (code != kCountQueued) return out(code, 0);
    auto deadline = wait_deadline(start, timeout_s);
    while (true) {
        auto now = Clock::now();
        auto slice_end = deadline - now > kSlice ? now + kSlice : deadline;
        {
            py::gil_scoped_release release;
            code = t.block(w, slice_end);
        }
        if (code != kCountQueued) return out(code, 0);
        if (Clock::now() >= deadline) break;
        if (PyErr_CheckSignals() != 0) {
            // A signal handler raised (Ctrl-C): leave the queue, give back counts that fired
            // as we left, and hand the exception to the caller along with the tokens our
            // leaving fired (their waiters must still run).
            py::error_already_set raised;
            uint64_t seen = 0;
            if (!t.withdraw(imm, w, seen, fired) && w->state.load() == kCountOk) t.add_one(imm, n, fired, false);
            return out(kCountTimeout, 0, raised.value());
        }
    }
    uint64_t seen = 0;
    if (t.withdraw(imm, w, seen, fired)) return out(kCountTimeout, seen);
    return out(w->state.load(), 0);  // it settled as the deadline passed
}

// The table's METH_FASTCALL methods: wait(imm, n, peer, timeout_s, /).
struct CounterFastCalls {
    static PyObject* wait(PyObject* self, PyObject* const* a, Py_ssize_t n) {
        return fastcall::call<CounterTable>(self, a, n, 4, "wait", [a](CounterTable& t, double timeout_s) {
            if (!PyBytes_Check(a[2])) throw py::type_error("wait(): peer must be bytes");
            std::string peer(PyBytes_AS_STRING(a[2]), static_cast<size_t>(PyBytes_GET_SIZE(a[2])));
            return wait_one(t, py::cast<uint32_t>(py::handle(a[0])), py::cast<uint64_t>(py::handle(a[1])),
                            std::move(peer), timeout_s);
        });
    }

    static void add(py::handle cls) {
        static PyMethodDef defs[] = {
            {"wait", fastcall::method(&wait), METH_FASTCALL,
             "wait($self, imm, n, peer, timeout_s, /)\n--\n\n"
             "Blocks for n counts of imm: None once consumed, else (code, seen, fired, exc, seconds)."},
        };
        fastcall::add(cls, defs);
    }
};

inline void bind_counter_table(py::module_& m) {
    using Table = CounterTable;
    using Tokens = CounterTable::Tokens;
    py::class_<Table, std::shared_ptr<Table>> cls(m, "CounterTable", py::module_local());
    CounterFastCalls::add(cls);
    cls.def(py::init<>())  // a table of its own (engines make theirs; tests compare semantics)
        .def(
            "add",
            [](Table& t, uint32_t imm, uint64_t n, bool received) {
                Tokens fired;
                t.add_one(imm, n, fired, received);
                return fired;
            },
            py::arg("imm"), py::arg("n"), py::arg("received"))
        .def("value", &Table::value, py::arg("imm"))
        .def("snapshot", &Table::snapshot)
        .def("received", &Table::received)
        .def(
            "arm",
            [](Table& t, uint32_t imm, uint64_t n, py::bytes peer, uint64_t token) {
                return t.arm(imm, n, std::string(peer), token);
            },
            py::arg("imm"), py::arg("n"), py::arg("peer"), py::arg("token"))
        .def(
            "withdraw",
            [](Table& t, uint32_t imm, uint64_t token) {
                uint64_t seen = 0;
                Tokens fired;
                bool out = t.withdraw_token(imm, token, seen, fired);
                return std::make_pair(out ? static_cast<int64_t>(seen) : int64_t(-1), fired);
            },
            py::arg("imm"), py::arg("token"))
        .def(
            "wait_all",
            // Waits for every (imm, n, peer) at once: consumed all together, or nothing. Returns
            // (code, index, seen, fired, exc): kCountOk, every count taken; kCountPeerLost or
            // kCountFailed, entry ``index`` failed; kCountTimeout at the deadline, with ``seen``
            // the count of each entry still waiting then (-1: it had fired). On any outcome but
            // kCountOk, the counts of entries that had fired are given back.
            [](Table& t, const std::vector<std::tuple<uint32_t, uint64_t, py::bytes>>& wants,
               double timeout_s) -> py::tuple {
                using Clock = std::chrono::steady_clock;
                constexpr auto kSlice = std::chrono::milliseconds(100);
                size_t m = wants.size();
                std::vector<Table::WaiterPtr> ws;
                std::vector<uint32_t> imms;
                ws.reserve(m);
                imms.reserve(m);
                std::vector<int64_t> seen(m, -1);
                Tokens fired;
                auto out = [&](int code, int64_t index, py::object exc = py::none()) {
                    return py::make_tuple(code, index, py::cast(seen), py::cast(fired), std::move(exc));
                };
                // Leave: withdraw what still waits (noting the count it saw), then give back
                // what fired (a withdrawal may fire a later entry of the same imm).
                auto leave = [&]() {
                    for (size_t i = 0; i < ws.size(); i++) {
                        uint64_t count = 0;
                        if (t.withdraw(imms[i], ws[i], count, fired)) seen[i] = static_cast<int64_t>(count);
                    }
                    for (size_t i = 0; i < ws.size(); i++)
                        if (ws[i]->state.load(std::memory_order_acquire) == kCountOk)
                            t.add_one(imms[i], ws[i]->n, fired, false);
                };
                auto first_failed = [&]() -> int64_t {
                    for (size_t i = 0; i < ws.size(); i++) {
                        int s = ws[i]->state.load(std::memory_order_acquire);
                        if (s != kCountOk && s != kCountQueued && s != kCountTimeout) return static_cast<int64_t>(i);
                    }
                    return -1;
                };
                for (size_t i = 0; i < m; i++) {
                    auto w = std::make_shared<Table::Waiter>();
                    w->n = std::get<1>(wants[i]);
                    w->peer = std::string(std::get<2>(wants[i]));
                    imms.push_back(std::get<0>(wants[i]));
                    ws.push_back(w);
                    if (t.enqueue(imms[i], w) == kCountPeerLost) {
                        leave();
                        return out(kCountPeerLost, static_cast<int64_t>(i));
                    }
                }
                auto deadline = wait_deadline(Clock::now(), timeout_s);
                int code = kCountQueued;
                while (true) {
                    auto now = Clock::now();
                    auto slice_end = deadline - now > kSlice ? now + kSlice : deadline;
                    {
                        py::gil_scoped_release release;
                        code = t.block_all(ws.data(), ws.size(), slice_end);
                    }
                    if (code != kCountQueued || Clock::now() >= deadline) break;
                    if (PyErr_CheckSignals() != 0) {  // as in wait(): leave, then raise
                        py::error_already_set raised;
                        leave();
                        return out(kCountTimeout, -1, raised.value());
                    }
                }
                if (code == kCountOk) return out(kCountOk, -1);
                if (code != kCountQueued) {
                    int64_t bad = first_failed();
                    leave();
                    return out(code, bad);
                }
                // the deadline: whatever fires while leaving is given back as well
                if (Table::joint_state(ws.data(), ws.size()) == kCountOk) return out(kCountOk, -1);
                leave();
                int64_t bad = first_failed();
                if (bad >= 0) return out(ws[static_cast<size_t>(bad)]->state.load(), bad);
                return out(kCountTimeout, -1);
            },
            py::arg("wants"), py::arg("timeout_s"))
        .def(
            "configure_wait_buckets", [](Table& t, const std::vector<double>& bounds) { t.waits().set_bounds(bounds); },
            py::arg("bounds"))
        .def("wait_stats",
             [](Table& t) {
                 auto v = t.waits().view();
                 return py::make_tuple(v.satisfied, v.total_s, v.buckets);
             })
        .def(
            "fail_peer",
            [](Table& t, py::bytes peer) {
                Tokens failed;
                t.fail_peer(std::string(peer), failed);
                return failed;
            },
            py::arg("peer"))
        .def(
            "revive_peer", [](Table& t, py::bytes peer) { t.revive_peer(std::string(peer)); }, py::arg("peer"))
        .def("fail_all",
             [](Table& t) {
                 Tokens failed;
                 t.fail_all(failed);
                 return failed;
             })
        .def(
            "attach_mirror",
            [](Table& t, uint32_t imm, uintptr_t word, py::bytes peer) {
                return t.attach_mirror(imm, reinterpret_cast<uint32_t*>(word), std::string(peer));
            },
            py::arg("imm"), py::arg("word"), py::arg("peer"))
        .def(
            "reserve",
            [](Table& t, uint32_t imm, uint64_t n) {
                uint32_t target = 0;
                int code = t.reserve(imm, n, target);
                return std::make_pair(code, target);
            },
            py::arg("imm"), py::arg("n"))
        .def("fail_mirror", &Table::fail_mirror, py::arg("imm"), py::arg("code"), py::arg("detach"))
        .def("mirror_state", &Table::mirror_state, py::arg("imm"))
        .def("pending", [](const Table& t) {
            // (imm, unconsumed count, what the waiter needs, its peer or b"") per queued waiter
            py::list out;
            for (const auto& w : t.pending()) out.append(py::make_tuple(w.imm, w.count, w.n, py::bytes(w.peer)));
            return out;
        });
}

}  // namespace fabric
