// Endpoint addresses closed in this process, and the writes this process's engines have under
// way to each endpoint (one table of each per compiled module).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace fabric {

// Endpoint addresses closed in this process. Writing to one of them would touch freed provider
// state on providers whose addresses name their process (shm), so such writes take the slow
// path, which fails them with PeerUnreachable, and the engine sends them no control frame.
class ClosedSet {
  public:
    void add(const std::string& a) {
        std::lock_guard<std::mutex> lock(mu_);
        set_.insert(a);
        epoch_.fetch_add(1, std::memory_order_seq_cst);
    }
    void remove(const std::string& a) {
        std::lock_guard<std::mutex> lock(mu_);
        if (set_.erase(a)) epoch_.fetch_add(1, std::memory_order_release);
    }
    bool contains(const std::string& a) const {
        std::lock_guard<std::mutex> lock(mu_);
        return set_.count(a) != 0;
    }
    // (seq_cst: a writer reads it after announcing its post in InboundWrites, and a closing
    // engine reads InboundWrites after adding itself here; each sees the other's step)
    uint64_t epoch() const { return epoch_.load(std::memory_order_seq_cst); }

    static ClosedSet& instance() {
        static ClosedSet set;
        return set;
    }

  private:
    mutable std::mutex mu_;
    std::unordered_set<std::string> set_;
    std::atomic<uint64_t> epoch_{1};
};

// NIC-0 addresses of the engines open in this process (an engine adds its own when it opens and
// takes it out when it is destroyed). A writer counts its writes in InboundWrites only to
// these: a closing engine waits for the writes to its own address, and only an engine of this
// process can close it; counting every write cost two locked instructions per work request.
class LocalEndpoints {
  public:
    void add(const std::string& a) {
        std::lock_guard<std::mutex> lock(mu_);
        count_[a]++;
        epoch_.fetch_add(1, std::memory_order_seq_cst);
    }
    void remove(const std::string& a) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = count_.find(a);
        if (it == count_.end()) return;
        if (--it->second == 0) count_.erase(it);
        epoch_.fetch_add(1, std::memory_order_seq_cst);
    }
    bool contains(const std::string& a) const {
        std::lock_guard<std::mutex> lock(mu_);
        return count_.count(a) != 0;
    }
    uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }

    static LocalEndpoints& instance() {
        static LocalEndpoints set;
        return set;
    }

  private:
    mutable std::mutex mu_;
    std::unordered_map<std::string, int> count_;
    std::atomic<uint64_t> epoch_{1};
};

// Per endpoint address: writes that engines of this process posted to it and have not reaped
// (seen complete or failed) yet. On shm a sender reaps a write through the target's memory
// (libfabric 1.17 smr_progress_resp: the inject or SAR buffers it used live in the target's
// region), and a target of the same process is reached through its own mapping, which its
// close unmaps. So an engine closing in this process (its address in ClosedSet: no new post
// reaches it) keeps taking commands until the writes under way to it are reaped (Engine's
// drain_on_close), and only then lets its endpoint go. Each writer holds one counter per peer
// for as long as it lives; the table keeps weak references.
class InboundWrites {
  public:
    using Counter = std::atomic<int64_t>;

    std::shared_ptr<Counter> counter(const std::string& a) {
        std::lock_guard<std::mutex> lock(mu_);
        auto& slot = map_[a];
        std::shared_ptr<Counter> c = slot.lock();
        if (!c) {
            c = std::make_shared<Counter>(0);
            slot = c;
            if (map_.size() > 2 * kPrune) {  // addresses no engine writes to any more
                for (auto it = map_.begin(); it != map_.end();) it = it->second.expired() ? map_.erase(it) : ++it;
            }
        }
        return c;
    }

    // Writes under way to ``a`` from this process's engines.
    int64_t outstanding(const std::string& a) const {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(a);
        if (it == map_.end()) return 0;
        std::shared_ptr<Counter> c = it->second.lock();
        return c ? c->load(std::memory_order_seq_cst) : 0;
    }

    static InboundWrites& instance() {
        static InboundWrites table;
        return table;
    }

  private:
    static constexpr size_t kPrune = 512;
    mutable std::mutex mu_;
    std::unordered_map<std::string, std::weak_ptr<Counter>> map_;
};

}  // namespace fabric
