// `meshtrain predict`: HDF5 inputs through a Predictor into one HDF5 output file.
//
// The output is written the way checkpoints are: rank 0 creates FILE.tmp with every dataset
// contiguous and allocated (never filled), and each rank writes its rows' bytes with pwrite at
// their place in the file. A rank's rows of a batch are consecutive rows of the input, so each
// batch is one pwrite per dataset and rank, no rank waits for another's data, and no collective
// HDF5 (MPI-IO) call can leave a rank hanging on another's failure. Of the ranks that hold the
// same rows (tp partners) one writes. The file is renamed to FILE when every rank has written
// and synced its part; a failure removes FILE.tmp, a kill leaves only FILE.tmp.

#include "apps/predict.hpp"
#include "apps/checkpoint_mesh.hpp"
#include "apps/command.hpp"

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>

#include "base/error.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/sigmoid.hpp"
#include "framework/io/batch_stream.hpp"
#include "framework/io/data.hpp"
#include "framework/io/hdf5_util.hpp"
#include "framework/io/metrics.hpp"  // format_duration
#include "framework/io/output_file.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/train/model_summary.hpp"
#include "run/dlrm_run.hpp"
#include "run/predictor.hpp"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Where each output dataset starts in the file (bytes), as rank 0 created it; the index of
// each dataset is its path's own (kPrediction... for a Predictor's output, kDlrm... for a DLRM's).
using OutputOffsets = std::array<long long, 4>;
enum : size_t { kPrediction = 0, kClass = 1, kProbability = 2, kJacobian = 3 };
enum : size_t { kDlrmPrediction = 0, kDlrmLogit = 1 };

// Rank 0: the output is new (or --overwrite), not a directory, not a file predict reads (the
// checkpoint, the pointer naming it, an input), and its directory takes a file.
void check_output(const PredictOptions& options, const std::vector<std::string>& inputs) {
  const std::string& output = options.output;
  if (output.empty()) MESHTRAIN_BAD_INPUT("--output names no file");
  std::error_code ec;
  if (fs::is_directory(output, ec)) {
    MESHTRAIN_BAD_INPUT("the output '", output, "' is a directory; --output names a file");
  }
  if (fs::exists(output, ec) && !options.overwrite) {
    MESHTRAIN_BAD_INPUT("the output '", output,
                        "' exists; pass --overwrite to replace it, or choose another --output");
  }
  if (fs::exists(output, ec)) {  // resolving reads the pointer: only when there is a file to lose
    std::vector<ReadFile> read =
        checkpoint_files_read(options.checkpoint, "the checkpoint being read");
    for (const std::string& input : inputs) read.push_back({input, "an --input file"});
    refuse_output_that_is_read(output, "--output", read);
  }
  const std::string probe = output + ".tmp";
  std::FILE* file = std::fopen(probe.c_str(), "w");
  if (!file) {
    MESHTRAIN_BAD_INPUT("cannot write the output '", output, "' (", std::strerror(errno),
                        "): its directory must exist and be writable");
  }
  std::fclose(file);
  std::remove(probe.c_str());
}

// A dataset of `file` contiguous and allocated, never filled: its byte offset in the file, where
// the ranks pwrite their rows.
long long create_contiguous(hid_t file, const char* name, hid_t type, std::vector<hsize_t> dims,
                            const std::string& where) {
  using hdf5::Handle;
  const ErrorKind fail = ErrorKind::runtime;
  const std::string what = std::string("cannot create dataset ") + name + " in " + where;
  Handle dcpl = hdf5::make(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, fail, what);
  hdf5::check(H5Pset_layout(dcpl, H5D_CONTIGUOUS), fail, what);
  hdf5::check(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY), fail, what);
  hdf5::check(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), fail, what);
  Handle space = hdf5::make(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                            H5Sclose, fail, what);
  Handle dataset = hdf5::make(H5Dcreate2(file, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                              H5Dclose, fail, what);
  const haddr_t address = H5Dget_offset(dataset);
  if (address == HADDR_UNDEF) hdf5::check(-1, fail, what);
  dataset.close(what);
  return static_cast<long long>(address);
}

