// DlrmPredictor (run/dlrm_predictor.hpp) as a program calls it, for tests/export/
// dlrm_export_test.py's case predictor:
//
//   dlrm_predictor_tool CHECKPOINT INPUT_DIR OUTPUT [--batch N] [--max-ids N] [--call-rows N]
//                       [--dense-predictor 1] [--tables-given N] [--set KEY=VALUE]...
//
// INPUT_DIR holds `shape.txt` ("rows width tables"), `dense.bin` (float32 [rows, width]) and per
// table t (the model's order) `offsets_<t>.bin` (int64 [rows + 1], CSR from 0) and `ids_<t>.bin`
// (int64). The rows go through predict() in calls of --call-rows rows (default: the batch size;
// the last call partial), each call's offsets rebased to 0 in a buffer made before the first,
// its ids and dense rows viewed in place. Every call, the first included, runs inside an
// AllocationWindow (tests/support/counting_allocator.hpp; oneDNN's own blocks left out). Odd
// calls use predict(dense, bags, y) with y a host double LayoutLeft view of the probabilities,
// the others predict(dense, bags); the logits come from the returned views, which must hold the
// call's rows and no more (else exit 1). OUTPUT gets float32 [rows] logits then float32 [rows]
// probabilities (OUTPUT.<rank> when started on several ranks: each rank runs its own predictor
// on MPI_COMM_SELF); stdout one JSON line: rows, calls, step, heap and Kokkos allocations
// counted, the predictor's live Kokkos bytes once built (the memory tracker's, across the
// constructor), the matmul precision, the model description. A meshtrain Error: its sentence on
// stderr after "error: ", exit 2. --dense-predictor 1: only a meshtrain::Predictor of the
// checkpoint (which refuses a DLRM's), on this rank. --tables-given N: the first N tables' bags
// only (a list of the wrong length). --set KEY=VALUE (repeatable): the predictor's overrides.

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/mpi_util.hpp"  // check_mpi
#include "framework/comm/runtime.hpp"
#include "framework/core/choices.hpp"   // to_string
#include "framework/core/view_ops.hpp"  // copy_view
#include "framework/observe/memory_tracker.hpp"
#include "run/dlrm_predictor.hpp"
#include "run/predictor.hpp"
#include "tests/support/counting_allocator.hpp"

namespace {

template <class T>
std::vector<T> read_file(const std::string& path, size_t count) {
  std::vector<T> values(count);
  std::ifstream in(path, std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(values.data()),
               static_cast<std::streamsize>(count * sizeof(T)))) {
    std::fprintf(stderr, "dlrm_predictor_tool: cannot read %zu values from %s\n", count,
                 path.c_str());
    std::exit(1);
  }
  return values;
}

// The views a call returns hold its rows, no more.
bool returned_rows_ok(const meshtrain::DlrmPrediction& p, int64_t rows) {
  if (p.rows == rows && static_cast<int64_t>(p.logits.extent(0)) == rows &&
      static_cast<int64_t>(p.probabilities.extent(0)) == rows && p.logits.extent(1) == 1 &&
      p.probabilities.extent(1) == 1) {
    return true;
  }
  std::fprintf(stderr, "dlrm_predictor_tool: a call of %lld rows returned rows %lld, [%zu, %zu]\n",
               static_cast<long long>(rows), static_cast<long long>(p.rows),
               static_cast<size_t>(p.logits.extent(0)),
               static_cast<size_t>(p.probabilities.extent(0)));
  return false;
}

