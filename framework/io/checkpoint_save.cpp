// Saving checkpoints: the Checkpointer (synchronous or in the background), the writer that
// puts each rank's blocks into the file, and the completion (checksums, rename, latest,
// clean-up). The file format is in checkpoint_format.hpp.
//
// Phases of one save, each agreed by all ranks before any collective call that follows it:
//   1. main thread, local work: check the contents, lay out and (async) allocate the staging
//      buffer, copy device tensors into it; rank 0 makes the directory and creates the file's
//      structure with serial HDF5 (space allocated, no data written). Agreed; then rank 0's
//      dataset offsets are broadcast.
//   2. writer (a thread when async, else inline), POSIX only: copy host tensors into the
//      staging buffer (async) and signal wait_snapshot(); pwrite each block's runs at their
//      offsets, CRC-32 of each run; fsync. Errors are kept for phase 3.
//   3. main thread (poll/wait), every rank: join the writer; agree on its outcome; gather the
//      CRC-32s at rank 0, which starts its finisher thread: combine and store the CRC-32s
//      (HDF5, under hdf5::global_mutex), fsync, rename, write best (when it is), write latest,
//      remove old checkpoints.
//   4. main thread (poll/wait): once rank 0's finisher is done, agree on its outcome.
// So no collective call follows a point where one rank alone can fail, and a failure is one
// error, the same on every rank.

#include <fcntl.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <regex>
#include <system_error>

#include "base/error.hpp"
#include "framework/comm/communicator.hpp"  // checked_int
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/checkpoint_checksums.hpp"
#include "framework/io/checkpoint_comm.hpp"
#include "framework/io/checkpoint_files.hpp"
#include "framework/io/checkpoint_format.hpp"
#include "framework/io/hdf5_util.hpp"
#include "framework/observe/trace.hpp"
#ifdef MESHTRAIN_CHECKPOINT_FAULTS
#include "framework/io/checkpoint_testing.hpp"
#endif

namespace meshtrain {

namespace fs = std::filesystem;
using hdf5::Handle;
using namespace checkpoint_format;

namespace {

// The test programs' fault hook (checkpoint_testing.hpp) exists only in the test build of this
// file (meshtrain_checkpoint_faults, tests/checkpoint.cmake); the library's points do nothing.
#ifdef MESHTRAIN_CHECKPOINT_FAULTS
std::atomic<CheckpointFaultHook> fault_hook{nullptr};

void fault_point(const char* point, int64_t count = 0) {
  if (CheckpointFaultHook hook = fault_hook.load()) hook(point, count);
}
#else
inline void fault_point(const char*, int64_t = 0) {}
#endif

using StagingView = Kokkos::View<float*, HostStagingSpace>;  // pinned with CUDA
using HostFloats = Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using HostBits =
    Kokkos::View<uint16_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
// Emulating device memory, tensors are staged as on a GPU.
bool tensors_on_host() {
  return !device_memory_is_separate();
}

// Writes of at most this many bytes, each checksummed just before it is written (the bytes
// are then still in cache).
constexpr int64_t kSliceBytes = int64_t{4} << 20;

// Points `pointer` ("latest", "best") at `file_name`: written to a temporary name, synced and
// renamed, so a crash leaves the old pointer or the new one, never half of one.
void write_pointer(const std::string& dir, const char* pointer, const std::string& file_name) {
  const std::string target = (fs::path(dir) / pointer).string();
  const std::string tmp = target + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) MESHTRAIN_FAIL("cannot create '", tmp, "': ", os_error(errno));
  const std::string line = file_name + "\n";
  const ssize_t written = ::write(fd, line.data(), line.size());
  const int write_err = errno;
  if (written != static_cast<ssize_t>(line.size()) || ::fsync(fd) != 0) {
    const int err = written < 0 ? write_err : errno;
    ::close(fd);
    MESHTRAIN_FAIL("cannot write '", tmp, "': ", os_error(err));
  }
  if (::close(fd) != 0) MESHTRAIN_FAIL("closing '", tmp, "' failed: ", os_error(errno));
  rename_path(tmp, target);
  fsync_path(dir, true);
}
// Keeps `current`, the `keep` - 1 newest others and the one `best` names.
void remove_old_checkpoints(const std::string& dir, const std::string& current, int64_t keep) {
  static const std::regex leftover(R"(ckpt-[0-9]+\.h5\.tmp)");
  const std::string best = read_pointer(dir, best_pointer_name()).value_or("");
  std::vector<std::pair<int64_t, std::string>> others;
  std::vector<std::string> remove;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (name == current || name == best) continue;
    if (std::regex_match(name, m, checkpoint_name_pattern())) {
      others.emplace_back(std::stoll(m[1].str()), name);
    } else if (std::regex_match(name, leftover)) {
      remove.push_back(name);
    }
  }
  if (ec) MESHTRAIN_FAIL("cannot list checkpoint directory '", dir, "': ", ec.message());
  if (keep > 0) {
    std::sort(others.begin(), others.end(), std::greater<>());
    for (size_t i = static_cast<size_t>(keep - 1); i < others.size(); ++i)
      remove.push_back(others[i].second);
  }
  for (const auto& name : remove) {
    const fs::path path = fs::path(dir) / name;
    if (!fs::remove(path, ec) && ec)
      MESHTRAIN_FAIL("cannot remove old checkpoint '", path.string(), "': ", ec.message());
  }
}

}  // namespace