// An empty FILE.tmp (HDF5 1.8 format) with the root attributes every predict output has.
hdf5::Handle create_output_file(const std::string& tmp, const std::string& checkpoint, int64_t step,
                                const std::string& model, int64_t rows) {
  using hdf5::Handle;
  const ErrorKind fail = ErrorKind::runtime;
  Handle fapl = hdf5::make(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, fail, "H5Pcreate(file access)");
  hdf5::check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_V18), fail,
              "H5Pset_libver_bounds");
  Handle file = hdf5::make(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), H5Fclose, fail,
                           "cannot create the output file '" + tmp + "'");
  hdf5::write_attribute(file, "checkpoint", checkpoint);
  hdf5::write_attribute(file, "step", step);
  hdf5::write_attribute(file, "model", model);
  hdf5::write_attribute(file, "rows", rows);
  return file;
}

// Rank 0: FILE.tmp with /prediction [N, outputs] float32 and, for classification, /class
// int64 [N] and /probability float32 [N, classes], and with a Jacobian /jacobian float32 [N,
// outputs, inputs], contiguous and allocated, never filled; root attributes checkpoint, step,
// model, rows (and jacobian_mode: forward or reverse).
OutputOffsets create_output(const std::string& tmp, const Predictor& predictor, int64_t rows,
                            const std::optional<JacobianMode>& jacobian) {
  using hdf5::Handle;
  const ErrorKind fail = ErrorKind::runtime;
  const std::string where = "the output file '" + tmp + "'";
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  hdf5::silence_errors();
  Handle file = create_output_file(tmp, predictor.checkpoint_path(), predictor.step(),
                                   predictor.model_description(), rows);
  if (jacobian) hdf5::write_attribute(file, "jacobian_mode", std::string(to_string(*jacobian)));
  const auto create = [&](const char* name, hid_t type, std::vector<hsize_t> dims) {
    return create_contiguous(file, name, type, std::move(dims), where);
  };
  const auto n = static_cast<hsize_t>(rows);
  const auto width = static_cast<hsize_t>(predictor.outputs());
  OutputOffsets offsets{};
  offsets[kPrediction] = create("/prediction", H5T_IEEE_F32LE, {n, width});
  if (predictor.classification()) {
    offsets[kClass] = create("/class", H5T_STD_I64LE, {n});
    offsets[kProbability] = create("/probability", H5T_IEEE_F32LE, {n, width});
  }
  if (jacobian) {
    offsets[kJacobian] =
        create("/jacobian", H5T_IEEE_F32LE, {n, width, static_cast<hsize_t>(predictor.inputs())});
  }
  file.close("cannot close " + where);
  return offsets;
}

void write_all(int fd, const void* data, size_t bytes, long long offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t done = ::pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) {
      MESHTRAIN_FAIL("writing the output file '", path, "' at byte ", offset,
                     " failed: ", done < 0 ? std::strerror(errno) : "nothing was written");
    }
    p += done;
    bytes -= static_cast<size_t>(done);
    offset += done;
  }
}

