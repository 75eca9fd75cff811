// Lock-free multi-producer single-consumer queue (Vyukov's intrusive node queue).
//
// Producers (Python threads submitting requests, with the GIL released) push with one atomic
// exchange. One consumer at a time: whoever holds the engine's progress lock (its worker, or
// a submitter posting inline), so consumers hand the queue over through that mutex. push()
// never blocks and never allocates beyond the node the caller hands over.
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

    // Nothing queued and no push under way. Exact for the consumer; from any other thread
    // (the worker deciding whether to nap while a submitter consumes) a hint that may be stale.
    bool empty() const {
        return tail_.load(std::memory_order_relaxed) == &stub_ && head_.load(std::memory_order_seq_cst) == &stub_;
    }

    // Consumer only. Returns nullptr when empty (or when a producer is mid-push; the item
    // then shows up on a later call).
    std::unique_ptr<T> pop() {
        Node* tail = tail_.load(std::memory_order_relaxed);
        Node* next = tail->next.load(std::memory_order_acquire);
        if (tail == &stub_) {
            if (next == nullptr) return nullptr;
            tail_.store(next, std::memory_order_relaxed);
            tail = next;
            next = next->next.load(std::memory_order_acquire);
        }
        if (next != nullptr) {
            tail_.store(next, std::memory_order_relaxed);
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
            tail_.store(next, std::memory_order_relaxed);
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
    std::atomic<Node*> tail_;  // written by the consumer only (atomic: empty() may be asked elsewhere)
    Node stub_{nullptr, {nullptr}};
};

}  // namespace fabric
