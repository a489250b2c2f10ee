// Checkpoints: save on one mesh, restore on another (exact values), keep/latest handling,
// bad input (model mismatch, pointer, corruption) agreed by all ranks, inspect, h5dump.
// Registered twice: saves synchronous, and (MESHTRAIN_TEST_CHECKPOINT_ASYNC=1) through an
// asynchronous Checkpointer whose caller overwrites the tensors as soon as wait_snapshot()
// returns, so the file must hold the staged values.
// Runs at NP 1, 2 and 4; meshes are sized from the world so every case runs at every NP
// (at NP 4 the full cases of the brief: fsdp=4 -> dp=2, tp=2 -> 1 rank, fsdp=2 x tp=2 ->
// tp=4, 1 rank -> fsdp=2 x tp=2).

#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <stdlib.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "framework/core/version.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/checkpoint_report.hpp"
#include "tests/support/checkpoint_contents.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using testing::count_all_mismatches;
using testing::test_contents;

bool async_saves() {
  const char* value = std::getenv("MESHTRAIN_TEST_CHECKPOINT_ASYNC");
  return value != nullptr && std::string(value) == "1";
}

// save_checkpoint, or an asynchronous save whose caller changes the tensors right after the
// snapshot (as the optimizer would) and keeps running collectives until the file is complete.
std::string save(const CheckpointContents& contents, const std::string& dir, int64_t keep,
                 MPI_Comm comm) {
  if (!async_saves()) return save_checkpoint(contents, dir, keep, comm);
  Checkpointer checkpointer(comm, /*async=*/true);
  const std::string path = checkpointer.save(contents, dir, keep);
  EXPECT_TRUE(checkpointer.in_flight());
  checkpointer.wait_snapshot();
  auto overwrite = [](const ShardedTensor& t) {
    Kokkos::deep_copy(t.local, std::numeric_limits<float>::quiet_NaN());
  };
  for (const auto& t : contents.params) overwrite(t);
  for (const auto& slot : contents.opt_state)
    for (const auto& t : slot.tensors) overwrite(t);
  std::optional<std::string> done;
  while (!done) {
    MPI_Barrier(comm);
    done = checkpointer.poll();
  }
  EXPECT_EQ(*done, path);
  EXPECT_FALSE(checkpointer.in_flight());
  return path;
}