namespace checkpoint_format {

// One save in flight: what the writer needs (host pointers and boxes, no views it would have
// to touch) and what it reports back.
struct SaveJob {
  std::string dir, file_name, final_path, tmp_path;
  int64_t keep = 0;
  bool best = false;                   // also point "best" at it
  std::vector<DatasetEntry> entries;   // all datasets, file order (messages, sizes)
  std::vector<int64_t> dataset_bytes;  // per entry
  std::vector<int64_t> offsets;        // per entry: byte offset of its data in the file

  struct Block {
    int64_t dataset = 0;
    ShardedTensor meta;                  // shape, spec and box (its view left empty)
    typename Vector::HostMirror mirror;  // host tensors: the tensor itself (no copy)
    HalfBits::HostMirror bits_mirror;    // the same for a tensor stored as bf16
    const char* source = nullptr;        // host bytes to write (or to copy from)
    char* staged = nullptr;              // set when the writer copies source here first
    int64_t element_bytes = 4;           // 2 for a tensor stored as bf16
  };
  std::vector<Block> blocks;  // the blocks this rank owns, in file order

  // Reported by the writer.
  std::vector<Piece> pieces;
  std::exception_ptr error;
  std::atomic<bool> finished{false};
  std::thread thread;
  std::mutex mutex;
  std::condition_variable staged_cv;
  bool staged = false;  // guarded by mutex

  // After the writes: rank 0's finisher thread (POSIX only) makes the file complete.
  bool finishing = false;  // main thread: the checksums are stored, the finisher started
  std::thread finisher;
  std::exception_ptr finish_error;
  std::atomic<bool> files_done{false};

  // poll(): the MPI_Iallreduce of "done here" started by the last poll, read by the next.
  MPI_Request poll_request = MPI_REQUEST_NULL;
  int poll_mine = 0;
  int poll_all = 0;

  ~SaveJob() {
    if (thread.joinable()) thread.join();
    if (finisher.joinable()) finisher.join();
  }
};

}  // namespace checkpoint_format

namespace {

void write_all(int fd, const char* data, int64_t bytes, int64_t offset, const std::string& path) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, data, static_cast<size_t>(bytes), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) MESHTRAIN_FAIL("cannot write checkpoint file '", path, "': ", os_error(errno));
    data += n;
    bytes -= n;
    offset += n;
  }
}

