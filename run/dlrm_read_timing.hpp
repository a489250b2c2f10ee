#pragma once
// What `meshtrain calibrate CONFIG` measures of a DLRM's data read (kind = "dlrm"): the step's
// read in the step (data.prefetch = 0, DlrmRun::read_training_batch) on the config's own
// training file, opened and checked against the config as DlrmRun opens it (run/dlrm_data.hpp:
// the dense source with a chunk cache that keeps every chunk of x_key and y_key, its rows by
// data.shuffle; SparseHdf5Reader holding its tables in memory), for this rank's slice of the
// run's first batches (BatchSchedule: data.shuffle, block_rows, shuffle_window, run.seed) sorted
// into file order, as the step reads them. Timed separately: SparseHdf5Reader::read_unagreed
// with all the config's tables and with each table alone (the per-table times, against each
// table's ids, give the per-id cost; each timed with the core's cache cleared of it first, as in
// the step), then, after the ids' agreement as in DlrmRun::read_rows, RowSource::read (the dense
// features and labels). The figures the cost model takes (HardwareProfile::hdf5_row_seconds,
// sparse_row_seconds, sparse_id_seconds):
//   hdf5_row_seconds   = dense time / rows (of the config's data.shuffle: the pattern is in it)
//   sparse_id_seconds  = the slope b of a least-squares fit time_t = a + b * ids_t over the
//                        tables alone (0 when every table holds as many ids, or b < 0)
//   sparse_row_seconds = (all tables' time - b * their ids) / (rows * tables), at least a
//                        tenth of the all tables' time / (rows * tables)
// so that the model gives the measured time of the config's file (exactly when the tenth floor
// does not apply and the file's ids per row are whole: the plan rounds them); the split between
// rows and ids carries it to files of other bag sizes. Each time the median over `batches`
// batches after a warm-up that fills the caches. Collective over `comm` (the readers open
// collectively); every rank measures its own, the caller combines them. Errors (a bad file, a
// file that does not fit the config, a dense row one rank cannot read) are AgreedErrors, the
// same one sentence on every rank.

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "framework/train/config.hpp"

namespace meshtrain {

struct DlrmReadTiming {
  std::string file;
  int64_t rows = 0;                   // per batch, this rank's
  int64_t tables = 0;                 // the config's
  int batches = 0;                    // timed (after the warm-up)
  std::string shuffle;                // data.shuffle: "none", "rows" or "blocks"
  double ids_per_batch = 0.0;         // all tables, the mean over the batches timed
  double dense_s = 0.0;               // RowSource::read of a batch, median
  std::vector<double> dense_batches;  // RowSource::read of each timed batch, in order
  double sparse_s = 0.0;              // read_unagreed of a batch, all tables, median
  std::vector<double> table_s;        // read_unagreed of a batch, each table alone, median
  std::vector<double> table_ids;      // each table's ids per batch, mean
  double hdf5_row_seconds = 0.0, sparse_row_seconds = 0.0, sparse_id_seconds = 0.0;
};

// Measures the read of config.data.path's batches of `rows` rows (the rank's share of
// data.batch_size) with `clock` (seconds). bad_input naming data.path when it names no file or
// more than one, and DlrmRun's checks of the file against the config. Collective over `comm`.
DlrmReadTiming measure_dlrm_read(const RunConfig& config, int64_t rows, MPI_Comm comm, int batches,
                                 double (*clock)());

// The profile figures from one rank's timings (calibrate passes the slowest rank's, its times
// and ids together: a step waits for it in the ids' agreement), as measure_dlrm_read documents;
// fills t's three figures.
void derive_dlrm_read_figures(DlrmReadTiming& t);

}  // namespace meshtrain