// Each test with a fresh directory dir_ shared by all ranks.
class CheckpointTest : public ::testing::Test {
 protected:
  // The first n ranks of the world (MPI_COMM_NULL on the others).
  static MPI_Comm first_ranks(int n) {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank() < n ? 0 : MPI_UNDEFINED, world_rank(), &comm);
    return comm;
  }

  using Axes = std::vector<std::pair<std::string, int>>;

  // Saves test contents (step 42) with `save_layout` on mesh `save_axes` over the first
  // save_ranks ranks, then loads them into zeroed tensors of `load_layout` on `load_axes`
  // over the first load_ranks ranks, and compares every value exactly.
  void roundtrip(const Axes& save_axes, int save_ranks, const std::string& save_layout,
                 const Axes& load_axes, int load_ranks, const std::string& load_layout) {
    const int64_t step = 42;
    const Mesh save_mesh = Mesh::create(save_axes, save_ranks);
    MPI_Comm save_comm = first_ranks(save_ranks);
    if (save_comm != MPI_COMM_NULL) {
      int r = 0;
      MPI_Comm_rank(save_comm, &r);
      const CheckpointContents saved = test_contents(save_mesh, r, save_layout, step, true);
      const std::string path = save(saved, dir_, 2, save_comm);
      EXPECT_EQ(path, dir_ + "/" + checkpoint_file_name(step));
      MPI_Comm_free(&save_comm);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const Mesh load_mesh = Mesh::create(load_axes, load_ranks);
    MPI_Comm load_comm = first_ranks(load_ranks);
    if (load_comm != MPI_COMM_NULL) {
      int r = 0;
      MPI_Comm_rank(load_comm, &r);
      CheckpointContents restored = test_contents(load_mesh, r, load_layout, step, false);
      const CheckpointInfo info = load_checkpoint(dir_, restored, load_comm);
      EXPECT_EQ(count_all_mismatches(restored, step), 0)
          << "rank " << r << " of " << load_mesh.describe();
      EXPECT_EQ(restored.train_state,
                test_contents(save_mesh, 0, save_layout, step, true).train_state);
      EXPECT_EQ(info.mesh, save_mesh.describe());
      EXPECT_EQ(info.world_size, save_ranks);
      EXPECT_EQ(info.path, dir_ + "/" + checkpoint_file_name(step));
      EXPECT_NE(info.config_text.find("checkpoint-test"), std::string::npos);
      EXPECT_EQ(info.framework_version, std::string(framework_version()));
      MPI_Comm_free(&load_comm);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }

  // Saves the test contents at `step` on all ranks with fsdp = world size.
  std::string save_fsdp(int64_t step, int64_t keep = 2) {
    const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
    return save(test_contents(mesh, world_rank(), "fsdp", step, true), dir_, keep, MPI_COMM_WORLD);
  }

  // Empty contents for all ranks with tp = world size.
  CheckpointContents empty_tp(
      const std::vector<testing::ParamShape>& model = testing::test_model()) {
    const Mesh mesh = Mesh::create({{"tp", world_size()}}, world_size());
    return test_contents(mesh, world_rank(), "tp", 0, false, model);
  }

  // A fresh directory shared by all ranks (made by rank 0), removed after the test.
  const testing::TempDir tmp_{/*shared=*/true, "meshtrain-ckpt"};
  const std::string dir_ = tmp_.path();
};

TEST_F(CheckpointTest, FsdpToDp) {
  const int n = world_size();
  roundtrip({{"fsdp", n}}, n, "fsdp", {{"dp", std::max(1, n / 2)}}, std::max(1, n / 2), "dp");
}

TEST_F(CheckpointTest, TpToSingleRank) {
  const int n = std::min(2, world_size());
  roundtrip({{"tp", n}}, n, "tp", {}, 1, "dp");
}

TEST_F(CheckpointTest, FsdpTpToTp) {
  const int n = world_size();
  const int fsdp = n >= 4 ? 2 : 1;
  roundtrip({{"fsdp", fsdp}, {"tp", n / fsdp}}, n, "fsdp_tp", {{"tp", n}}, n, "tp");
}

TEST_F(CheckpointTest, SingleRankToFsdpTp) {
  const int n = world_size();
  const int fsdp = n >= 4 ? 2 : 1;
  roundtrip({}, 1, "dp", {{"fsdp", fsdp}, {"tp", n / fsdp}}, n, "fsdp_tp");
}

// Blocks replicated over dp are written once (by dp coordinate 0) and read by all.
TEST_F(CheckpointTest, ReplicatedOverDpToFsdp) {
  const int n = world_size();
  const int dp = n >= 2 ? 2 : 1;
  roundtrip({{"dp", dp}, {"fsdp", n / dp}}, n, "fsdp", {{"fsdp", n}}, n, "fsdp");
}

TEST_F(CheckpointTest, KeepRetainsNewestAndLatestPointsToLast) {
  save_fsdp(1, 2);
  save_fsdp(2, 2);
  const std::string last = save_fsdp(3, 2);
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_FALSE(fs::exists(dir_ + "/" + checkpoint_file_name(1)));
  EXPECT_TRUE(fs::exists(dir_ + "/" + checkpoint_file_name(2)));
  EXPECT_TRUE(fs::exists(last));
  ASSERT_EQ(find_latest_checkpoint(dir_).value_or(""), last);
  std::ifstream pointer(dir_ + "/latest");
  std::string line;
  std::getline(pointer, line);
  EXPECT_EQ(line, checkpoint_file_name(3));

  CheckpointContents into = empty_tp();
  const CheckpointInfo info = load_checkpoint(dir_, into, MPI_COMM_WORLD);
  EXPECT_EQ(info.train_state.step, 3);
  EXPECT_EQ(count_all_mismatches(into, 3), 0);

  // An explicit file path loads that checkpoint, not the latest.
  CheckpointContents older = empty_tp();
  EXPECT_EQ(
      load_checkpoint(dir_ + "/" + checkpoint_file_name(2), older, MPI_COMM_WORLD).train_state.step,
      2);
  EXPECT_EQ(count_all_mismatches(older, 2), 0);
}

TEST_F(CheckpointTest, MissingOrGarbledPointerIsBadInput) {
  CheckpointContents into = empty_tp();
  testing::expect_bad_input([&] { load_checkpoint(dir_, into, MPI_COMM_WORLD); }, {dir_, "latest"});
  testing::expect_bad_input([&] { load_checkpoint(dir_ + "/nope.h5", into, MPI_COMM_WORLD); },
                            {dir_ + "/nope.h5", "does not exist"});
  EXPECT_FALSE(find_latest_checkpoint(dir_).has_value());

  save_fsdp(5);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::ofstream(dir_ + "/latest") << "\x01garbage/../x\n";
  MPI_Barrier(MPI_COMM_WORLD);
  testing::expect_bad_input([&] { load_checkpoint(dir_, into, MPI_COMM_WORLD); },
                            {dir_ + "/latest", "garbled"});
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::ofstream(dir_ + "/latest") << checkpoint_file_name(77) << "\n";
  MPI_Barrier(MPI_COMM_WORLD);
  testing::expect_bad_input([&] { load_checkpoint(dir_, into, MPI_COMM_WORLD); },
                            {dir_ + "/latest", checkpoint_file_name(77), "does not exist"});
  // A file that is not HDF5.
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::ofstream(dir_ + "/" + checkpoint_file_name(77)) << "not hdf5";
  MPI_Barrier(MPI_COMM_WORLD);
  testing::expect_bad_input([&] { load_checkpoint(dir_, into, MPI_COMM_WORLD); },
                            {dir_ + "/" + checkpoint_file_name(77), "HDF5"});
}

TEST_F(CheckpointTest, ModelMismatchIsBadInputNamingParameterAndShapes) {
  save_fsdp(7);
  // Another shape.
  auto model = testing::test_model();
  model[2].shape = {12, 8};
  CheckpointContents other_shape = empty_tp(model);
  testing::expect_bad_input([&] { load_checkpoint(dir_, other_shape, MPI_COMM_WORLD); },
                            {"layers/1/weight", "[12, 4]", "[12, 8]"});
  // A parameter the checkpoint lacks.
  model = testing::test_model();
  model.push_back({"layers/2/weight", {4, 4}});
  CheckpointContents extra = empty_tp(model);
  testing::expect_bad_input([&] { load_checkpoint(dir_, extra, MPI_COMM_WORLD); },
                            {"layers/2/weight", "[4, 4]", "has no parameter"});
  // A parameter the model lacks.
  model = testing::test_model();
  model.erase(model.begin() + 1);
  CheckpointContents fewer = empty_tp(model);
  testing::expect_bad_input([&] { load_checkpoint(dir_, fewer, MPI_COMM_WORLD); },
                            {"layers/0/bias", "[12]", "does not have"});
  // An optimizer slot the checkpoint lacks.
  CheckpointContents momentum = empty_tp();
  momentum.opt_state[0].name = "momentum";
  testing::expect_bad_input([&] { load_checkpoint(dir_, momentum, MPI_COMM_WORLD); }, {"momentum"});
}

// Flips one byte in the middle of the stored data of `dataset` (serial HDF5 to find it).
void flip_byte_in_dataset(const std::string& file, const std::string& dataset) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  ASSERT_GE(d, 0);
  const haddr_t address = H5Dget_offset(d);  // contiguous
  const hsize_t size = H5Dget_storage_size(d);
  H5Dclose(d);
  H5Fclose(f);
  ASSERT_NE(address, HADDR_UNDEF);
  ASSERT_GT(size, 0u);
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(address + size / 2));
  char byte = 0;
  io.read(&byte, 1);
  byte ^= 0x5a;
  io.seekp(static_cast<std::streamoff>(address + size / 2));
  io.write(&byte, 1);
  ASSERT_TRUE(io.good());
}

