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
#include "apps/command.hpp"

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>

#include "base/error.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/batch_stream.hpp"
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

// Where each output dataset starts in the file (bytes), as rank 0 created it.
struct OutputLayout {
  long long prediction = 0, classes = 0, probability = 0, jacobian = 0;
};

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
OutputLayout create_output(const std::string& tmp, const Predictor& predictor, int64_t rows,
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
  OutputLayout layout;
  layout.prediction = create("/prediction", H5T_IEEE_F32LE, {n, width});
  if (predictor.classification()) {
    layout.classes = create("/class", H5T_STD_I64LE, {n});
    layout.probability = create("/probability", H5T_IEEE_F32LE, {n, width});
  }
  if (jacobian) {
    layout.jacobian =
        create("/jacobian", H5T_IEEE_F32LE, {n, width, static_cast<hsize_t>(predictor.inputs())});
  }
  file.close("cannot close " + where);
  return layout;
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
  const std::string tmp = options.output + ".tmp";
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
    if (options.batch_size > 0) config.data.batch_size = options.batch_size;
    // As evaluate: nothing goes into the training run's folder; flight records only where
    // --flight-dir says, and no traces.
    if (options.flight_dir.empty()) {
      config.runtime.flight_records = 0;
    } else {
      config.run.output_dir = options.flight_dir;
    }
    config.runtime.trace_first = config.runtime.trace_last = 0;
    try {
      (void)config.mesh.resolve(world);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::bad_input) throw;
      MESHTRAIN_BAD_INPUT(e.what(),
                          "; a DLRM predicts on the checkpoint config's mesh: start it on that "
                          "many ranks, or give it another with --set mesh.AXIS=SIZE (a "
                          "checkpoint loads onto any mesh)");
    }
  });
  DlrmRun run(config, {}, MPI_COMM_WORLD, DlrmRunPurpose::predict);
  const std::string model = model_summary(run.config().model);
  if (rank0) {
    std::printf("meshtrain predict: %s, step %lld of %s, mesh %s, batch %lld\n", model.c_str(),
                static_cast<long long>(step), checkpoint.c_str(),
                run.mesh().short_description().c_str(),
                static_cast<long long>(run.config().data.batch_size));
    std::fflush(stdout);
  }
  const int64_t total = run.rows_of_data();

  // One rank per slice writes (ranks of the same slice index hold the same rows).
  MPI_Comm slice_comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(run.slice().index), rank, &slice_comm),
            "MPI_Comm_split (the writers of the output)");
  int slice_rank = 0;
  check_mpi(MPI_Comm_rank(slice_comm, &slice_rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_free(&slice_comm), "MPI_Comm_free");
  const bool writer = slice_rank == 0;

  long long offsets[2] = {0, 0};  // /prediction, /logit
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (!rank0) return;
    tmp_made = true;
    const std::string where = "the output file '" + tmp + "'";
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    hdf5::silence_errors();
    hdf5::Handle file = create_output_file(tmp, checkpoint, step, model, total);
    const auto n = static_cast<hsize_t>(total);
    offsets[0] = create_contiguous(file, "/prediction", H5T_IEEE_F32LE, {n, 1}, where);
    offsets[1] = create_contiguous(file, "/logit", H5T_IEEE_F32LE, {n, 1}, where);
    file.close("cannot close " + where);
  });
  broadcast_collective(offsets, 2, MPI_LONG_LONG, 0, MPI_COMM_WORLD,
                       "MPI_Ibcast (the output's layout)");

  int fd = -1;
  std::vector<float> probabilities(static_cast<size_t>(run.slice().rows));
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (!writer) return;
    fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
      MESHTRAIN_FAIL("cannot open the output file '", tmp, "' to write: ", std::strerror(errno));
    }
  });
  const auto close_output = [&] {
    if (fd >= 0) ::close(fd);
    fd = -1;
  };
  const auto start = Clock::now();
  // A failed write is kept and agreed on after the last batch: every rank takes part in every
  // batch's collectives (a row-wise table's all-to-all) until then.
  std::exception_ptr failed;
  try {
    run.predict([&](const int64_t* rows, int64_t count, const float* logits) {
      if (!writer || count == 0 || failed) return;
      try {
        for (int64_t r = 0; r < count; ++r) {
          const double z = logits[r];  // a numerically safe sigmoid, rounded once
          const double e = std::exp(-std::abs(z));
          probabilities[static_cast<size_t>(r)] =
              static_cast<float>(z >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
        }
        const long long at = rows[0] * 4LL;  // a slice's rows of a batch are consecutive
        write_all(fd, probabilities.data(), static_cast<size_t>(count) * 4, offsets[0] + at, tmp);
        write_all(fd, logits, static_cast<size_t>(count) * 4, offsets[1] + at, tmp);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (failed) std::rethrow_exception(failed);
      if (fd >= 0) {
        const int synced = ::fsync(fd);
        const int closed = ::close(fd);
        fd = -1;
        if (synced != 0 || closed != 0) {
          MESHTRAIN_FAIL("cannot complete the output file '", tmp, "': ", std::strerror(errno));
        }
      }
    });
  } catch (...) {
    close_output();
    throw;
  }
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (!rank0) return;
    std::error_code ec;
    fs::rename(tmp, options.output, ec);
    if (ec) {
      MESHTRAIN_FAIL("cannot rename '", tmp, "' to '", options.output, "': ", ec.message());
    }
    tmp_made = false;
  });
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  if (options.summary) *options.summary = PredictSummary{total, elapsed};
  if (rank0) {
    std::printf("wrote %s: %lld rows in %.2f s (%.0f rows/s)\n", options.output.c_str(),
                static_cast<long long>(total), elapsed, elapsed > 0 ? total / elapsed : 0.0);
    std::fflush(stdout);
  }
  return 0;
}

