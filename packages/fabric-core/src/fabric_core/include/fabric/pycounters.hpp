// The counter table's Python binding, shared by every compiled backend: fabric_core's
// NativeCounterTable drives it (see fabric_core/counters.py for the semantics it keeps).
//
// wait() is the latency path: it queues a blocking waiter with the GIL held, then releases the
// GIL and spins, then sleeps, until the engine's worker counts enough imms. It wakes every
// 100 ms to let Python handle signals (Ctrl-C withdraws the waiter and raises). Token waiters
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

namespace fabric {

namespace py = pybind11;

inline void bind_counter_table(py::module_& m) {
    using Table = CounterTable;
    using Tokens = CounterTable::Tokens;
    py::class_<Table, std::shared_ptr<Table>>(m, "CounterTable", py::module_local())
        .def(py::init<>())  // a table of its own (engines make theirs; tests compare semantics)
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
            "wait",
            [](Table& t, uint32_t imm, uint64_t n, py::bytes peer, double timeout_s) -> py::tuple {
                using Clock = std::chrono::steady_clock;
                constexpr auto kSlice = std::chrono::milliseconds(100);
                auto w = std::make_shared<Table::Waiter>();
                w->n = n;
                w->peer = std::string(peer);
                Tokens fired;
                auto out = [&](int code, uint64_t seen, py::object exc = py::none()) {
                    return py::make_tuple(code, seen, py::cast(fired), std::move(exc));
                };
                int code = t.enqueue(imm, w);
                if (code != kCountQueued) return out(code, 0);
                auto deadline = std::isfinite(timeout_s)
                                    ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(std::max(timeout_s, 0.0)))
                                    : Clock::time_point::max();
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
                        // A signal handler raised (Ctrl-C): leave the queue, give back counts
                        // that fired as we left, and hand the exception to the caller along
                        // with the tokens our leaving fired (their waiters must still run).
                        py::error_already_set raised;
                        uint64_t seen = 0;
                        if (!t.withdraw(imm, w, seen, fired) && w->state.load() == kCountOk)
                            t.add_one(imm, n, fired, false);
                        return out(kCountTimeout, 0, raised.value());
                    }
                }
                uint64_t seen = 0;
                if (t.withdraw(imm, w, seen, fired)) return out(kCountTimeout, seen);
                return out(w->state.load(), 0);  // it settled as the deadline passed
            },
            py::arg("imm"), py::arg("n"), py::arg("peer"), py::arg("timeout_s"))
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
