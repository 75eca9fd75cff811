// The shm endpoint's region table (fabric/region_table.hpp), across real processes.
//
//  1. names: an shm address gives /fabric-acl.<name>; odd bytes give a hex name.
//  2. verdicts: inside a writable region -> held; outside it, a region without remote write,
//     an unknown key -> refused, saying which (the same words as the tcp access check).
//  3. the fence, across processes: a forked writer holds an entry for 200 ms; revoke() waits
//     for it, and afterwards the writer's check refuses the key.
//  4. a writer killed while holding: revoke() gives up after kHoldWait and says so; the slot
//     it leaves is skipped, the key registered again still checks.
//  5. overflow: kProbe + 1 keys on one slot; the last one is unchecked (never refused), and so
//     is any unknown key from then on; the others still check. Key 0 (a free slot's mark) is
//     never placed: unchecked too.
//  6. a table made again under a live view's name: the old mapping stays readable.
//  7. threads (run under TSan too): writers check and release while the owner adds and
//     revokes; no writer ever holds an entry whose revoke() has returned.
#include <fabric/region_table.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"

using fabric::region_table::kProbe;
using fabric::region_table::kSlots;
using fabric::region_table::name_for;
using fabric::region_table::Owner;
using fabric::region_table::View;
using Clock = std::chrono::steady_clock;

static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

static std::string address_of(const char* tag) {
    return "fi_shm://rt-test-" + std::to_string(getpid()) + "-" + tag + std::string(1, '\0');
}