int run_predict(const PredictOptions& options, int rank, bool& tmp_made) {
  const bool rank0 = rank == 0;
  const std::string tmp = options.output + ".tmp";
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
  MPI_Comm slice_comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(slice.index), rank, &slice_comm),
            "MPI_Comm_split (the writers of the output)");
  int slice_rank = 0;
  check_mpi(MPI_Comm_rank(slice_comm, &slice_rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_free(&slice_comm), "MPI_Comm_free");
  const bool writer = slice_rank == 0;

  OutputLayout layout;
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (!rank0) return;
    tmp_made = true;
    layout = create_output(tmp, predictor, total, jacobian);
  });
  broadcast_collective(&layout, 4, MPI_LONG_LONG, 0, MPI_COMM_WORLD,
                       "MPI_Ibcast (the output's layout)");

  // This rank's buffers, its batch stream and the output file: made under the agreement,
  // so that a rank that cannot (memory, a thread, the file) ends every rank with its error
  // instead of leaving the others in the predictions' collectives.
  int fd = -1;
  HostRows host;
  const int64_t rows = predictor.local_rows(), width = predictor.outputs();
  std::optional<BatchStream> stream;
  Matrix x;
  const auto write_rows = [&] {
    if (!writer || host.rows == 0) return;
    const size_t row_bytes = static_cast<size_t>(width) * 4;
    write_all(fd, host.outputs.data(), host.rows * row_bytes,
              layout.prediction + host.first * static_cast<long long>(row_bytes), tmp);
    if (!predictor.classification()) return;
    write_all(fd, host.classes.data(), host.rows * 8, layout.classes + host.first * 8LL, tmp);
    write_all(fd, host.probabilities.data(), host.rows * row_bytes,
              layout.probability + host.first * static_cast<long long>(row_bytes), tmp);
  };
  const auto write_jacobian = [&] {
    if (!writer || host.rows == 0 || !jacobian) return;
    const size_t row_bytes = static_cast<size_t>(width * predictor.inputs()) * 4;
    write_all(fd, host.jacobian.data(), host.rows * row_bytes,
              layout.jacobian + host.first * static_cast<long long>(row_bytes), tmp);
  };
  const auto close_output = [&] {
    if (fd >= 0) ::close(fd);
    fd = -1;
  };
  try {
    on_every_rank(MPI_COMM_WORLD, [&] {
      host.outputs = Matrix::HostMirror("meshtrain::predict_host_outputs", rows, width);
      if (predictor.classification()) {
        host.classes = decltype(host.classes)("meshtrain::predict_host_classes", rows);
        host.probabilities =
            Matrix::HostMirror("meshtrain::predict_host_probabilities", rows, width);
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
      if (!writer) return;
      fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) {
        MESHTRAIN_FAIL("cannot open the output file '", tmp, "' to write: ", std::strerror(errno));
      }
    });
  } catch (...) {
    close_output();
    throw;
  }

  const auto start = Clock::now();
  auto last_print = start;
  int64_t done = 0;
  // This rank's first failure since the ranks last agreed; agreeing costs a reduction, so
  // not every batch.
  constexpr int64_t kAgreeEvery = 64;
  std::exception_ptr failed;
  const auto agree_on_failure = [&] {
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (failed) std::rethrow_exception(failed);
    });
  };
  try {
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
      const Prediction p = jacobian ? predictor.jacobian(x_rows, host.jacobian, *jacobian)
                                    : predictor.predict(x_rows);
      const auto range = std::make_pair(int64_t{0}, valid);
      Kokkos::deep_copy(Kokkos::subview(host.outputs, range, Kokkos::ALL), p.outputs);
      if (predictor.classification()) {
        Kokkos::deep_copy(Kokkos::subview(host.classes, range), p.classes);
        Kokkos::deep_copy(Kokkos::subview(host.probabilities, range, Kokkos::ALL), p.probabilities);
      }
      host.first = b * schedule.global_batch + slice.begin();
      host.rows = valid;
      done = std::min(total, (b + 1) * schedule.global_batch);
      const auto now = Clock::now();
      if (rank0 &&
          (std::chrono::duration<double>(now - last_print).count() >= options.progress_seconds ||
           b + 1 == schedule.num_batches)) {
        const double elapsed = std::chrono::duration<double>(now - start).count();
        const double rate = elapsed > 0 ? done / elapsed : 0.0;
        std::printf("predict: %lld/%lld rows (%.1f%%), %.0f rows/s, ETA %s\n",
                    static_cast<long long>(done), static_cast<long long>(total),
                    100.0 * done / total, rate,
                    format_duration(rate > 0 ? (total - done) / rate : 0.0).c_str());
        std::fflush(stdout);
        last_print = now;
      }
    }
    on_every_rank(MPI_COMM_WORLD, [&] {
      if (failed) std::rethrow_exception(failed);
      write_rows();
      write_jacobian();
      if (fd >= 0) {
        const int synced = ::fsync(fd);
        const int closed = ::close(fd);
        fd = -1;
        if (synced != 0 || closed != 0) {
          MESHTRAIN_FAIL("cannot complete the output file '", tmp, "': ", std::strerror(errno));
        }
      }
    });
  } catch (...) {
    close_output();
    throw;
  }
  on_every_rank(MPI_COMM_WORLD, [&] {
    if (!rank0) return;
    std::error_code ec;
    fs::rename(tmp, options.output, ec);
    if (ec) {
      MESHTRAIN_FAIL("cannot rename '", tmp, "' to '", options.output, "': ", ec.message());
    }
    tmp_made = false;
  });
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  if (options.summary) *options.summary = PredictSummary{total, elapsed};
  if (rank0) {
    std::printf("wrote %s: %lld rows in %.2f s (%.0f rows/s)\n", options.output.c_str(),
                static_cast<long long>(total), elapsed, elapsed > 0 ? total / elapsed : 0.0);
    std::fflush(stdout);
  }
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