TEST_F(CheckpointTest, FlippedByteIsReportedAsCorruption) {
  const std::string path = save_fsdp(9);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) flip_byte_in_dataset(path, "/params/layers/0/weight");
  MPI_Barrier(MPI_COMM_WORLD);
  // Every rank reports it, whichever rank read the bad chunk.
  CheckpointContents into = empty_tp();
  testing::expect_bad_input([&] { load_checkpoint(dir_, into, MPI_COMM_WORLD); },
                            {"/params/layers/0/weight", path, "corrupt"});
  if (world_rank() == 0) {
    testing::expect_bad_input([&] { verify_checkpoint(path); },
                              {"/params/layers/0/weight", path, "corrupt"});
    std::ostringstream out;
    testing::expect_bad_input([&] { print_checkpoint(path, true, out); },
                              {"/params/layers/0/weight", "corrupt"});
  }
}

// A dataset without its CRC-32 is refused by inspect --verify as by a load (issue 20, bug 7),
// naming the dataset.
TEST_F(CheckpointTest, DatasetWithoutChecksumIsRefusedByVerifyAndLoad) {
  const std::string path = save_fsdp(10);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    ASSERT_GE(H5Adelete_by_name(f, "/params/layers/1/bias", "crc32", H5P_DEFAULT), 0);
    H5Fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  CheckpointContents into = empty_tp();
  testing::expect_bad_input([&] { load_checkpoint(path, into, MPI_COMM_WORLD); },
                            {"/params/layers/1/bias", "crc32"});
  if (world_rank() == 0) {
    testing::expect_bad_input([&] { verify_checkpoint(path); },
                              {"/params/layers/1/bias", path, "crc32"});
  }
}