// The output file of both predict paths (the comment at the top of this file), written once:
// rank 0 creates FILE.tmp, the first rank of each batch slice opens it and pwrites its rows,
// finish() agrees on the ranks' failures, syncs and closes the file and renames it to FILE;
// rank 0 prints the progress lines (every options.progress_seconds) and the "wrote" line.
class PredictOutput {
 public:
  // Collective. `slice_index`: this rank's batch slice (ranks of the same index hold the same
  // rows: the first of them writes). `create` runs on rank 0 with FILE.tmp's path and returns
  // where its datasets start; tmp_made is set while FILE.tmp is rank 0's to remove on failure.
  PredictOutput(const PredictOptions& options, int rank, int64_t slice_index, int64_t rows,
                bool& tmp_made, const std::function<OutputOffsets(const std::string&)>& create)
      : options_(options),
        rank0_(rank == 0),
        tmp_(options.output + ".tmp"),
        rows_(rows),
        tmp_made_(tmp_made) {
    MPI_Comm slice_comm = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(slice_index), rank, &slice_comm),
              "MPI_Comm_split (the writers of the output)");
    int slice_rank = 0;
    check_mpi(MPI_Comm_rank(slice_comm, &slice_rank), "MPI_Comm_rank");
    check_mpi(MPI_Comm_free(&slice_comm), "MPI_Comm_free");
    writer_ = slice_rank == 0;
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (!rank0_) return;
      tmp_made_ = true;
      offsets_ = create(tmp_);
    });
    broadcast_collective(offsets_.data(), static_cast<int>(offsets_.size()), MPI_LONG_LONG, 0,
                         MPI_COMM_WORLD, "MPI_Ibcast (the output's layout)");
  }
  ~PredictOutput() {
    if (fd_ >= 0) ::close(fd_);
  }
  PredictOutput(const PredictOutput&) = delete;
  PredictOutput& operator=(const PredictOutput&) = delete;

  bool writer() const { return writer_; }
  // A writer opens FILE.tmp (the others do nothing); called under the caller's agreement.
  void open() {
    if (!writer_) return;
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd_ < 0) {
      MESHTRAIN_FAIL("cannot open the output file '", tmp_, "' to write: ", std::strerror(errno));
    }
  }
  // A writer's `bytes` of `data` at byte `at` of dataset `dataset`.
  void write(size_t dataset, const void* data, size_t bytes, long long at) const {
    write_all(fd_, data, bytes, offsets_[dataset] + at, tmp_);
  }
  // The batches' clock starts (PredictSummary::seconds).
  void start() { start_ = last_print_ = Clock::now(); }
  // Rank 0: a progress line when options.progress_seconds have passed, and after the last batch.
  void progress(int64_t done, bool last) {
    const auto now = Clock::now();
    if (!rank0_ ||
        (std::chrono::duration<double>(now - last_print_).count() < options_.progress_seconds &&
         !last)) {
      return;
    }
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? done / elapsed : 0.0;
    std::printf("predict: %lld/%lld rows (%.1f%%), %.0f rows/s, ETA %s\n",
                static_cast<long long>(done), static_cast<long long>(rows_), 100.0 * done / rows_,
                rate, format_duration(rate > 0 ? (rows_ - done) / rate : 0.0).c_str());
    std::fflush(stdout);
    last_print_ = now;
  }
  // Collective: `failed` (a rank's kept error) ends every rank; else `last_writes`, the file
  // synced, closed and renamed to FILE, options.summary filled and the "wrote" line printed.
  void finish(const std::exception_ptr& failed, const std::function<void()>& last_writes) {
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (failed) std::rethrow_exception(failed);
      if (last_writes) last_writes();
      if (fd_ >= 0) {
        const int synced = ::fsync(fd_);
        const int closed = ::close(fd_);
        fd_ = -1;
        if (synced != 0 || closed != 0) {
          MESHTRAIN_FAIL("cannot complete the output file '", tmp_, "': ", std::strerror(errno));
        }
      }
    });
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (!rank0_) return;
      std::error_code ec;
      fs::rename(tmp_, options_.output, ec);
      if (ec) {
        MESHTRAIN_FAIL("cannot rename '", tmp_, "' to '", options_.output, "': ", ec.message());
      }
      tmp_made_ = false;
    });
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    if (options_.summary) *options_.summary = PredictSummary{rows_, elapsed};
    if (rank0_) {
      std::printf("wrote %s: %lld rows in %.2f s (%.0f rows/s)\n", options_.output.c_str(),
                  static_cast<long long>(rows_), elapsed, elapsed > 0 ? rows_ / elapsed : 0.0);
      std::fflush(stdout);
    }
  }

 private:
  const PredictOptions& options_;
  const bool rank0_;
  const std::string tmp_;
  const int64_t rows_;
  bool& tmp_made_;
  bool writer_ = false;
  OutputOffsets offsets_{};
  int fd_ = -1;
  Clock::time_point start_ = Clock::now(), last_print_ = start_;
};

