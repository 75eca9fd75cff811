// Coverage-guided fuzz target (libFuzzer) for what the engine core parses from the network:
// control frames (Engine::got_message and all it calls: ping and pong, hello and its answer,
// a path reset, a count query and its answer, user messages, and frames of another wire
// protocol, got_foreign). A frame is whatever any process
// that reaches a NIC can send; the engine must neither crash nor touch memory it does not own
// (the target is built with ASan and UBSan), and it must keep serving honest peers.
//
// The world, built once: engine A (two in-memory NICs, fake_nic.hpp), honest engine B (two
// NICs) that writes to A, and a bare NIC "mallory/nic0" that sends A raw frames.
//
// One input: records [length: 2 bytes, little endian][frame: length bytes], sent in order from
// mallory to A's NIC 0 (A's answers go wherever a frame's sender field says: to B, to A itself,
// to mallory, or nowhere). Then the oracle, every input:
//   1. B fences A within 5 s (B's ping is behind every frame: A has handled them all);
//   2. B writes 64 bytes with imm 7 to A, once on each NIC: the write completes OK within 5 s,
//      its bytes are in A's memory, and A's count of imm 7 grows by exactly 2.
// A failed check prints what failed and aborts: libFuzzer keeps the input as a crash.
//
//   nox -s fuzz -- --native-frames (clang, -fsanitize=fuzzer,address,undefined; bounded time)
//   corpus: tests/fuzz/corpus-frames/ (seeded from a real exchange: FABRIC_FUZZ_SEED_DIR=dir)
//
// Built with -DFABRIC_FUZZ_REPLAY (any compiler, no libFuzzer) it is a plain program that runs
// each file named on its command line (or each file of a directory) once: `nox -s sanitize`
// replays the corpus and the kept crashes under ASan and UBSan on every change.
#include <fabric/counters.hpp>
#include <fabric/engine.hpp>

#include "fake_nic.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifdef FABRIC_FUZZ_REPLAY
#include <dirent.h>
#include <sys/stat.h>
#endif

namespace {

using fabric::CounterTable;
using fabric_test::FakeEngine;
using fabric_test::FakeFabric;
using fabric_test::FakeNic;

[[noreturn]] void fail(const char* what) {
    std::fprintf(stderr, "fuzz_frames: %s\n", what);
    std::abort();
}

constexpr uint32_t kImm = 7;
constexpr size_t kPiece = 64;
constexpr double kWait = 5.0;

struct World {
    FakeFabric fabric;
    std::shared_ptr<CounterTable> a_counts = std::make_shared<CounterTable>();
    std::unique_ptr<FakeEngine> a, b;
    std::unique_ptr<FakeNic> mallory;
    uint64_t to_a = 0;                 // mallory's handle for A's NIC 0
    std::vector<unsigned char> src, dst;
    std::shared_ptr<fabric::Target> spec;
    std::shared_ptr<const std::vector<void*>> descs;
    uint64_t next_id = 1;
    uint64_t expected = 0;  // A's count of kImm so far
    std::vector<std::string> seeds;    // frames sent to A while seeding (FABRIC_FUZZ_SEED_DIR)

    World() : src(2 * kPiece), dst(2 * kPiece, 0) {
        a = fabric_test::open_engine(fabric, "A", 2, a_counts, /*chaos=*/false);
        b = fabric_test::open_engine(fabric, "B", 2, std::make_shared<CounterTable>(), /*chaos=*/false);
        mallory = std::make_unique<FakeNic>(fabric, "mallory/nic0");
        to_a = mallory->insert_peer(a->nic(0).address());
        spec = std::make_shared<fabric::Target>();
        for (int n = 0; n < 2; n++) {
            spec->addresses.push_back(a->nic(n).address());
            spec->rkeys.push_back(a->nic(n).register_remote(dst.data(), dst.size()));
        }
        spec->remote_base = reinterpret_cast<uint64_t>(dst.data());
        descs = std::make_shared<const std::vector<void*>>(2, nullptr);
        const char* seed_dir = std::getenv("FABRIC_FUZZ_SEED_DIR");
        if (seed_dir != nullptr) {
            const std::string a0 = a->nic(0).address();
            fabric.on_send = [this, a0](const std::string& to, const std::string& m) {
                if (to == a0) seeds.push_back(m);
            };
        }
        // An honest session first (hello and its answer, fences, a message): the frames of a
        // real exchange are the seed corpus.
        for (int i = 0; i < 3; i++) honest_round(i);
        message();
        check_forged_pong();
        if (seed_dir != nullptr) {
            fabric.on_send = nullptr;
            write_seeds(seed_dir);
        }
    }

