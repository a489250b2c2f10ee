// SlotPool (framework/comm/slot_pool.hpp), the free list of the wire buffers and of the MPI and
// NCCL requests: best fit by capacity, the largest when none fits, a new slot when none is
// free, the slot freed last among equals, and a failed make() leaving the pool unchanged.

#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <vector>

#include "framework/comm/slot_pool.hpp"

namespace meshtrain::testing {
namespace {

// A slot whose buffers hold `send` and `recv` units; `id` tells the slots apart.
struct Slot {
  int id = 0;
  SlotCapacity held;
  SlotCapacity capacity() const { return held; }
};

using Pool = SlotPool<Slot>;

// Acquires a slot for `need` and grows it to hold `need`, as the communicators do.
Slot& take(Pool& pool, SlotCapacity need, int& made) {
  Slot& slot = pool.acquire(need, [&] {
    auto fresh = std::make_unique<Slot>();
    fresh->id = ++made;
    return fresh;
  });
  slot.held.send = std::max(slot.held.send, need.send);
  slot.held.recv = std::max(slot.held.recv, need.recv);
  return slot;
}

// Slots of these capacities, made and then all freed in this order.
std::vector<Slot*> free_slots(Pool& pool, std::initializer_list<SlotCapacity> sizes, int& made) {
  std::vector<Slot*> slots;
  for (const SlotCapacity& size : sizes) slots.push_back(&take(pool, size, made));
  for (Slot* slot : slots) pool.release(*slot);
  return slots;
}

TEST(SlotPool, MakesASlotOnlyWhenNoneIsFree) {
  Pool pool;
  int made = 0;
  Slot& a = take(pool, {4, 4}, made);
  Slot& b = take(pool, {4, 4}, made);  // a is in use
  EXPECT_NE(&a, &b);
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_EQ(pool.free_count(), 0u);
  pool.release(a);
  EXPECT_EQ(&take(pool, {4, 4}, made), &a);
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_EQ(made, 2);
}

TEST(SlotPool, TakesTheSmallestSlotThatHoldsTheOperation) {
  Pool pool;
  int made = 0;
  const std::vector<Slot*> slots = free_slots(pool, {{1, 1}, {100, 100}, {10, 10}}, made);
  Slot* large = slots[1];
  Slot* middle = slots[2];
  // Holds 8 + 8: middle and large do; middle is the smaller.
  EXPECT_EQ(&take(pool, {8, 8}, made), middle);
  // Both sizes count: a slot with enough send room but too little receive room does not fit.
  pool.release(*middle);
  EXPECT_EQ(&take(pool, {5, 50}, made), large);
  EXPECT_EQ(pool.size(), 3u);
}

TEST(SlotPool, TakesTheLargestWhenNoneHoldsTheOperation) {
  Pool pool;
  int made = 0;
  const std::vector<Slot*> slots = free_slots(pool, {{2, 2}, {6, 6}, {4, 4}}, made);
  // None holds 20: the largest is grown rather than a small one or a new one.
  EXPECT_EQ(&take(pool, {20, 20}, made), slots[1]);
  EXPECT_EQ(pool.size(), 3u);
}

TEST(SlotPool, SizesCompletingInAnyOrderFindTheirSlotsAgain) {
  // DP buckets of three sizes, completing in a different order each step: after the first
  // step no slot grows and none is made.
  Pool pool;
  int made = 0;
  const SlotCapacity sizes[3] = {{0, 300}, {0, 100}, {0, 200}};
  Slot* first[3] = {};
  for (int k = 0; k < 3; ++k) first[k] = &take(pool, sizes[k], made);
  const int orders[3][3] = {{2, 0, 1}, {1, 2, 0}, {0, 1, 2}};
  for (const auto& order : orders) {
    for (int k : order) pool.release(*first[k]);
    for (int k = 0; k < 3; ++k) {
      Slot& slot = take(pool, sizes[k], made);
      EXPECT_EQ(&slot, first[k]) << "bucket " << k;
      EXPECT_EQ(slot.held.recv, sizes[k].recv);  // not grown by a larger bucket
    }
  }
  EXPECT_EQ(made, 3);
}

TEST(SlotPool, AmongEqualsTakesTheSlotFreedLast) {
  Pool pool;
  int made = 0;
  Slot& a = take(pool, {}, made);
  Slot& b = take(pool, {}, made);
  Slot& c = take(pool, {}, made);
  pool.release(b);
  pool.release(c);
  pool.release(a);
  EXPECT_EQ(&take(pool, {}, made), &a);
  EXPECT_EQ(&take(pool, {}, made), &c);
  EXPECT_EQ(&take(pool, {}, made), &b);
}

TEST(SlotPool, ReservedSlotsServeEveryOrderWithoutMakingOrGrowing) {
  // What a model reserves at build (Communicator::reserve_started_*): three DP buckets
  // ({0, 300}, {0, 100}, {0, 200} as reserve_started_all_reduces asks) and one FSDP prefetch
  // ({50, 100}) on one communicator. Then, in any order of starting and completing, up to all
  // four in flight: no slot is made and none grows.
  Pool pool;
  int made = 0;
  auto make = [&] {
    auto fresh = std::make_unique<Slot>();
    fresh->id = ++made;
    return fresh;
  };
  const SlotCapacity sizes[4] = {{0, 300}, {0, 100}, {0, 200}, {50, 100}};
  for (const SlotCapacity& need : sizes) {
    pool.reserve(1, make, [&](Slot& slot) { slot.held = need; });
  }
  ASSERT_EQ(made, 4);
  EXPECT_EQ(pool.free_count(), 4u);
  const int orders[4][4] = {{3, 0, 1, 2}, {1, 2, 3, 0}, {2, 3, 0, 1}, {0, 1, 2, 3}};
  for (const auto& order : orders) {
    Slot* taken[4] = {};
    for (int k : order) {
      taken[k] = &take(pool, sizes[k], made);
      EXPECT_EQ(taken[k]->held.send, sizes[k].send) << "operation " << k << ": a slot grew";
      EXPECT_EQ(taken[k]->held.recv, sizes[k].recv) << "operation " << k << ": a slot grew";
    }
    for (int k = 4; k-- > 0;) pool.release(*taken[order[k]]);
  }
  EXPECT_EQ(made, 4) << "a slot was made after the reservation";
  // Reservations add up: one more makes a fifth slot.
  pool.reserve(1, make, [](Slot&) {});
  EXPECT_EQ(pool.size(), 5u);
  EXPECT_EQ(pool.free_count(), 5u);
}

TEST(SlotPool, AFailedMakeLeavesThePoolUnchanged) {
  Pool pool;
  int made = 0;
  Slot& a = take(pool, {1, 1}, made);
  EXPECT_THROW(pool.acquire({}, []() -> std::unique_ptr<Slot> { throw std::runtime_error("no"); }),
               std::runtime_error);
  EXPECT_EQ(pool.size(), 1u);
  pool.release(a);
  EXPECT_EQ(pool.free_count(), 1u);
  EXPECT_EQ(&take(pool, {1, 1}, made), &a);
}

}  // namespace
}  // namespace meshtrain::testing
