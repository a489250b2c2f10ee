// derive_dlrm_read_figures (run/dlrm_read_timing.hpp) on hand-built timings of known slope and
// intercept: the per-id slope of the tables alone, the per-row-and-table rest of the all-tables
// time, the tenth floor, and a slope of 0 (tables of equal ids, or a negative fit).

#include <gtest/gtest.h>

#include "base/error.hpp"
#include "run/dlrm_read_timing.hpp"

namespace meshtrain {
namespace {

// Figures computed in double from exact inputs: a least-squares fit of 3 points on a line and a
// few divisions, so 1e-12 relative covers the rounding (values near 1e-7 s).
constexpr double kRelative = 1e-12;

// 50 rows, 3 tables of 100, 200 and 300 ids a batch, each alone a + b * ids with a = 20 us and
// b = 0.1 us an id; the dense read 2 ms (40 us a row).
DlrmReadTiming timing() {
  DlrmReadTiming t;
  t.rows = 50;
  t.tables = 3;
  t.batches = 20;
  t.dense_s = 2e-3;
  t.table_ids = {100.0, 200.0, 300.0};
  for (const double ids : t.table_ids) t.table_s.push_back(20e-6 + 0.1e-6 * ids);
  t.ids_per_batch = 600.0;
  return t;
}

TEST(DlrmReadFigures, SlopeAndRestByHand) {
  DlrmReadTiming t = timing();
  t.sparse_s = 100e-6 + 0.1e-6 * 600.0;  // 100 us beyond the ids' 60 us
  derive_dlrm_read_figures(t);
  EXPECT_NEAR(t.hdf5_row_seconds, 2e-3 / 50, 40e-6 * kRelative);
  EXPECT_NEAR(t.sparse_id_seconds, 0.1e-6, 0.1e-6 * kRelative);
  EXPECT_NEAR(t.sparse_row_seconds, 100e-6 / 150, (100e-6 / 150) * 1e-9);
  // The model's sparse time of this file: the measured one.
  EXPECT_NEAR(150 * t.sparse_row_seconds + 600 * t.sparse_id_seconds, t.sparse_s,
              t.sparse_s * 1e-9);
}

// The all-tables time barely above its ids' share (62 us against 60 us): the rows' part is a
// tenth of the whole, not 2 us, and the model then gives more than the measured time.
TEST(DlrmReadFigures, TheTenthFloor) {
  DlrmReadTiming t = timing();
  t.sparse_s = 62e-6;
  derive_dlrm_read_figures(t);
  EXPECT_NEAR(t.sparse_id_seconds, 0.1e-6, 0.1e-6 * kRelative);
  EXPECT_NEAR(t.sparse_row_seconds, 6.2e-6 / 150, (6.2e-6 / 150) * 1e-9);
  EXPECT_GT(150 * t.sparse_row_seconds + 600 * t.sparse_id_seconds, t.sparse_s);
}

// Tables of equal ids say nothing of the per-id cost, and a fit falling with the ids is no cost:
// sparse_id_seconds 0, the whole all-tables time per row and table.
TEST(DlrmReadFigures, NoSlope) {
  DlrmReadTiming t = timing();
  t.table_ids = {200.0, 200.0, 200.0};
  t.table_s = {30e-6, 50e-6, 40e-6};
  t.sparse_s = 120e-6;
  derive_dlrm_read_figures(t);
  EXPECT_EQ(t.sparse_id_seconds, 0.0);
  EXPECT_NEAR(t.sparse_row_seconds, 120e-6 / 150, (120e-6 / 150) * 1e-9);
  t = timing();
  t.table_s = {60e-6, 40e-6, 20e-6};  // slower with fewer ids
  t.sparse_s = 120e-6;
  derive_dlrm_read_figures(t);
  EXPECT_EQ(t.sparse_id_seconds, 0.0);
  EXPECT_NEAR(t.sparse_row_seconds, 120e-6 / 150, (120e-6 / 150) * 1e-9);
  // No rows or no per-table times: refused.
  t.rows = 0;
  EXPECT_THROW(derive_dlrm_read_figures(t), Error);
}

}  // namespace
}  // namespace meshtrain
