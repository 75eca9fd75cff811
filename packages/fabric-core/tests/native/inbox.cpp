// The imm inbox (fabric/imm_inbox.hpp) across real processes: tests/test_native_inbox.py.
//
//   g++ -std=c++17 -O1 -I packages/fabric-core/src/fabric_core/include
//       packages/fabric-core/tests/native/inbox.cpp -o inbox -pthread && ./inbox
//
// 1. Three forked senders push (imm, count) records while the target drains: one lets go of
//    its lane, one exits without letting go, one is SIGKILLed in the middle. Every record a
//    sender published is counted exactly once (the senders report what they published
//    through shared memory), nothing else is, and every lane is free at the end (the target drains
//    before it frees: none of the given-back or orphaned lanes' records is lost).
// 2. A full lane refuses a push and writes nothing; drained, it takes pushes again.
// 3. With every lane taken, a sender is refused with a reason, and is let in once one is
//    given back and drained.
// 4. The records carry the sender's address (attribution).
#include <fabric/imm_inbox.hpp>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

namespace {

using fabric::inbox::Receiver;
using fabric::inbox::Sender;

std::string fresh_name() { return "/fabric-ipc-" + std::to_string(getpid()) + "-inboxtest-in"; }

// A child: claims a lane as "sender<k>", pushes ``records`` records of imm 100 + k (counts
// 1..3, retried while the lane is full), stores the total count it published in ``*published``
// (shared memory) after every record and the total it is about to publish in ``*pushing``
// before it (a SIGKILL can fall between the two), then lets go (mode 0), exits without letting go (1) or spins until killed (2).
[[noreturn]] void child(const std::string& name, int k, int records, int mode, std::atomic<uint64_t>* published,
                        std::atomic<uint64_t>* pushing) {
    Sender s;
    std::string why;
    if (!s.open(name, "sender" + std::to_string(k), why)) {
        std::fprintf(stderr, "child %d: %s\n", k, why.c_str());
        _exit(3);
    }
    uint64_t total = 0;
    for (int i = 0; i < records; i++) {
        uint32_t count = uint32_t(i % 3 + 1);
        pushing->store(total + count, std::memory_order_release);
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!s.push(uint32_t(100 + k), count)) {
            if (std::chrono::steady_clock::now() > until) _exit(4);
            std::this_thread::yield();
        }
        total += count;
        published->store(total, std::memory_order_release);
    }
    if (mode == 0) s.close();
    if (mode == 2)
        for (;;) pause();
    _exit(0);
}