// The prediction's rows on the host, and where they go in the output.
struct HostRows {
  Matrix::HostMirror outputs;
  Kokkos::View<int64_t*, Kokkos::LayoutRight>::HostMirror classes;
  Matrix::HostMirror probabilities;
  Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::HostSpace> jacobian;  // with --jacobian
  int64_t first = 0;  // the input row of row 0
  int64_t rows = 0;   // valid rows (0: nothing to write)
};

// model.kind = "dlrm" (docs/recsys.md, "Predicting"): a DlrmRun on the checkpoint config's mesh
// (or --set mesh.*) over the rows of the one --input file, laid out as the training data (x_key
// dense features, the tables under data.sparse_key as CSR or [rows, k] ids; no labels read).
// FILE.tmp holds /prediction [N, 1] (the click probability, sigmoid of the logit, evaluated in
// float64 and rounded once) and /logit [N, 1], written as the other models' outputs are: each
// slice's first rank pwrites its rows of every batch.
int run_dlrm_predict(const PredictOptions& options, int rank, const std::vector<std::string>& files,
                     const std::string& checkpoint, int64_t step, RunConfig config,
                     bool& tmp_made) {
  const bool rank0 = rank == 0;
  int world = 1;
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (options.jacobian) {
      MESHTRAIN_BAD_INPUT("--jacobian: checkpoint '", checkpoint, "' is of a model.kind = ",
                          "\"dlrm\" model, whose sparse inputs have no derivative");
    }
    if (files.size() != 1) {
      MESHTRAIN_BAD_INPUT("--input names ", files.size(), " files; a model.kind = \"dlrm\" ",
                          "checkpoint predicts the rows of one file");
    }
    config.data.path = files;
    config.data.test_path.clear();
    config.data.shuffle = ShuffleMode::none;
    config.checkpoint.init_from = checkpoint;
    config.checkpoint.resume = false;
    const Mesh mesh = resolve_checkpoint_mesh(config.mesh, world, "a DLRM predicts on");
    // The batch as a Predictor chooses it (run/predictor.cpp): --batch-size, which the batch
    // shards must divide (the error names the flag), else the checkpoint's evaluation batch
    // rounded up to a multiple of them. DlrmRun predicts in batches of data.batch_size and
    // refuses an eval_batch_size that differs from it: both are set.
    std::vector<std::string> batch_axes;
    for (const std::string& axis : plan_options(config).batch_axes) {
      if (mesh.has_axis(axis)) batch_axes.push_back(axis);
    }
    int64_t batch = options.batch_size;
    if (batch > 0) {
      (void)make_batch_slice(mesh, rank, batch_axes, batch, "--batch-size");
    } else {
      const int64_t shards = mesh.size_of(batch_axes);
      batch = config.data.eval_batch_size.value_or(config.data.batch_size);
      batch = (batch + shards - 1) / shards * shards;
    }
    config.data.batch_size = batch;
    config.data.eval_batch_size = batch;
    // As evaluate: nothing goes into the training run's folder; flight records only where
    // --flight-dir says (the recorder configured here, as run_predict does; the DlrmRun then
    // configures it again from the same keys), and no traces.
    config.runtime.trace_first = config.runtime.trace_last = 0;
    if (options.flight_dir.empty()) {
      config.runtime.flight_records = 0;
    } else {
      config.run.output_dir = options.flight_dir;
      flight_recorder().configure(static_cast<std::size_t>(config.runtime.flight_records),
                                  options.flight_dir, rank, world);
    }
  });
  DlrmRun run(config, {}, MPI_COMM_WORLD, DlrmRunPurpose::predict);
  const std::string model = model_summary(run.config().model);
  const int64_t global_batch = run.config().data.batch_size;
  if (rank0) {
    std::printf("meshtrain predict: %s, step %lld of %s, mesh %s, batch %lld\n", model.c_str(),
                static_cast<long long>(step), checkpoint.c_str(),
                run.mesh().short_description().c_str(), static_cast<long long>(global_batch));
    std::fflush(stdout);
  }
  const int64_t total = run.rows_of_data();
  const int64_t num_batches = (total + global_batch - 1) / global_batch;

  PredictOutput output(
      options, rank, run.slice().index, total, tmp_made, [&](const std::string& tmp) {
        const std::string where = "the output file '" + tmp + "'";
        std::lock_guard<std::mutex> lock(hdf5::global_mutex());
        hdf5::silence_errors();
        hdf5::Handle file = create_output_file(tmp, checkpoint, step, model, total);
        const auto n = static_cast<hsize_t>(total);
        OutputOffsets offsets{};
        offsets[kDlrmPrediction] =
            create_contiguous(file, "/prediction", H5T_IEEE_F32LE, {n, 1}, where);
        offsets[kDlrmLogit] = create_contiguous(file, "/logit", H5T_IEEE_F32LE, {n, 1}, where);
        file.close("cannot close " + where);
        return offsets;
      });
  std::vector<float> probabilities(static_cast<size_t>(run.slice().rows));
  on_every_rank(MPI_COMM_WORLD, [&] { output.open(); });
  output.start();
  // A failed write is kept and agreed on after the last batch: every rank takes part in every
  // batch's collectives (a row-wise table's all-to-all) until then.
  std::exception_ptr failed;
  int64_t batches_done = 0;
  run.predict([&](const int64_t* rows, int64_t count, const float* logits) {
    ++batches_done;
    if (output.writer() && count > 0 && !failed) {
      try {
        for (int64_t r = 0; r < count; ++r) {
          probabilities[static_cast<size_t>(r)] = stable_sigmoid(logits[r]);
        }
        const long long at = rows[0] * 4LL;  // a slice's rows of a batch are consecutive
        output.write(kDlrmPrediction, probabilities.data(), static_cast<size_t>(count) * 4, at);
        output.write(kDlrmLogit, logits, static_cast<size_t>(count) * 4, at);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    output.progress(std::min(total, batches_done * global_batch), batches_done == num_batches);
  });
  output.finish(failed, {});
  return 0;
}

int run_predict(const PredictOptions& options, int rank, bool& tmp_made) {
  const bool rank0 = rank == 0;
  std::vector<std::string> files;
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (options.inputs.empty()) MESHTRAIN_BAD_INPUT("--input names no file");
    files = expand_data_paths(options.inputs, "--input");
    if (rank0) check_output(options, files);
  });

  // A DLRM is served by its own run (run/dlrm_run.hpp), not by a Predictor: rank 0 reads the
  // checkpoint's config, every rank follows its answer.
  {
    std::string path, config_text;
    long long step = 0;
    on_every_rank(MPI_COMM_WORLD, [&] {
      check_prediction_overrides(options.overrides);
      if (!rank0) return;
      path = resolve_checkpoint_path(options.checkpoint);
      const CheckpointInfo info = list_checkpoint(path).info;
      config_text = info.config_text;
      step = info.train_state.step;
    });
    broadcast_string(path, 0, MPI_COMM_WORLD, "MPI_Ibcast (the checkpoint path)");
    broadcast_string(config_text, 0, MPI_COMM_WORLD, "MPI_Ibcast (the checkpoint's config)");
    broadcast_collective(&step, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD,
                         "MPI_Ibcast (the checkpoint's step)");
    std::optional<RunConfig> config;
    on_every_rank(MPI_COMM_WORLD, [&] {
      config =
          parse_config(config_text, "the config of checkpoint '" + path + "'", options.overrides);
    });
    if (config->model.kind == ModelKind::dlrm) {
      return run_dlrm_predict(options, rank, files, path, step, std::move(*config), tmp_made);
    }
  }

  Predictor predictor(options.checkpoint, options.batch_size, options.overrides);
  // --jacobian: the mode this model's Jacobian is computed in (agreed: the same on every rank).
  std::optional<JacobianMode> jacobian;
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (!options.jacobian) return;
    jacobian =
        predictor.jacobian_mode(parse_jacobian_mode(options.jacobian_mode, "--jacobian-mode"));
    if (predictor.config().mixed_precision.param_dtype != Dtype::fp32) {
      MESHTRAIN_BAD_INPUT("--jacobian computes in fp32; drop the mixed_precision override");
    }
  });
  // Flight records only where --flight-dir says: never in the training run's folder that the
  // checkpoint's config names (its records are what a hung run leaves behind).
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (options.flight_dir.empty()) return;
    int world = 1;
    check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
    flight_recorder().configure(static_cast<std::size_t>(predictor.config().runtime.flight_records),
                                options.flight_dir, rank, world);
  });
  if (rank0) {
    const std::vector<std::string> lines = predictor.describe();
    std::printf("meshtrain predict: %s\n", lines.front().c_str());
    for (size_t i = 1; i < lines.size(); ++i) std::printf("%s\n", lines[i].c_str());
    if (jacobian) {
      std::printf("  jacobian: %s mode, %lld %s per pass\n", to_string(*jacobian),
                  static_cast<long long>(predictor.jacobian_directions(*jacobian)),
                  *jacobian == JacobianMode::forward ? "input directions" : "outputs");
    }
    std::fflush(stdout);
  }

  // The inputs: the checkpoint's data.x_key in each file, in file order, as wide as the model.
  std::unique_ptr<RowSource> source;
  on_every_rank(MPI_COMM_WORLD, [&] {
    Hdf5SourceOptions source_options;
    source_options.x_name = canonical_dataset_key(predictor.config().data.x_key);
    source_options.y_name = "";  // inputs only
    source = open_hdf5_source(files, 1, source_options);
    const DataShape& shape = source->shape();
    if (shape.features != predictor.inputs()) {
      MESHTRAIN_BAD_INPUT(
          "input file '", files.front(), "': dataset ", source_options.x_name, " has ",
          shape.features, " features per row but the model of checkpoint '",
          predictor.checkpoint_path(), "' takes ", predictor.inputs(), " (",
          predictor.config().model.kind == ModelKind::residual_mlp ? "model.inputs"
                                                                   : "model.sizes[0]",
          ")");
    }
  });
  const int64_t total = source->shape().num_samples;
  const BatchSlice& slice = predictor.slice();
  const EvalSchedule schedule = EvalSchedule::create(total, predictor.batch_size(), "--batch-size");

  // One rank per slice writes (tp partners hold the same rows).
  PredictOutput output(options, rank, slice.index, total, tmp_made, [&](const std::string& tmp) {
    return create_output(tmp, predictor, total, jacobian);
  });

  // This rank's buffers, its batch stream and the output file: made under the agreement,
  // so that a rank that cannot (memory, a thread, the file) ends every rank with its error
  // instead of leaving the others in the predictions' collectives.
  HostRows host;
  const int64_t rows = predictor.local_rows(), width = predictor.outputs();
  std::optional<BatchStream> stream;
  Matrix x;
  const auto write_rows = [&] {
    if (!output.writer() || host.rows == 0) return;
    const size_t row_bytes = static_cast<size_t>(width) * 4;
    const auto at = host.first * static_cast<long long>(row_bytes);
    output.write(kPrediction, host.outputs.data(), host.rows * row_bytes, at);
    if (!predictor.classification()) return;
    output.write(kClass, host.classes.data(), host.rows * 8, host.first * 8LL);
    output.write(kProbability, host.probabilities.data(), host.rows * row_bytes, at);
  };
  const auto write_jacobian = [&] {
    if (!output.writer() || host.rows == 0 || !jacobian) return;
    const size_t row_bytes = static_cast<size_t>(width * predictor.inputs()) * 4;
    output.write(kJacobian, host.jacobian.data(), host.rows * row_bytes,
                 host.first * static_cast<long long>(row_bytes));
  };
  on_every_rank(MPI_COMM_WORLD, [&] {
    host.outputs = Matrix::HostMirror("meshtrain::predict_host_outputs", rows, width);
    if (predictor.classification()) {
      host.classes = decltype(host.classes)("meshtrain::predict_host_classes", rows);
      host.probabilities = Matrix::HostMirror("meshtrain::predict_host_probabilities", rows, width);
    }
    if (jacobian) {
      host.jacobian = decltype(host.jacobian)("meshtrain::predict_host_jacobian", rows, width,
                                              predictor.inputs());
    }
    x = Matrix("meshtrain::predict_batch", rows, predictor.inputs());
    stream.emplace(
        *source, rows,
        [&](int64_t seq, int64_t* samples) {
          return eval_slice_samples(schedule, seq, slice, samples);
        },
        predictor.config().data.prefetch);
    output.open();
  });

  output.start();
  // This rank's first failure since the ranks last agreed; agreeing costs a reduction, so
  // not every batch.
  constexpr int64_t kAgreeEvery = 64;
  std::exception_ptr failed;
  const auto agree_on_failure = [&] {
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (failed) std::rethrow_exception(failed);
    });
  };
  for (int64_t b = 0; b < schedule.num_batches; ++b) {
    // The previous batch's rows are written, this one's taken. A rank that fails here (a
    // bad row, a failed write) keeps its first error and takes part in the collective
    // predictions with no rows until the ranks next agree (every kAgreeEvery batches and at
    // the end): the output is renamed only after the last agreement.
    int64_t valid = 0;
    try {
      if (!failed) {
        write_rows();
        write_jacobian();
      }
      valid = stream->take(b, x, BatchLabels(), Matrix());
    } catch (...) {
      if (!failed) failed = std::current_exception();
      valid = 0;
    }
    if (failed) valid = 0;
    if ((b + 1) % kAgreeEvery == 0) agree_on_failure();
    const auto x_rows = Kokkos::subview(x, std::make_pair(int64_t{0}, valid), Kokkos::ALL);
    const Prediction p =
        jacobian ? predictor.jacobian(x_rows, host.jacobian, *jacobian) : predictor.predict(x_rows);
    const auto range = std::make_pair(int64_t{0}, valid);
    Kokkos::deep_copy(Kokkos::subview(host.outputs, range, Kokkos::ALL), p.outputs);
    if (predictor.classification()) {
      Kokkos::deep_copy(Kokkos::subview(host.classes, range), p.classes);
      Kokkos::deep_copy(Kokkos::subview(host.probabilities, range, Kokkos::ALL), p.probabilities);
    }
    host.first = b * schedule.global_batch + slice.begin();
    host.rows = valid;
    output.progress(std::min(total, (b + 1) * schedule.global_batch),
                    b + 1 == schedule.num_batches);
  }
  output.finish(failed, [&] {
    write_rows();
    write_jacobian();
  });
  return 0;
}

}  // namespace

int predict_command(const PredictOptions& options) {
  int rank = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  bool tmp_made = false;  // rank 0: FILE.tmp exists and is ours to remove on failure
  try {
    return run_predict(options, rank, tmp_made);
  } catch (const AgreedError& error) {
    // Every rank holds this error: print it once, leave no partial output.
    if (tmp_made) std::remove((options.output + ".tmp").c_str());
    return report_agreed_error(error);
  }
}

}  // namespace meshtrain