int main() {
    // 1. names
    CHECK(name_for(std::string("fi_shm://30260:0:0\0", 19)) == "/fabric-acl.30260:0:0");
    CHECK(name_for("fabric-12-abc-0") == "/fabric-acl.fabric-12-abc-0");
    CHECK(name_for(std::string("a/b\x01", 4)) == "/fabric-acl.x612f6201");
    std::printf("names: ok\n");

    // 2. verdicts
    const std::string addr = address_of("a");
    auto owner = std::make_unique<Owner>(addr);
    owner->add(1, 0x10000, 4096, true);
    owner->add(2, 0x20000, 4096, false);
    View view(addr);
    CHECK(view.mapped());
    std::atomic<int64_t>* hold = nullptr;
    std::string why;
    CHECK(view.check(1, 0x10000, 4096, 0, hold, why) == View::kHeld && hold != nullptr && hold->load() == 1);
    View::release(hold);
    CHECK(hold->load() == 0);
    CHECK(view.check(1, 0x10000 + 4096, 0, 0, hold, why) == View::kHeld);  // imm only, at the end
    View::release(hold);
    CHECK(view.check(1, 0x10000 + 4000, 200, 3, hold, why) == View::kRefused && hold == nullptr);
    CHECK(why.find("is outside its region [0x10000, +4096) (key 0x1 on its NIC 3)") != std::string::npos);
    CHECK(view.check(2, 0x20000, 16, 0, hold, why) == View::kRefused);
    CHECK(why.find("registered without remote write") != std::string::npos);
    CHECK(view.check(7, 0, 16, 0, hold, why) == View::kRefused);
    CHECK(why.find("no region under that key (key 0x7") != std::string::npos);
    CHECK(!View(address_of("none")).mapped());
    std::printf("verdicts: ok\n");

    // A forked writer that takes a hold on ``key`` at ``raddr``, says so, then runs ``then``
    // (its exit status is the child's) and is left to the caller to reap.
    auto holder = [&](uint64_t key, uint64_t raddr, auto then) {
        int ready[2];
        CHECK(pipe(ready) == 0);
        pid_t child = fork();
        if (child == 0) {
            View v(addr);
            std::atomic<int64_t>* h = nullptr;
            std::string w;
            if (v.check(key, raddr, 64, 0, h, w) != View::kHeld) _exit(2);
            char c = 1;
            if (write(ready[1], &c, 1) != 1) _exit(3);
            _exit(then(v, h));
        }
        char c;
        CHECK(read(ready[0], &c, 1) == 1);
        return child;
    };

    // 3. the fence, across processes
    {
        int done[2];
        CHECK(pipe(done) == 0);
        pid_t child = holder(1, 0x10000, [&](View& v, std::atomic<int64_t>* h) {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            View::release(h);
            char c;
            if (read(done[0], &c, 1) != 1) return 4;  // the owner revoked: refused now
            std::string w;
            return v.check(1, 0x10000, 64, 0, h, w) == View::kRefused && w.find("no region") != std::string::npos ? 0 : 5;
        });
        auto t = Clock::now();
        CHECK(owner->revoke(1));
        double waited = since(t);
        CHECK(waited > 0.1 && waited < 0.9);
        char c = 1;
        CHECK(write(done[1], &c, 1) == 1);
        int status = 0;
        CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
        std::printf("fence: revoke waited %.2f s for the writer's hold\n", waited);
    }

    // 4. a writer killed while holding
    {
        owner->add(5, 0x50000, 4096, true);
        pid_t child = holder(5, 0x50000, [](View&, std::atomic<int64_t>*) {
            pause();
            return 0;
        });
        kill(child, SIGKILL);
        int status = 0;
        CHECK(waitpid(child, &status, 0) == child);
        auto t = Clock::now();
        CHECK(!owner->revoke(5));
        double waited = since(t);
        CHECK(waited >= 0.95 && waited < 2.0);
        owner->add(5, 0x60000, 4096, true);  // the left slot is skipped
        CHECK(view.check(5, 0x60000, 64, 0, hold, why) == View::kHeld);
        View::release(hold);
        CHECK(owner->revoke(5));
        std::printf("dead holder: revoke gave up after %.2f s\n", waited);
    }

    // 5. overflow
    {
        const std::string a2 = address_of("overflow");
        Owner o(a2);
        View v(a2);
        for (uint64_t i = 0; i <= kProbe; i++) o.add(3 + i * kSlots, 0x1000 * (i + 1), 64, true);
        for (uint64_t i = 0; i < kProbe; i++) {
            CHECK(v.check(3 + i * kSlots, 0x1000 * (i + 1), 64, 0, hold, why) == View::kHeld);
            View::release(hold);
        }
        CHECK(v.check(3 + kProbe * kSlots, 0x1000 * (kProbe + 1), 64, 0, hold, why) == View::kUnchecked);
        CHECK(v.check(999, 0, 64, 0, hold, why) == View::kUnchecked && hold == nullptr);
        CHECK(v.check(3, 0x1000, 65, 0, hold, why) == View::kRefused);  // a known key still refuses
        const std::string a5 = address_of("zero");  // key 0 marks a free slot: never placed
        Owner z(a5);
        View zv(a5);
        z.add(0, 0x1000, 64, true);
        CHECK(zv.check(0, 0x1000, 64, 0, hold, why) == View::kUnchecked && hold == nullptr);
        std::printf("overflow: ok\n");
    }

    // 6. made again under a live view's name
    {
        const std::string a3 = address_of("again");
        auto first = std::make_unique<Owner>(a3);
        first->add(1, 0x1000, 64, true);
        View old(a3);
        auto second = std::make_unique<Owner>(a3);
        CHECK(old.check(1, 0x1000, 64, 0, hold, why) == View::kHeld);  // its own (unlinked) table
        View::release(hold);
        View fresh(a3);
        CHECK(fresh.check(1, 0x1000, 64, 0, hold, why) == View::kRefused);
        std::printf("again: ok\n");
    }

    // 7. threads: no hold outlives the revoke() of its entry
    {
        const std::string a4 = address_of("threads");
        Owner o(a4);
        std::atomic<uint64_t> revoked_upto{0};
        std::atomic<bool> stop{false};
        std::atomic<uint64_t> violations{0}, held{0}, refused{0};
        std::vector<std::thread> writers;
        for (int k = 0; k < 3; k++) {
            writers.emplace_back([&, k] {
                View v(a4);
                std::atomic<int64_t>* h = nullptr;
                std::string w;
                uint64_t key = 1;
                while (!stop.load()) {
                    key = revoked_upto.load() + 1 + (k & 1);
                    auto verdict = v.check(key, 0x1000, 64, 0, h, w);
                    if (verdict == View::kHeld) {
                        held++;
                        if (revoked_upto.load() >= key) violations++;  // its revoke returned meanwhile
                        std::this_thread::yield();
                        if (revoked_upto.load() >= key) violations++;
                        View::release(h);
                    } else if (verdict == View::kRefused) {
                        refused++;
                    }
                }
            });
        }
        for (uint64_t key = 1; key <= 1000; key++) {
            o.add(key, 0x1000, 4096, true);
            o.add(key + 1, 0x1000, 4096, true);
            std::this_thread::yield();
            CHECK(o.revoke(key));
            revoked_upto.store(key);
            o.revoke(key + 1);
        }
        stop.store(true);
        for (auto& t : writers) t.join();
        CHECK(violations.load() == 0);
        CHECK(held.load() > 0 && refused.load() > 0);
        std::printf("threads: %llu held, %llu refused, 0 violations\n", static_cast<unsigned long long>(held.load()),
                    static_cast<unsigned long long>(refused.load()));
    }
    owner.reset();
    CHECK(!View(addr).mapped());  // removed with its owner
    std::printf("region table: ok\n");
    return 0;
}