void test_processes() {
    const std::string name = fresh_name();
    Receiver r;
    std::string why;
    CHECK(r.open(name, why));
    const int kRecords[3] = {20000, 20000, 200000};
    void* shared = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(shared != MAP_FAILED);
    auto* reported = new (shared) std::atomic<uint64_t>[6]{};  // published, then being pushed
    pid_t pids[3];
    for (int k = 0; k < 3; k++) {
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) child(name, k, kRecords[k], k, &reported[k], &reported[3 + k]);
        pids[k] = pid;
    }
    std::map<uint32_t, uint64_t> counted;
    std::map<std::string, uint64_t> by_addr;
    auto drain = [&](bool reap) {
        return r.drain(
            [&](uint32_t, uint64_t, const char* addr, size_t len, uint32_t imm, uint32_t count) {
                counted[imm] += count;
                by_addr[std::string(addr, len)] += count;
            },
            reap);
    };
    // sender 2 is killed once it has published a good part of its records
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (counted[102] < 30000 && std::chrono::steady_clock::now() < until) drain(false);
    CHECK(counted[102] >= 30000);
    kill(pids[2], SIGKILL);
    int status = 0;
    for (int k = 0; k < 3; k++) {
        while (waitpid(pids[k], &status, WNOHANG) == 0 && std::chrono::steady_clock::now() < until) drain(false);
        if (k < 2) CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (k == 2) CHECK(WIFSIGNALED(status));
    }
    drain(true);  // the killed sender's lane and the unreleased one are reaped here
    drain(true);
    uint64_t published[3] = {0, 0, 0};
    for (int k = 0; k < 3; k++) {
        published[k] = reported[k].load(std::memory_order_acquire);
        std::printf("sender %d: published %llu, counted %llu\n", k, static_cast<unsigned long long>(published[k]),
                    static_cast<unsigned long long>(counted[uint32_t(100 + k)]));
        uint64_t got = counted[uint32_t(100 + k)], pushing = reported[3 + k].load(std::memory_order_acquire);
        if (k == 2 && got == pushing) published[k] = pushing;  // killed after its push, before it noted it
        CHECK(got == published[k]);
        CHECK(by_addr["sender" + std::to_string(k)] == published[k]);
    }
    CHECK(published[0] == 39999 && published[1] == 39999);  // 20000 records of counts 1, 2, 3, 1, ...
    CHECK(counted.size() == 3 && by_addr.size() == 3);
    CHECK(drain(true) == 0);
    // every lane is free again: 64 new senders get one each
    std::vector<std::unique_ptr<Sender>> all;
    for (uint32_t i = 0; i < fabric::inbox::kLanes; i++) {
        all.push_back(std::make_unique<Sender>());
        CHECK(all.back()->open(name, "s", why));
    }
    std::printf("processes: every published count once (one released, one exited, one killed); lanes free\n");
}

void test_full_and_taken() {
    const std::string name = fresh_name();
    Receiver r;
    std::string why;
    CHECK(r.open(name, why));
    Sender s;
    CHECK(s.open(name, "me", why));
    for (uint32_t i = 0; i < fabric::inbox::kLaneRecords; i++) CHECK(s.push(7, 1));
    CHECK(!s.push(7, 1));  // full: refused
    uint64_t got = 0;
    std::string from;
    r.drain([&](uint32_t, uint64_t, const char* a, size_t n, uint32_t imm, uint32_t c) {
        CHECK(imm == 7);
        got += c;
        from.assign(a, n);
    });
    CHECK(got == fabric::inbox::kLaneRecords && from == "me");
    CHECK(s.push(7, 5));
    got = 0;
    r.drain([&](uint32_t, uint64_t, const char*, size_t, uint32_t, uint32_t c) { got += c; });
    CHECK(got == 5);
    // every other lane taken: the next sender is refused, with the reason
    std::vector<std::unique_ptr<Sender>> rest;
    for (uint32_t i = 1; i < fabric::inbox::kLanes; i++) {
        rest.push_back(std::make_unique<Sender>());
        CHECK(rest.back()->open(name, "x", why));
    }
    Sender late;
    CHECK(!late.open(name, "late", why) && why.find("lanes") != std::string::npos);
    CHECK(s.push(9, 2));
    s.close();  // given back with a record in it: drained, then freed
    got = 0;
    r.drain([&](uint32_t, uint64_t, const char*, size_t, uint32_t imm, uint32_t c) {
        CHECK(imm == 9);
        got += c;
    });
    CHECK(got == 2);
    CHECK(late.open(name, "late", why));
    CHECK(late.push(11, 3));
    got = 0;
    r.drain([&](uint32_t, uint64_t, const char* a, size_t n, uint32_t imm, uint32_t c) {
        CHECK(imm == 11 && std::string(a, n) == "late");
        got += c;
    });
    CHECK(got == 3);
    // no inbox: a sender says why
    r.close();
    Sender none;
    CHECK(!none.open(name, "x", why) && why.find("shm_open") != std::string::npos);
    std::printf("full and taken: a full lane refuses, a taken inbox refuses, both recover\n");
}

}  // namespace

int main() {
    test_full_and_taken();
    test_processes();
    std::printf("inbox: ok\n");
    return 0;
}