int run(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: dlrm_predictor_tool CHECKPOINT INPUT_DIR OUTPUT [--batch N] "
                 "[--max-ids N] [--call-rows N]\n");
    return 1;
  }
  const std::string checkpoint = argv[1], input = argv[2], output = argv[3];
  int64_t batch = 0, max_ids = 0, call_rows = 0, dense_predictor = 0, tables_given = -1;
  std::vector<std::string> overrides;
  for (int i = 4; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--set") {
      overrides.push_back(argv[i + 1]);
      continue;
    }
    const int64_t value = std::atoll(argv[i + 1]);
    if (flag == "--batch")
      batch = value;
    else if (flag == "--max-ids")
      max_ids = value;
    else if (flag == "--call-rows")
      call_rows = value;
    else if (flag == "--dense-predictor")
      dense_predictor = value;
    else if (flag == "--tables-given")
      tables_given = value;
  }
  if (dense_predictor) {  // meshtrain::Predictor on the checkpoint: refused for a DLRM
    meshtrain::Predictor predictor(checkpoint, 0, {}, MPI_COMM_SELF);
    return 0;
  }
  int64_t rows = 0, width = 0, tables = 0;
  {
    std::ifstream shape(input + "/shape.txt");
    shape >> rows >> width >> tables;
  }
  const std::vector<float> dense = read_file<float>(input + "/dense.bin", rows * width);
  std::vector<std::vector<int64_t>> offsets, ids;
  for (int64_t t = 0; t < tables; ++t) {
    offsets.push_back(
        read_file<int64_t>(input + "/offsets_" + std::to_string(t) + ".bin", rows + 1));
    ids.push_back(read_file<int64_t>(input + "/ids_" + std::to_string(t) + ".bin",
                                     static_cast<size_t>(offsets.back().back())));
  }

  // The predictor's own Kokkos memory: the tracker's live bytes across its construction.
  meshtrain::install_memory_tracker();
  const int64_t live_before = meshtrain::kokkos_memory(0).live_bytes;
  meshtrain::DlrmPredictor predictor(checkpoint, batch, max_ids, overrides);
  const int64_t predictor_bytes = meshtrain::kokkos_memory(0).live_bytes - live_before;
  if (call_rows == 0) call_rows = predictor.batch_size();
  // Everything a call uses, made before the first.
  std::vector<std::vector<int64_t>> rebased(tables, std::vector<int64_t>(call_rows + 1));
  std::vector<meshtrain::DlrmBags> bags(tables);
  std::vector<float> logits(rows), probabilities(rows);
  Kokkos::View<double**, Kokkos::LayoutLeft, Kokkos::HostSpace> y("y", call_rows, 1);
  auto logits_host = Kokkos::create_mirror_view(Kokkos::HostSpace(),
                                                meshtrain::Matrix("l", predictor.batch_size(), 1));
  using HostDense = Kokkos::View<const float**, Kokkos::LayoutRight, Kokkos::HostSpace,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  // Every call, the first included (the constructor's warm-up call exists for it).
  meshtrain::testing::AllocationWindow window(
      meshtrain::testing::AllocationWindow::Threads::all,
      meshtrain::testing::AllocationWindow::OneDnn::left_out);
  int64_t calls = 0;
  for (int64_t first = 0; first < rows; first += call_rows, ++calls) {
    const int64_t n = std::min(call_rows, rows - first);
    for (int64_t t = 0; t < tables; ++t) {
      const int64_t base = offsets[t][first];
      for (int64_t r = 0; r <= n; ++r) rebased[t][r] = offsets[t][first + r] - base;
      bags[t] = meshtrain::DlrmBags{meshtrain::HostIds(rebased[t].data(), n + 1),
                                    meshtrain::HostIds(ids[t].data() + base, ids[t].size() - base)};
    }
    if (tables_given >= 0) bags.resize(static_cast<size_t>(tables_given));  // a wrong list
    const HostDense x(dense.data() + first * width, n, width);
    meshtrain::DlrmPrediction p;
    const auto returned = Kokkos::subview(logits_host, std::make_pair(int64_t{0}, n), Kokkos::ALL);
    if (calls % 2 == 1) {
      predictor.predict(x, bags, y);
      for (int64_t r = 0; r < n; ++r) probabilities[first + r] = static_cast<float>(y(r, 0));
      p = predictor.predict(x, bags);  // the logits
    } else {
      p = predictor.predict(x, bags);
      if (!returned_rows_ok(p, n)) return 1;
      meshtrain::copy_view(returned, p.probabilities);
      for (int64_t r = 0; r < n; ++r) probabilities[first + r] = logits_host(r, 0);
    }
    if (!returned_rows_ok(p, n)) return 1;
    meshtrain::copy_view(returned, p.logits);
    for (int64_t r = 0; r < n; ++r) logits[first + r] = logits_host(r, 0);
  }
  const long heap = window.close();
  const long kokkos = window.kokkos_allocations();
  // Several ranks (each with its own predictor on MPI_COMM_SELF): one output per rank.
  int rank = 0, world = 1;
  meshtrain::check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  meshtrain::check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
  std::ofstream out(world > 1 ? output + "." + std::to_string(rank) : output, std::ios::binary);
  out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(rows * 4));
  out.write(reinterpret_cast<const char*>(probabilities.data()),
            static_cast<std::streamsize>(rows * 4));
  std::printf(
      "{\"rows\": %lld, \"calls\": %lld, \"step\": %lld, \"heap_allocations\": %ld, "
      "\"kokkos_allocations\": %ld, \"predictor_kokkos_bytes\": %lld, \"matmul_precision\": "
      "\"%s\", \"model\": \"%s\"}\n",
      static_cast<long long>(rows), static_cast<long long>(calls),
      static_cast<long long>(predictor.step()), heap, kokkos,
      static_cast<long long>(predictor_bytes),
      meshtrain::to_string(predictor.config().runtime.matmul_precision),
      predictor.model_description().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);
  try {
    return run(argc, argv);
  } catch (const meshtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
