// Endpoint addresses closed in this process (one table per compiled module).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
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
        epoch_.fetch_add(1, std::memory_order_release);
    }
    void remove(const std::string& a) {
        std::lock_guard<std::mutex> lock(mu_);
        if (set_.erase(a)) epoch_.fetch_add(1, std::memory_order_release);
    }
    bool contains(const std::string& a) const {
        std::lock_guard<std::mutex> lock(mu_);
        return set_.count(a) != 0;
    }
    uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }

    static ClosedSet& instance() {
        static ClosedSet set;
        return set;
    }

  private:
    mutable std::mutex mu_;
    std::unordered_set<std::string> set_;
    std::atomic<uint64_t> epoch_{1};
};

}  // namespace fabric
