// The engine core's own cost per work request, without a provider: an engine over a NIC that
// completes every write at its next poll (no copy, no lock), fed paged requests the way the
// KvCache app feeds it (80 layers x 512 page writes with one imm each, submitted from another
// thread while the worker posts). What it prints is the worker's time per work request, the
// part of a GPU paged write (CUDA IPC) or an shm one that is not the domain's.
//
//   g++ -std=c++17 -O2 -pthread -I packages/fabric-core/src/fabric_core/include \
//       benchmarks/native/engine_per_wr.cpp -o /tmp/engine_per_wr && /tmp/engine_per_wr [reps]
//
// (perf record -g on it shows where the time goes.)
#include <fabric/counters.hpp>
#include <fabric/engine.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace {

// A NIC that takes every write and reports it done at the next poll.
class NullNic {
  public:
    explicit NullNic(std::string address) : address_(std::move(address)) {}
    std::string address() const { return address_; }
    uint64_t insert_peer(const std::string&) { return next_peer_++; }
    void remove_peer(uint64_t) {}
    bool virt_addr() const { return true; }
    bool sources() const { return true; }
    bool stale_peers() const { return false; }
    void* local_desc(void*, size_t) { return this; }
    int post_write(const fabric::WriteOp&, void* ctx) {
        done_.push_back(ctx);
        return 0;
    }
    int post_send(const void*, size_t, void*, uint64_t, void* ctx) {
        sends_.push_back(ctx);
        return 0;
    }
    int post_recv(void*, size_t, void*, void*) { return 0; }
    template <class Sink>
    size_t poll(Sink& sink) {
        size_t n = done_.size() + sends_.size();
        for (void* c : done_) sink.on_write_done(c);
        for (void* c : sends_) sink.on_send_done(c);
        done_.clear();
        sends_.clear();
        return n;
    }

  private:
    std::string address_;
    uint64_t next_peer_ = 0;
    std::vector<void*> done_, sends_;
};

using Engine = fabric::Engine<NullNic>;

}  // namespace

int main(int argc, char** argv) {
    const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
    constexpr int kLayers = 80, kPages = 512;
    constexpr uint64_t kPage = 32 << 10;
    std::vector<std::unique_ptr<NullNic>> nics;
    nics.push_back(std::make_unique<NullNic>("bench/nic0"));
    Engine engine(std::move(nics), std::make_shared<fabric::CounterTable>(), 7, false, -1, 16, 256);
    auto target = std::make_shared<fabric::Target>();
    target->addresses.push_back("peer/nic0");
    target->rkeys.push_back(1);
    target->remote_base = 1 << 20;
    auto desc = std::make_shared<const std::vector<void*>>(1, nullptr);
    uint64_t id = 1;
    std::vector<double> per_wr;
    for (int rep = 0; rep < reps + 1; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        for (int layer = 0; layer < kLayers; layer++) {
            auto req = std::make_unique<fabric::Request>();
            req->id = id++;
            req->has_imm = true;
            req->imm = 100 + layer;
            req->src_desc = desc;
            req->targets.push_back(target);
            req->ops.resize(kPages);
            for (int p = 0; p < kPages; p++) {
                fabric::OpCtx& op = req->ops[p];
                op.nic = 0;
                op.target = 0;
                op.src = uint64_t(p) * 3 * kPage + 4096;
                op.dst_off = uint64_t(p) * 5 * kPage;
                op.len = kPage;
            }
            engine.submit(std::move(req), false);
        }
        size_t done = 0;
        while (done < size_t(kLayers)) {
            fabric::Batch b = engine.wait_batch(1.0);
            for (auto& c : b.done) {
                if (c.status != fabric::kOk) {
                    std::fprintf(stderr, "request %llu failed: %s\n", (unsigned long long)c.id, c.message.c_str());
                    return 1;
                }
                done++;
            }
        }
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0) per_wr.push_back(s * 1e9 / (kLayers * kPages));
    }
    std::sort(per_wr.begin(), per_wr.end());
    std::printf("engine core, %d x %d page writes with an imm: median %.0f ns per work request (min %.0f)\n",
                kLayers, kPages, per_wr[per_wr.size() / 2], per_wr.front());
    engine.close();
    return 0;
}