    ~World() {
        b->close();
        a->close();
    }

    // A control frame of ``type`` as engine ``from`` would send it (speaking ``wire``).
    static std::string frame(char type, const std::string& from, uint64_t nonce, const std::string& extra,
                             char wire = fabric::kWireByte) {
        std::string f(1, wire);
        f.push_back(type);
        f.push_back(static_cast<char>(from.size()));
        f += from;
        f.append(reinterpret_cast<const char*>(&nonce), sizeof(nonce));
        return f + extra;
    }

    // A forged answer to a fence B has not asked yet (mallory posing as engine D) does not
    // answer B's later fences: once D is gone, B's next fence to it is not answered.
    void check_forged_pong() {
        auto d = fabric_test::open_engine(fabric, "D", 1, std::make_shared<CounterTable>(), false);
        const std::string d0 = d->nic(0).address();
        if (!b->fence({d0}, kWait).empty()) fail("D did not answer B's fence");
        uint64_t to_b = mallory->insert_peer(b->nic(0).address());
        std::string pong = frame(2, d0, uint64_t(1) << 62, "");
        if (mallory->post_send(pong.data(), pong.size(), nullptr, to_b, nullptr) != 0) fail("send refused");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // B's worker takes it
        d->close();
        d.reset();
        if (b->fence({d0}, 0.2).empty()) fail("a forged pong answered a fence asked after it");
        mallory->remove_peer(to_b);
        mallory->drain();
    }

    void message() {
        auto msg = std::make_unique<fabric::Request>();
        uint64_t id = next_id++;
        msg->id = id;
        msg->send_to = a->nic(0).address();
        const std::string from = b->nic(0).address();
        msg->payload = std::string(1, char(from.size())) + from + "hello from B";
        b->submit(std::move(msg));
        wait_done(id);
    }

    // Waits for request ``id`` of B: it must complete OK.
    void wait_done(uint64_t id) {
        auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(kWait);
        while (std::chrono::steady_clock::now() < until) {
            fabric::Batch batch = b->wait_batch(0.01);
            for (const auto& c : batch.done) {
                if (c.id != id) continue;
                if (c.status != fabric::kOk) {
                    std::fprintf(stderr, "fuzz_frames: request %llu failed: %d %s\n",
                                 static_cast<unsigned long long>(id), c.status, c.message.c_str());
                    fail("an honest request failed");
                }
                return;
            }
        }
        fail("an honest request did not complete in 5 s");
    }

