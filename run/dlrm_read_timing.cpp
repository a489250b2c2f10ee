#include "run/dlrm_read_timing.hpp"

#include <algorithm>
#include <cmath>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/io/data.hpp"
#include "framework/io/sparse_hdf5.hpp"
#include "run/dlrm_data.hpp"

namespace meshtrain {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

DlrmReadTiming measure_dlrm_read(const RunConfig& config, int64_t rows, MPI_Comm comm, int batches,
                                 double (*clock)()) {
  constexpr int kWarm = 3;
  DlrmReadTiming t;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  std::vector<std::string> tables;
  std::unique_ptr<RowSource> source;
  std::vector<std::vector<int64_t>> all;  // each batch's rows, in file order
  // Opened and checked as DlrmRun::open_data does (run/dlrm_data.hpp); the rows of the run's
  // first batches (BatchSchedule by data.shuffle, block_rows, shuffle_window and run.seed), this
  // rank's slice of each (ranks count = data.batch_size / rows slices, rank r the r % count-th),
  // sorted into file order as DlrmRun::read_training_batch sorts them.
  on_every_rank(comm, [&] {
    t.file = dlrm_one_file(config.data.path, "data.path", config.file);
    if (t.file.empty()) {
      MESHTRAIN_BAD_INPUT(config.file,
                          ": data.path names no file; calibrating a DLRM's data read needs its "
                          "training file");
    }
    tables = dlrm_table_names(config.model.dlrm());
    source = open_dlrm_train_source(config, t.file);
    const BatchSchedule schedule(source->shape().num_samples, config.data.batch_size,
                                 config.data.shuffle, config.run.seed, config.data.block_rows,
                                 config.data.shuffle_window);
    BatchSlice slice;
    slice.global_batch = config.data.batch_size;
    slice.rows = std::clamp<int64_t>(rows, 1, slice.global_batch);
    slice.count = slice.global_batch / slice.rows;
    slice.index = rank % slice.count;
    all.assign(static_cast<size_t>(batches + kWarm), std::vector<int64_t>(slice.rows));
    for (int b = 0; b < batches + kWarm; ++b) {
      std::vector<int64_t>& r = all[static_cast<size_t>(b)];
      schedule.slice_samples(b, slice, r.data());
      std::sort(r.begin(), r.end());
    }
    rows = slice.rows;
  });
  t.rows = rows;
  t.tables = static_cast<int64_t>(tables.size());
  t.batches = batches;
  t.shuffle = to_string(config.data.shuffle);
  std::vector<float> dense(static_cast<size_t>(rows * source->shape().features));
  std::vector<float> targets(static_cast<size_t>(rows));
  // Between two batches the step's forward, backward and optimizer pass over the model, the
  // tables and the activations and push the reader's arrays and HDF5's cached chunks out of the
  // core's cache; a loop of reads alone keeps them in. 32 MiB written before each timed read
  // push them out here too (the 2 MiB L2 a core of the build machine has, 16 times over).
  std::vector<char> evict(size_t{32} << 20);
  const auto push_out = [&](int b) {
    for (size_t i = 0; i < evict.size(); i += 64) evict[i] = static_cast<char>(evict[i] + b);
  };
  // `batches` timed reads of `reader`'s tables after kWarm untimed ones, each pushed out of the
  // cache first: the sparse read's seconds and the ids each read, and then after_agree(rows of
  // the batch, whether it is timed).
  struct SparseTimes {
    std::vector<double> seconds;
    double ids = 0.0;
  };
  const auto time_sparse = [&](SparseHdf5Reader& reader, auto&& after_agree) {
    SparseTimes times;
    for (int b = 0; b < batches + kWarm; ++b) {
      const std::vector<int64_t>& r = all[static_cast<size_t>(b)];
      push_out(b);
      const double t0 = clock();
      const SparseHdf5Reader::Problem problem = reader.read_unagreed(r.data(), rows);
      const double t1 = clock();
      // As DlrmRun::read_rows: the ids' checks agreed first (collective: a bad id is refused as
      // the run refuses it), then the dense rows.
      reader.agree(problem);
      after_agree(r, b >= kWarm);
      if (b < kWarm) continue;
      times.seconds.push_back(t1 - t0);
      for (size_t k = 0; k < reader.tables().size(); ++k) {
        times.ids += static_cast<double>(reader.batch(k).ids());
      }
    }
    return times;
  };
  {
    // Collective, agreeing on its own errors (a missing table names the file).
    SparseHdf5Reader reader(t.file, tables, rows, -1, comm, config.data.sparse_key);
    on_every_rank(comm,
                  [&] { check_dlrm_sparse_data(config, reader, source->shape().num_samples); });
    std::vector<double> dense_s;
    const SparseTimes sparse = time_sparse(reader, [&](const std::vector<int64_t>& r, bool timed) {
      // A dense row one rank cannot read is agreed on here, so every rank ends with its one
      // sentence before the next collective.
      double t2 = 0.0, t3 = 0.0;
      on_every_rank(comm, [&] {
        t2 = clock();
        source->read(r.data(), rows, RowBuffers{dense.data(), nullptr, targets.data()});
        t3 = clock();
      });
      if (timed) dense_s.push_back(t3 - t2);
    });
    t.dense_batches = dense_s;
    t.dense_s = median(dense_s);
    t.sparse_s = median(sparse.seconds);
    t.ids_per_batch = sparse.ids / batches;
  }
  // A table alone would also stay in the cache from one batch to the next (measured on the build
  // machine: a quarter of the time per element): pushed out the same way.
  for (const std::string& name : tables) {
    SparseHdf5Reader reader(t.file, {name}, rows, -1, comm, config.data.sparse_key);
    const SparseTimes alone = time_sparse(reader, [](const std::vector<int64_t>&, bool) {});
    t.table_s.push_back(median(alone.seconds));
    t.table_ids.push_back(alone.ids / batches);
  }
  return t;
}

void derive_dlrm_read_figures(DlrmReadTiming& t) {
  MESHTRAIN_REQUIRE(t.rows > 0 && t.tables > 0 && t.table_s.size() == t.table_ids.size(),
                    "derive_dlrm_read_figures: no rows, tables or per-table times");
  t.hdf5_row_seconds = t.dense_s / static_cast<double>(t.rows);
  // Least squares time = a + b * ids over the tables alone.
  const auto k = static_cast<double>(t.table_s.size());
  double mean_ids = 0.0, mean_s = 0.0;
  for (size_t i = 0; i < t.table_s.size(); ++i) {
    mean_ids += t.table_ids[i] / k;
    mean_s += t.table_s[i] / k;
  }
  double sxx = 0.0, sxy = 0.0;
  for (size_t i = 0; i < t.table_s.size(); ++i) {
    sxx += (t.table_ids[i] - mean_ids) * (t.table_ids[i] - mean_ids);
    sxy += (t.table_ids[i] - mean_ids) * (t.table_s[i] - mean_s);
  }
  // Tables that all hold (nearly) as many ids say nothing of the per-id cost.
  const bool spread = sxx > 1e-6 * std::max(mean_ids * mean_ids, 1.0) * k;
  t.sparse_id_seconds = spread ? std::max(sxy / sxx, 0.0) : 0.0;
  const double row_tables = static_cast<double>(t.rows) * static_cast<double>(t.tables);
  t.sparse_row_seconds =
      std::max(t.sparse_s - t.sparse_id_seconds * t.ids_per_batch, 0.1 * t.sparse_s) / row_tables;
}

}  // namespace meshtrain
