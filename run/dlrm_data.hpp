#pragma once
// A DLRM's data files opened and checked against its config, the one way DlrmRun and `meshtrain
// calibrate` (run/dlrm_read_timing.hpp) both do it, so that calibrate times the reads a run makes.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/io/data.hpp"
#include "framework/io/sparse_hdf5.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {

// The one file of data.path / data.test_path (`key`); "" when the key names none. bad_input
// naming config_file and key when it names more than one (shards are not read yet).
std::string dlrm_one_file(const std::vector<std::string>& entries, const std::string& key,
                          const std::string& config_file);

// The config's tables' names, in model.tables order.
std::vector<std::string> dlrm_table_names(const DlrmShape& shape);

// The dense training source of `file` (data.path's one file), as a DLRM run reads it:
// open_data_source's (checked against model.bottom[0] and the loss, binary cross entropy when
// model.loss is unset), opened again with a chunk cache that keeps every chunk of x_key and
// y_key once read (DlrmDataCaches::dense_budget) when that exceeds HDF5's default 1 MiB; its
// rows random, none or in blocks of data.block_rows by data.shuffle. Not collective; bad_input
// in one sentence.
std::unique_ptr<RowSource> open_dlrm_train_source(const RunConfig& config, const std::string& file);

// A sparse reader's file against the config: each table's rows at most model.tables' (ids are
// checked against the file's rows, so a larger file table would let ids past the model's rows
// through) and as many rows as the dense source's `dense_rows`. Not collective; bad_input naming
// the file, the table or x_key, and the config.
void check_dlrm_sparse_data(const RunConfig& config, const SparseHdf5Reader& reader,
                            int64_t dense_rows);

}  // namespace meshtrain