    // The oracle: B fences A, then writes to A through both NICs with exact counts and bytes.
    void honest_round(int round) {
        if (!b->fence({a->nic(0).address()}, kWait).empty()) fail("A did not answer B's fence in 5 s");
        for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<unsigned char>(i * 7 + round * 13 + 1);
        auto req = std::make_unique<fabric::Request>();
        uint64_t id = next_id++;
        req->id = id;
        req->has_imm = true;
        req->imm = kImm;
        req->src_desc = descs;
        req->targets.push_back(spec);
        req->ops.resize(2);
        for (int i = 0; i < 2; i++) {
            fabric::OpCtx& op = req->ops[i];
            op.nic = uint32_t(i);
            op.target = 0;
            op.src = reinterpret_cast<uint64_t>(src.data() + size_t(i) * kPiece);
            op.dst_off = size_t(i) * kPiece;
            op.len = kPiece;
        }
        b->submit(std::move(req));
        wait_done(id);
        expected += 2;
        auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(kWait);
        while (a_counts->value(kImm) < expected && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        if (a_counts->value(kImm) != expected) fail("A's count of the honest imm is not exact");
        if (std::memcmp(src.data(), dst.data(), src.size()) != 0) fail("the honest bytes did not land exactly");
    }

    void write_seeds(const char* dir) {
        // and one well-formed frame of each kind B could send but did not (B's address, a
        // nonce, the body each kind takes): answers, a path reset, a count query and answer
        const std::string from = b->nic(0).address();
        seeds.push_back(frame(2, from, 2, ""));                                         // pong
        seeds.push_back(frame(4, from, 1, std::string(8, '\x11') + '\x01'));           // hello answer
        seeds.push_back(frame(5, from, 3, std::string(1, '\x01')));                     // query, NIC 1
        seeds.push_back(frame(6, from, 3, std::string(17 + sizeof(fabric::Sums), '\0')));  // counts
        seeds.push_back(frame(7, from, 0, std::string(1, '\x01')));                     // path reset
        seeds.push_back(frame(8, from, 0, ""));                                         // poke
        // frames of another wire protocol: a ping claiming B, and the answer to one
        const char other = static_cast<char>(0x80 | (fabric::kWireVersion + 1));
        seeds.push_back(frame(1, from, 0, "", other));
        seeds.push_back(frame(fabric::kFrameForeign, from, 0, std::string(1, fabric::kWireByte), other));
        for (size_t i = 0; i < seeds.size(); i++) {
            std::string rec(2, '\0');
            rec[0] = static_cast<char>(seeds[i].size() & 0xff);
            rec[1] = static_cast<char>((seeds[i].size() >> 8) & 0xff);
            rec += seeds[i];
            const bool ours = seeds[i].size() >= 2 && seeds[i][0] == fabric::kWireByte;
            std::string path = std::string(dir) + "/seed-" + std::to_string(i) +
                               (ours ? "-type" + std::to_string(int(uint8_t(seeds[i][1]))) : "-foreign");
            std::ofstream(path, std::ios::binary) << rec;
        }
        std::fprintf(stderr, "fuzz_frames: %zu seed frames written to %s\n", seeds.size(), dir);
    }

    void run(const uint8_t* data, size_t size) {
        size_t off = 0;
        while (off + 2 <= size) {
            size_t len = size_t(data[off]) | (size_t(data[off + 1]) << 8);
            off += 2;
            len = std::min(len, size - off);
            std::string frame(reinterpret_cast<const char*>(data + off), len);
            off += len;
            if (mallory->post_send(frame.data(), frame.size(), nullptr, to_a, nullptr) != 0)
                fail("the fake NIC refused a send");
        }
        mallory->drain();  // A's answers to it, and its own completions
        a->wait_batch(0);  // the user messages A took (mallory's included): the app's part
        honest_round(int(size & 0xff));
    }
};

World& world() {
    static World* w = new World();  // (never destroyed: libFuzzer exits from anywhere)
    return *w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    world().run(data, size);
    return 0;
}

#ifdef FABRIC_FUZZ_REPLAY
namespace {
int replay(const std::string& path) {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
        std::fprintf(stderr, "fuzz_frames: cannot read %s\n", path.c_str());
        return 1;
    }
    if (S_ISDIR(st.st_mode)) {
        DIR* d = opendir(path.c_str());
        if (d == nullptr) return 1;
        std::vector<std::string> names;
        while (dirent* e = readdir(d))
            if (e->d_name[0] != '.') names.push_back(path + "/" + e->d_name);
        closedir(d);
        int n = 0;
        for (const auto& name : names) n += replay(name);
        return n;
    }
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    return 1;
}
}  // namespace

int main(int argc, char** argv) {
    int runs = 0;
    world();  // (FABRIC_FUZZ_SEED_DIR: writes the seeds)
    for (int i = 1; i < argc; i++) runs += replay(argv[i]);
    std::printf("fuzz_frames: %d inputs replayed, the engine served its honest peer after each\n", runs);
    return 0;
}
#endif
