#pragma once
// The pool of reusable slots behind the communicators' non-blocking operations: the
// Communicator's 16-bit wire buffers (communicator.cpp), the MPI backend's requests with
// their host staging and the NCCL backend's requests with their events. One type, so the
// three free lists choose a slot the same way.
//
// A slot holds buffers that keep their size between uses (its Capacity). acquire() takes
// the free slot that best fits the operation: the smallest whose buffers already hold it;
// else the largest (which the caller grows); else a new one. Not simply the last one
// freed: requests complete in an order that varies from step to step (DP gradient
// buckets of several sizes complete as they are polled), and a slot taken in that order
// would be grown again and again by whichever larger operation came to it, allocating
// inside steady-state steps. By best fit, the same operations as before find the slots
// they grew before. Among equals, the slot freed last is taken.
//
// Ownership: the pool owns every slot it made until it is destroyed. A slot in use is the
// caller's to give back with release() (or never, when it must stay out of use for good:
// a failed transfer may still touch its buffers). release() never allocates (the free list
// keeps room for every slot), so giving a slot back is safe in a noexcept path.
// Not thread-safe: one communicator is used by one thread.

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace meshtrain {

// What a slot's buffers hold, or what an operation needs: two sizes (send and receive,
// in any unit the pool's user chooses; 0 where a slot has no buffers).
struct SlotCapacity {
  std::size_t send = 0;
  std::size_t recv = 0;

  bool holds(const SlotCapacity& need) const { return send >= need.send && recv >= need.recv; }
  std::size_t total() const { return send + recv; }
};

// Slot: any type with `SlotCapacity capacity() const`.
template <class Slot>
class SlotPool {
 public:
  SlotPool() = default;
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // The free slot that best fits `need` (see the top of this file), taken off the free
  // list; when none is free, `make()` (returning a std::unique_ptr<Slot>) makes
  // one, owned by the pool. If make() throws, the pool is unchanged.
  template <class Make>
  Slot& acquire(const SlotCapacity& need, Make&& make) {
    std::size_t best = free_.size(), largest = free_.size();
    // From the back: the slot freed last comes first among equals.
    for (std::size_t k = free_.size(); k-- > 0;) {
      const SlotCapacity have = free_[k]->capacity();
      if (have.holds(need) && (best == free_.size() || have.total() < capacity_at(best))) {
        best = k;
      }
      if (largest == free_.size() || have.total() > capacity_at(largest)) largest = k;
    }
    const std::size_t chosen = best != free_.size() ? best : largest;
    if (chosen != free_.size()) {
      Slot* slot = free_[chosen];
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(chosen));  // keeps the order
      return *slot;
    }
    free_.reserve(slots_.size() + 1);  // room to give every slot back without allocating
    std::unique_ptr<Slot> made = make();
    slots_.push_back(std::move(made));
    return *slots_.back();
  }

  // Makes `count` more slots now (make(), as acquire's), each readied by `ready(slot)` (which
  // grows its buffers to what it will be asked to hold), and puts them on the free list. A
  // caller that knows how many operations it keeps in flight at once reserves them when it is
  // built, so that the pool does not grow inside a step whatever order they complete in.
  // Reservations add up (each caller reserves its own). If make() or ready() throws, the
  // slots made so far stay, free.
  template <class Make, class Ready>
  void reserve(std::size_t count, Make&& make, Ready&& ready) {
    for (std::size_t k = 0; k < count; ++k) {
      free_.reserve(slots_.size() + 1);
      std::unique_ptr<Slot> made = make();
      slots_.push_back(std::move(made));
      free_.push_back(slots_.back().get());
      ready(*slots_.back());
    }
  }

  // Gives a slot acquired from this pool back; it becomes the first choice among equals.
  void release(Slot& slot) noexcept { free_.push_back(&slot); }

  std::size_t size() const { return slots_.size(); }       // slots made
  std::size_t free_count() const { return free_.size(); }  // slots free now

 private:
  std::size_t capacity_at(std::size_t k) const { return free_[k]->capacity().total(); }

  std::vector<std::unique_ptr<Slot>> slots_;  // every slot made, owned
  std::vector<Slot*> free_;  // the free ones, in the order they were freed
};

}  // namespace meshtrain