// The writer's I/O: every owned block's runs at their offsets, then fsync.
void write_blocks(SaveJob& job) {
  const int fd = ::open(job.tmp_path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    MESHTRAIN_FAIL("cannot open checkpoint file '", job.tmp_path, "' to write: ", os_error(errno));
  }
  try {
    int64_t written = 0;
    for (const SaveJob::Block& block : job.blocks) {
      const char* data = block.staged != nullptr ? block.staged : block.source;
      const int64_t base = job.offsets[static_cast<size_t>(block.dataset)];
      const int64_t size = block.element_bytes;
      for_each_run(block.meta, [&](int64_t local, int64_t global, int64_t count) {
        const char* bytes = data + local * size;
        const int64_t length = count * size;
        uint32_t crc = 0;
        for (int64_t done = 0; done < length; done += kSliceBytes) {
          const int64_t n = std::min(kSliceBytes, length - done);
          crc = crc32_update(crc, bytes + done, static_cast<size_t>(n));
          write_all(fd, bytes + done, n, base + global * size + done, job.tmp_path);
        }
        append_piece(job.pieces, Piece{block.dataset, global * size, length, crc, 0});
      });
      fault_point("after_dataset", ++written);
    }
    fault_point("before_close");
    if (::fsync(fd) != 0) {
      MESHTRAIN_FAIL("fsync of checkpoint file '", job.tmp_path, "' failed: ", os_error(errno));
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) {
    MESHTRAIN_FAIL("closing checkpoint file '", job.tmp_path, "' failed: ", os_error(errno));
  }
}

void mark_staged(SaveJob& job) {
  {
    std::lock_guard<std::mutex> lock(job.mutex);
    job.staged = true;
  }
  job.staged_cv.notify_all();
}

// The writer: no MPI, no HDF5, no Kokkos (host bytes only). Errors are kept for wait().
void run_writer(SaveJob& job) {
  const TraceLaneScope lane("checkpoint writer");
  try {
    fault_point("before_snapshot");
    {
      const TraceSpan span("checkpoint snapshot");
      for (const SaveJob::Block& block : job.blocks) {
        if (block.staged != nullptr) {
          std::memcpy(block.staged, block.source,
                      static_cast<size_t>(block.meta.box.elements() * block.element_bytes));
        }
      }
    }
    mark_staged(job);
    fault_point("snapshot");
    const TraceSpan span("checkpoint write");
    write_blocks(job);
  } catch (...) {
    job.error = std::current_exception();
  }
  mark_staged(job);  // also on failure: wait_snapshot() must not wait forever
  job.finished = true;
}

// Rank 0: the file's structure, space allocated and no data written; returns each dataset's
// byte offset in the file.
std::vector<int64_t> create_file(const SaveJob& job, const CheckpointContents& c) {
  const ErrorKind fail = ErrorKind::runtime;
  const std::string where = "checkpoint file '" + job.tmp_path + "'";
  Handle fapl = hdf5::make(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, fail, "H5Pcreate(file access)");
  // 1.8 file format: dense attribute storage (a long config text), readable by h5py/h5dump.
  hdf5::check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_V18), fail,
              "H5Pset_libver_bounds");
  Handle file = hdf5::make(H5Fcreate(job.tmp_path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl),
                           H5Fclose, fail, "cannot create " + where);
  write_metadata(file, c);
  write_normalization(file, c.normalization, job.tmp_path);
  write_stream_rows_seen(file, c.stream.rows_seen, job.tmp_path);
  Handle lcpl = hdf5::make(H5Pcreate(H5P_LINK_CREATE), H5Pclose, fail, "H5Pcreate(link create)");
  hdf5::check(H5Pset_create_intermediate_group(lcpl, 1), fail, "H5Pset_create_intermediate_group");
  std::vector<int64_t> offsets;
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const DatasetEntry& entry = job.entries[i];
    const ShardedTensor& t = *entry.tensor;
    const std::string what = "cannot create dataset '" + entry.path + "' in " + where;
    Handle dcpl = hdf5::make(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, fail, what);
    // Contiguous and allocated now, so its place in the file is known; never filled, since
    // the writers put every byte.
    hdf5::check(H5Pset_layout(dcpl, H5D_CONTIGUOUS), fail, what);
    hdf5::check(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY), fail, what);
    hdf5::check(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), fail, what);
    const std::vector<hsize_t> dims = stored_dims(t.global_shape);
    Handle space = hdf5::make(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                              H5Sclose, fail, what);
    // A tensor stored as bf16 (a DLRM table, model.table_dtype = "bf16"): its bits as they are,
    // uint16 with attribute dtype = "bf16" (kDtypeAttribute, kBf16Dtype).
    const hid_t type = t.stored_16bit() ? H5T_STD_U16LE : H5T_IEEE_F32LE;
    Handle dataset =
        hdf5::make(H5Dcreate2(file, entry.path.c_str(), type, space, lcpl, dcpl, H5P_DEFAULT),
                   H5Dclose, fail, what);
    hdf5::write_attribute(dataset, "spec", t.spec.to_string());
    if (t.stored_16bit()) hdf5::write_attribute(dataset, kDtypeAttribute, std::string(kBf16Dtype));
    if (t.global_shape.empty()) hdf5::write_attribute(dataset, "scalar", int64_t{1});
    hdf5::write_attribute(dataset, kChecksumAttribute, uint64_t{0});  // set when complete
    const haddr_t address = H5Dget_offset(dataset);
    if (job.dataset_bytes[i] > 0 && address == HADDR_UNDEF) hdf5::check(-1, fail, what);
    offsets.push_back(job.dataset_bytes[i] > 0 ? static_cast<int64_t>(address) : 0);
    dataset.close(what);
  }
  file.close("cannot close " + where);
  return offsets;
}