TEST_F(CheckpointTest, InspectPrintsStepMeshDatasetsSpecsAndConfig) {
  const std::string path = save_fsdp(11);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() != 0) return;
  std::ostringstream out;
  EXPECT_EQ(print_checkpoint(path, true, out), 0);
  const std::string text = out.str();
  const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
  for (const std::string fragment :
       {std::string("step: 11"), mesh.describe(), std::string("/params/layers/0/weight  "),
        std::string("float32  [8, 12]  P(fsdp, None)"), std::string("/opt_state/v/layers/1/bias"),
        std::string("/params/scale"), std::string("contiguous, crc32"),
        std::string("name = \"checkpoint-test\""), std::string("verify: 15 datasets read")}) {
    EXPECT_NE(text.find(fragment), std::string::npos) << "missing '" << fragment << "' in:\n"
                                                      << text;
  }
  const CheckpointListing listing = list_checkpoint(path);
  ASSERT_EQ(listing.datasets.size(), 15u);
  for (const auto& d : listing.datasets) EXPECT_EQ(d.checksum, "crc32") << d.path;
  // The stored CRC-32 is zlib's crc32 of the dataset's bytes (what Python's zlib.crc32 gives).
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const auto& d : listing.datasets) {
    hid_t ds = H5Dopen2(f, d.path.c_str(), H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    std::vector<float> values(static_cast<size_t>(H5Dget_storage_size(ds) / 4));
    ASSERT_GE(H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
    hid_t attr = H5Aopen(ds, "crc32", H5P_DEFAULT);
    ASSERT_GE(attr, 0);
    uint64_t stored = 0;
    ASSERT_GE(H5Aread(attr, H5T_NATIVE_UINT64, &stored), 0);
    const uLong expected = crc32(0L, reinterpret_cast<const Bytef*>(values.data()),
                                 static_cast<uInt>(values.size() * 4));
    EXPECT_EQ(stored, expected) << d.path;
    H5Aclose(attr);
    H5Dclose(ds);
  }
  H5Fclose(f);
  testing::expect_bad_input([&] { list_checkpoint(dir_ + "/absent.h5"); }, {dir_ + "/absent.h5"});
}

// h5dump (hdf5-tools) reads the checkpoint without meshtrain; its values are the saved ones.
TEST_F(CheckpointTest, H5dumpReadsParameterValues) {
  const std::string path = save_fsdp(13);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() != 0) return;
  if (std::string(MESHTRAIN_H5DUMP).empty()) GTEST_SKIP() << "h5dump (hdf5-tools) is not installed";
  const std::string command = std::string(MESHTRAIN_H5DUMP) +
                              " -A 0 -y -w0 -m %.9g -d /params/layers/0/weight " + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  ASSERT_EQ(pclose(pipe), 0) << output;
  const size_t data = output.find("DATA {");
  ASSERT_NE(data, std::string::npos) << output;
  const size_t end = output.find('}', data + 6);
  std::string values = output.substr(data + 6, end - data - 6);
  for (char& c : values) c = c == ',' ? ' ' : c;
  std::istringstream in(values);
  std::vector<float> dumped;
  double v = 0;
  while (in >> v) dumped.push_back(static_cast<float>(v));
  ASSERT_EQ(dumped.size(), 96u) << output;
  for (int64_t i = 0; i < 96; ++i)
    EXPECT_EQ(dumped[i], testing::test_value(0, i, 13)) << "element " << i;
}

