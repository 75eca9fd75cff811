// Lock-free multi-producer single-consumer queue (Vyukov's intrusive node queue).
//
// Producers (Python threads submitting requests, with the GIL released) push with one atomic
// exchange; the engine's worker thread is the only consumer. push() never blocks and never
// allocates beyond the node the caller hands over.
#pragma once

#include <atomic>
#include <memory>

namespace fabric {

template <class T>
class MpscQueue {
  public:
    MpscQueue() : head_(&stub_), tail_(&stub_) {}
    MpscQueue(const MpscQueue&) = delete;
    MpscQueue& operator=(const MpscQueue&) = delete;

    ~MpscQueue() {
        while (pop()) {
        }
    }

    void push(std::unique_ptr<T> value) {
        Node* node = new Node{std::move(value), {nullptr}};
        Node* prev = head_.exchange(node, std::memory_order_acq_rel);
        prev->next.store(node, std::memory_order_release);
    }

    // Consumer only: nothing queued and no push under way.
    bool empty() const { return tail_ == &stub_ && head_.load(std::memory_order_seq_cst) == &stub_; }

    // Consumer only. Returns nullptr when empty (or when a producer is mid-push; the item
    // then shows up on a later call).
    std::unique_ptr<T> pop() {
        Node* tail = tail_;
        Node* next = tail->next.load(std::memory_order_acquire);
        if (tail == &stub_) {
            if (next == nullptr) return nullptr;
            tail_ = next;
            tail = next;
            next = next->next.load(std::memory_order_acquire);
        }
        if (next != nullptr) {
            tail_ = next;
            std::unique_ptr<T> out = std::move(tail->value);
            delete tail;
            return out;
        }
        if (tail != head_.load(std::memory_order_acquire)) return nullptr;  // push in progress
        stub_.next.store(nullptr, std::memory_order_relaxed);
        Node* prev = head_.exchange(&stub_, std::memory_order_acq_rel);
        prev->next.store(&stub_, std::memory_order_release);
        next = tail->next.load(std::memory_order_acquire);
        if (next != nullptr) {
            tail_ = next;
            std::unique_ptr<T> out = std::move(tail->value);
            delete tail;
            return out;
        }
        return nullptr;
    }

  private:
    struct Node {
        std::unique_ptr<T> value;
        std::atomic<Node*> next;
    };
    std::atomic<Node*> head_;
    Node* tail_;
    Node stub_{nullptr, {nullptr}};
};

}  // namespace fabric