// Rank 0: stores each dataset's CRC-32 into the finished file (the placeholder attribute is
// replaced: HDF5 1.10 cannot rewrite an attribute in dense storage in place).
void store_checksums(const SaveJob& job, const std::vector<uint32_t>& crcs) {
  const ErrorKind fail = ErrorKind::runtime;
  const std::string where = "checkpoint file '" + job.tmp_path + "'";
  Handle file = hdf5::make(H5Fopen(job.tmp_path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose, fail,
                           "cannot reopen " + where);
  for (size_t i = 0; i < job.entries.size(); ++i) {
    const std::string what =
        "cannot store the checksum of '" + job.entries[i].path + "' in " + where;
    Handle dataset =
        hdf5::make(H5Dopen2(file, job.entries[i].path.c_str(), H5P_DEFAULT), H5Dclose, fail, what);
    hdf5::check(H5Adelete(dataset, kChecksumAttribute), fail, what);
    hdf5::write_attribute(dataset, kChecksumAttribute, static_cast<uint64_t>(crcs[i]));
    dataset.close(what);
  }
  file.close("cannot close " + where);
}

// Rank 0's finisher: stores each dataset's CRC-32 (HDF5, under its lock) and makes the
// complete file the latest checkpoint.
void run_finisher(SaveJob& job, std::vector<Piece> pieces) {
  const TraceLaneScope lane("checkpoint finisher");
  const TraceSpan span("checkpoint finish");
  try {
    {
      std::lock_guard<std::mutex> lock(hdf5::global_mutex());
      hdf5::silence_errors();
      store_checksums(job, combine_pieces(std::move(pieces), job.dataset_bytes, job.entries));
    }
    fsync_path(job.tmp_path, false);  // what the checksums changed
    fault_point("before_rename");
    rename_path(job.tmp_path, job.final_path);
    fsync_path(job.dir, true);
    // `best` before `latest`: a run resumes from `latest` without knowing whether that
    // checkpoint was meant to become `best`, so a save that dies between the two pointers
    // must leave `latest` at the previous checkpoint (the resumed run redoes this save).
    if (job.best) {
      fault_point("before_best");
      write_pointer(job.dir, best_pointer_name(), job.file_name);
    }
    fault_point("before_latest");
    write_pointer(job.dir, latest_pointer_name(), job.file_name);
    fault_point("before_cleanup");
    remove_old_checkpoints(job.dir, job.file_name, job.keep);
  } catch (...) {
    job.finish_error = std::current_exception();
  }
  job.files_done = true;
}

// Main thread, every rank, once the writers are done (or to wait for them): agrees on their
// outcome, gathers the CRC-32s at rank 0 and starts its finisher. A failure drops the
// temporary file and throws on every rank.
void finish_writes(const PrivateComm& comm, SaveJob& job) {
  if (job.thread.joinable()) job.thread.join();
  std::vector<Piece> pieces;  // rank 0: every rank's
  try {
    on_every_rank(comm.get(), [&] {
      if (job.error) std::rethrow_exception(job.error);
      checked_int(job.pieces.size() * sizeof(Piece), "the checksums of a checkpoint (bytes)");
    });
    pieces = gather_pieces(comm, job.pieces);
  } catch (...) {
    // Every writer has stopped (each rank joined its own before agreeing).
    if (comm.rank() == 0) {
      std::error_code ec;
      fs::remove(job.tmp_path, ec);
    }
    throw;
  }
  job.finishing = true;
  if (comm.rank() == 0) {
    job.finisher = std::thread(run_finisher, std::ref(job), std::move(pieces));
  } else {
    job.files_done = true;
  }
}

}  // namespace

#ifdef MESHTRAIN_CHECKPOINT_FAULTS
void set_checkpoint_fault_hook(CheckpointFaultHook hook) {
  fault_hook.store(hook);
}
#endif

std::string checkpoint_file_name(int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%06lld.h5", static_cast<long long>(step));
  return name;
}