// Rewrites the format-2 checkpoint `path` as format 1 at `old`: h5repack adds Fletcher32,
// then the format attribute is set back and the crc32 attributes go.
void make_format1_file(const std::string& path, const std::string& old) {
  const std::string command =
      std::string(MESHTRAIN_H5REPACK) + " -f FLET " + path + " " + old + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  hid_t f = H5Fopen(old.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  ASSERT_GE(H5Adelete(f, "format"), 0);
  hid_t type = H5Tcopy(H5T_C_S1);
  const std::string format = "meshtrain-checkpoint-1";
  H5Tset_size(type, format.size() + 1);
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t attr = H5Acreate2(f, "format", type, space, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(H5Awrite(attr, type, format.c_str()), 0);
  H5Aclose(attr);
  H5Sclose(space);
  H5Tclose(type);
  for (const auto& d : list_checkpoint(old).datasets) {
    ASSERT_GE(H5Adelete_by_name(f, d.path.c_str(), "crc32", H5P_DEFAULT), 0) << d.path;
  }
  H5Fclose(f);
  const CheckpointListing listing = list_checkpoint(old);
  for (const auto& d : listing.datasets) EXPECT_EQ(d.checksum, "fletcher32") << d.path;
}

// Checkpoints of format 1 (chunked datasets with HDF5's Fletcher32 filter, no crc32) still
// load, and a flipped byte in them is still reported. Made from a format-2 file by h5repack
// (found when the build was configured; a build run elsewhere may not have it).
TEST_F(CheckpointTest, Format1FletcherFilesLoad) {
  if (std::string(MESHTRAIN_H5REPACK).empty() || access(MESHTRAIN_H5REPACK, X_OK) != 0) {
    GTEST_SKIP() << "h5repack (hdf5-tools) is missing";
  }
  const std::string path = save_fsdp(15);
  const std::string old = dir_ + "/" + checkpoint_file_name(16);
  MPI_Barrier(MPI_COMM_WORLD);
  // Rank 0 makes the file; every rank learns whether it could, so none waits for the others
  // in a collective they never reach.
  int made = 1;
  if (world_rank() == 0) {
    make_format1_file(path, old);
    made = HasFatalFailure() ? 0 : 1;
  }
  MPI_Bcast(&made, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ASSERT_EQ(made, 1) << "rank 0 could not make the format-1 file";
  CheckpointContents into = empty_tp();
  EXPECT_EQ(load_checkpoint(old, into, MPI_COMM_WORLD).train_state.step, 15);
  EXPECT_EQ(count_all_mismatches(into, 15), 0);
  if (world_rank() == 0) {
    EXPECT_EQ(verify_checkpoint(old), 15);
    hid_t f = H5Fopen(old.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "/params/layers/0/weight", H5P_DEFAULT);
    hid_t space = H5Dget_space(d);
    hsize_t offset[2] = {0, 0};
    unsigned mask = 0;
    haddr_t address = 0;
    hsize_t size = 0;
    ASSERT_GE(H5Dget_chunk_info(d, space, 0, offset, &mask, &address, &size), 0);
    H5Sclose(space);
    H5Dclose(d);
    H5Fclose(f);
    std::fstream io(old, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(address + size / 2));
    char byte = 0;
    io.read(&byte, 1);
    io.seekp(static_cast<std::streamoff>(address + size / 2));
    io.put(static_cast<char>(byte ^ 0x5a));
    ASSERT_TRUE(io.good());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  CheckpointContents again = empty_tp();
  testing::expect_bad_input([&] { load_checkpoint(old, again, MPI_COMM_WORLD); },
                            {"/params/layers/0/weight", old, "corrupt"});
}

}  // namespace
}  // namespace meshtrain
