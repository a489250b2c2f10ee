#include "run/dlrm_read_timing.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "base/error.hpp"
#include "framework/io/data.hpp"
#include "framework/io/sparse_hdf5.hpp"

namespace meshtrain {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// `batches` + `warm` batches of `rows` distinct random rows of [0, n), each sorted (the same on
// every call with the same seed).
std::vector<std::vector<int64_t>> draw_batches(int64_t n, int64_t rows, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> row(0, n - 1);
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(count));
  for (auto& b : out) {
    while (static_cast<int64_t>(b.size()) < rows) {
      b.push_back(row(rng));
      if (static_cast<int64_t>(b.size()) == rows) {
        std::sort(b.begin(), b.end());
        b.erase(std::unique(b.begin(), b.end()), b.end());
      }
    }
  }
  return out;
}

}  // namespace

DlrmReadTiming measure_dlrm_read(const RunConfig& config, int64_t rows, MPI_Comm comm, int batches,
                                 double (*clock)()) {
  constexpr int kWarm = 3;
  DlrmReadTiming t;
  const std::vector<std::string> files = expand_data_paths(config.data.path, "data.path");
  if (files.size() != 1) {
    MESHTRAIN_BAD_INPUT(config.file, ": data.path names ", files.size(),
                        " files; calibrating a DLRM's data read needs its one training file");
  }
  t.file = files.front();
  std::vector<std::string> tables;
  for (const DlrmTable& table : config.model.dlrm().tables) tables.push_back(table.name);
  t.rows = rows;
  t.tables = static_cast<int64_t>(tables.size());
  t.batches = batches;
  // As DlrmRun::open_data: every chunk of x_key and y_key kept once read.
  const DlrmDataCaches caches =
      dlrm_data_cache_bytes(t.file, {}, "", {config.data.x_key, config.data.y_key});
  Hdf5SourceOptions options;
  options.chunk_cache_bytes = std::max(caches.dense_budget(), options.chunk_cache_bytes);
  options.random_rows = true;
  options.x_name = config.data.x_key;
  options.y_name = config.data.y_key;
  std::unique_ptr<RowSource> source = open_hdf5_source({t.file}, 1, options);
  const int64_t n = source->shape().num_samples;
  rows = std::min(rows, n);
  t.rows = rows;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const auto all =
      draw_batches(n, rows, batches + kWarm, 0x5eed0000u + static_cast<uint64_t>(rank));
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
  {
    SparseHdf5Reader reader(t.file, tables, rows, -1, comm, config.data.sparse_key);
    std::vector<double> dense_s, sparse_s;
    double ids = 0.0;
    for (int b = 0; b < batches + kWarm; ++b) {
      const std::vector<int64_t>& r = all[static_cast<size_t>(b)];
      push_out(b);
      const double t0 = clock();
      const SparseHdf5Reader::Problem problem = reader.read_unagreed(r.data(), rows);
      const double t1 = clock();
      source->read(r.data(), rows, RowBuffers{dense.data(), nullptr, targets.data()});
      const double t2 = clock();
      reader.agree(problem);  // collective: a bad id is refused as the run refuses it
      if (b < kWarm) continue;
      sparse_s.push_back(t1 - t0);
      dense_s.push_back(t2 - t1);
      for (size_t k = 0; k < tables.size(); ++k) ids += static_cast<double>(reader.batch(k).ids());
    }
    t.dense_batches = dense_s;
    t.dense_s = median(dense_s);
    t.sparse_s = median(sparse_s);
    t.ids_per_batch = ids / batches;
  }
  // A table alone would also stay in the cache from one batch to the next (measured on the build
  // machine: a quarter of the time per element): pushed out the same way.
  for (const std::string& name : tables) {
    SparseHdf5Reader reader(t.file, {name}, rows, -1, comm, config.data.sparse_key);
    std::vector<double> s;
    double ids = 0.0;
    for (int b = 0; b < batches + kWarm; ++b) {
      const std::vector<int64_t>& r = all[static_cast<size_t>(b)];
      push_out(b);
      const double t0 = clock();
      const SparseHdf5Reader::Problem problem = reader.read_unagreed(r.data(), rows);
      const double t1 = clock();
      reader.agree(problem);
      if (b < kWarm) continue;
      s.push_back(t1 - t0);
      ids += static_cast<double>(reader.batch(0).ids());
    }
    t.table_s.push_back(median(s));
    t.table_ids.push_back(ids / batches);
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