const char* latest_pointer_name() {
  return "latest";
}

const char* best_pointer_name() {
  return "best";
}

struct Checkpointer::Staging {
  StagingView view;
};

Checkpointer::Checkpointer(MPI_Comm comm, bool async)
    : comm_(std::make_unique<PrivateComm>(comm)), async_(async) {}

bool checkpoint_stages_tensors(bool async) {
  return async || !tensors_on_host();
}

Checkpointer::~Checkpointer() {
  // ~SaveJob joins the threads. But a poll's MPI_Iallreduce still pending writes into its
  // job: when training stops without completing the save (an error on some ranks only, and
  // the program is ending), the job is left to the process's exit instead of freeing
  // buffers MPI may still write.
  if (job_ && job_->poll_request != MPI_REQUEST_NULL) {
    int done = 0;
    if (MPI_Test(&job_->poll_request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) {
      static_cast<void>(job_.release());
    }
  }
}

std::string Checkpointer::save(const CheckpointContents& contents, const std::string& dir,
                               int64_t keep, bool best) {
  wait();
  const PrivateComm& comm = *comm_;
  auto job = std::make_unique<SaveJob>();
  job->dir = dir;
  job->keep = keep;
  job->best = best;
  const bool stage = checkpoint_stages_tensors(async_);

  // Phase 1: local work only, then agreement. On failure rank 0 drops the file it created.
  try {
    on_every_rank(comm.get(), [&] {
      MESHTRAIN_REQUIRE(contents.mesh.world_size() == comm.size(), "checkpoint: the mesh (",
                        contents.mesh.describe(), ") has ", contents.mesh.world_size(),
                        " ranks but the communicator has ", comm.size());
      MESHTRAIN_REQUIRE(!dir.empty(), "checkpoint: the directory is empty");
      MESHTRAIN_REQUIRE(contents.train_state.step >= 0, "checkpoint: negative step ",
                        contents.train_state.step);
      job->entries = dataset_entries(contents, comm.rank());
      job->file_name = checkpoint_file_name(contents.train_state.step);
      job->final_path = (fs::path(dir) / job->file_name).string();
      job->tmp_path = job->final_path + ".tmp";
      // The staging buffer holds floats; a 16-bit block takes its bytes rounded up to whole
      // floats, so that every block starts aligned for a float.
      const auto staged_floats = [](const ShardedTensor& t) {
        return (t.box.elements() * t.element_bytes() + 3) / 4;
      };
      int64_t staged_elements = 0;
      for (const DatasetEntry& entry : job->entries) {
        const ShardedTensor& t = *entry.tensor;
        MESHTRAIN_REQUIRE(t.storage != Dtype::fp16, "checkpoint: tensor '", t.name,
                          "' is stored as fp16, which checkpoints do not hold");
        job->dataset_bytes.push_back(global_elements(t.global_shape) * t.element_bytes());
        if (entry.owner) staged_elements += staged_floats(t);
      }
      fault_point("prepare");
      if (stage &&
          (!staging_ || static_cast<int64_t>(staging_->view.extent(0)) < staged_elements)) {
        staging_.reset();
        auto staging = std::make_unique<Staging>();
        staging->view = StagingView(
            Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::checkpoint_staging"),
            static_cast<size_t>(staged_elements));
        staging_ = std::move(staging);
      }
      int64_t next = 0;
      for (size_t i = 0; i < job->entries.size(); ++i) {
        const DatasetEntry& entry = job->entries[i];
        if (!entry.owner) continue;
        const ShardedTensor& t = *entry.tensor;
        SaveJob::Block block;
        block.dataset = static_cast<int64_t>(i);
        block.meta = t;
        block.meta.local = Vector();
        block.meta.bits = HalfBits();
        block.element_bytes = t.element_bytes();
        const int64_t n = t.box.elements();
        char* staging = stage ? reinterpret_cast<char*>(staging_->view.data() + next) : nullptr;
        if (tensors_on_host()) {
          // Shared memory here: no copy.
          if (t.stored_16bit()) {
            block.bits_mirror = host_mirror(t.bits);
            block.source = reinterpret_cast<const char*>(block.bits_mirror.data());
          } else {
            block.mirror = host_mirror(t.local);
            block.source = reinterpret_cast<const char*>(block.mirror.data());
          }
          block.staged = staging;
        } else if (t.stored_16bit()) {
          // Device tensors: copied into the (pinned) staging buffer now, before save returns.
          HostBits target(reinterpret_cast<uint16_t*>(staging), static_cast<size_t>(n));
          Kokkos::deep_copy(target, t.bits);
          block.source = staging;
        } else {
          HostFloats target(reinterpret_cast<float*>(staging), static_cast<size_t>(n));
          Kokkos::deep_copy(target, t.local);
          block.source = staging;
        }
        next += staged_floats(t);
        job->blocks.push_back(std::move(block));
      }
      if (comm.rank() == 0) {
        std::error_code ec;
        fs::create_directories(dir, ec);
        if (ec) MESHTRAIN_FAIL("cannot create checkpoint directory '", dir, "': ", ec.message());
        fs::remove(job->tmp_path, ec);
        if (ec) MESHTRAIN_FAIL("cannot remove the stale '", job->tmp_path, "': ", ec.message());
        std::lock_guard<std::mutex> lock(hdf5::global_mutex());
        hdf5::silence_errors();
        job->offsets = create_file(*job, contents);
      } else {
        job->offsets.assign(job->entries.size(), 0);
      }
      checked_int(job->offsets.size(), "checkpoint dataset count");
    });
  } catch (...) {
    if (comm.rank() == 0 && !job->tmp_path.empty()) {
      std::error_code ec;
      fs::remove(job->tmp_path, ec);
    }
    throw;
  }
  // Rank 0's offsets on every rank (the contents, and so the datasets, are alike on all).
  broadcast_collective(job->offsets.data(), static_cast<int>(job->offsets.size()), MPI_INT64_T, 0,
                       comm.get(), "MPI_Ibcast (checkpoint dataset offsets)");

  // Phase 2: the writer.
  const std::string path = job->final_path;
  if (async_) {
    SaveJob& running = *job;
    job_ = std::move(job);
    try {
      running.thread = std::thread(run_writer, std::ref(running));
    } catch (const std::system_error&) {
      run_writer(running);  // no thread to be had: write now, the checkpoint stays correct
    }
    return path;
  }
  run_writer(*job);
  job_ = std::move(job);
  wait();
  return path;
}

void Checkpointer::wait_snapshot() {
  if (!job_) return;
  fault_point("snapshot_wait");
  std::unique_lock<std::mutex> lock(job_->mutex);
  job_->staged_cv.wait(lock, [&] { return job_->staged; });
}

// Each poll reads the agreement started by the previous one (it has completed meanwhile, in
// the step's own MPI calls) and starts the next, so a poll does not wait for slower ranks;
// every rank acts on the same answer at the same poll.
std::optional<std::string> Checkpointer::poll() {
  if (!job_) return std::nullopt;
  SaveJob& job = *job_;
  if (job.poll_request != MPI_REQUEST_NULL) {
    wait_collective(&job.poll_request, 1, "the agreement that a checkpoint write finished");
    if (job.poll_all != 0) {
      if (job.finishing) return wait();
      try {
        finish_writes(*comm_, job);
      } catch (...) {
        job_.reset();
        throw;
      }
    }
  }
  job.poll_mine = (job.finishing ? job.files_done.load() : job.finished.load()) ? 1 : 0;
  check_mpi(MPI_Iallreduce(&job.poll_mine, &job.poll_all, 1, MPI_INT, MPI_MIN, comm_->get(),
                           &job.poll_request),
            "MPI_Iallreduce (checkpoint write finished)");
  return std::nullopt;
}

std::optional<std::string> Checkpointer::wait() {
  if (!job_) return std::nullopt;
  // Whatever happens below, this save is no longer in flight.
  std::unique_ptr<SaveJob> job = std::move(job_);
  if (job->poll_request != MPI_REQUEST_NULL) {
    wait_collective_or_give_up(&job->poll_request, 1,
                               "the agreement that a checkpoint write finished", job);
  }
  if (!job->finishing) finish_writes(*comm_, *job);
  if (job->finisher.joinable()) job->finisher.join();
  on_every_rank(comm_->get(), [&] {
    if (job->finish_error) std::rethrow_exception(job->finish_error);
  });
  return job->final_path;
}

std::string save_checkpoint(const CheckpointContents& contents, const std::string& dir,
                            int64_t keep, MPI_Comm comm) {
  Checkpointer checkpointer(comm, /*async=*/false);
  return checkpointer.save(contents, dir, keep);
}

}  // namespace meshtrain
