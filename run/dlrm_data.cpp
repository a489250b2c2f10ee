// The DLRM's data files against its config (dlrm_data.hpp).

#include "run/dlrm_data.hpp"

#include "base/error.hpp"

namespace meshtrain {

std::string dlrm_one_file(const std::vector<std::string>& entries, const std::string& key,
                          const std::string& config_file) {
  const std::vector<std::string> files = expand_data_paths(entries, key);
  if (files.size() > 1) {
    MESHTRAIN_BAD_INPUT(config_file, ": ", key, " names ", files.size(), " files ('", files.front(),
                        "', ...), but model.kind = \"dlrm\" reads its sparse ",
                        "features from one file per split (shards are not read yet)");
  }
  return files.empty() ? std::string() : files.front();
}

std::vector<std::string> dlrm_table_names(const DlrmShape& shape) {
  std::vector<std::string> names;
  for (const DlrmTable& t : shape.tables) names.push_back(t.name);
  return names;
}

std::unique_ptr<RowSource> open_dlrm_train_source(const RunConfig& config,
                                                  const std::string& file) {
  const DlrmShape shape = config.model.dlrm();
  const ModelWidthKeys keys{"model.bottom[0]", "the dlrm's one output"};
  const LossKind loss = config.model.loss.value_or(LossKind::binary_cross_entropy);
  std::unique_ptr<RowSource> source = open_data_source(config.data, Split::train, config.run.seed,
                                                       shape.bottom.front(), 1, loss, keys);
  // Checked above; opened again with a chunk cache that keeps every chunk of its x_key and
  // y_key once read (a shuffled batch touches nearly all of them, which HDF5's default 1 MiB
  // reloaded every step), as the sparse reader keeps its tables' (DlrmDataCaches).
  const DlrmDataCaches caches =
      dlrm_data_cache_bytes(file, {}, "", {config.data.x_key, config.data.y_key});
  if (caches.dense_budget() > Hdf5SourceOptions{}.chunk_cache_bytes) {
    Hdf5SourceOptions options;
    options.chunk_cache_bytes = caches.dense_budget();
    options.random_rows = config.data.shuffle != ShuffleMode::none;
    options.block_rows = config.data.shuffle == ShuffleMode::blocks ? config.data.block_rows : 0;
    options.x_name = config.data.x_key;
    options.y_name = config.data.y_key;
    source = open_hdf5_source({file}, 1, options);
  }
  return source;
}

void check_dlrm_sparse_data(const RunConfig& config, const SparseHdf5Reader& reader,
                            int64_t dense_rows) {
  const DlrmShape shape = config.model.dlrm();
  for (size_t t = 0; t < shape.tables.size(); ++t) {
    if (reader.table_rows(t) > shape.tables[t].rows) {
      MESHTRAIN_BAD_INPUT("sparse data file '", reader.path(), "', table '", shape.tables[t].name,
                          "': the file's table has ", reader.table_rows(t), " rows, more than the ",
                          shape.tables[t].rows, " of model.tables (", config.file, ")");
    }
  }
  if (reader.num_rows() != dense_rows) {
    MESHTRAIN_BAD_INPUT("sparse data file '", reader.path(), "': its tables describe ",
                        reader.num_rows(), " rows, but ", config.data.x_key, " holds ", dense_rows);
  }
}

}  // namespace meshtrain
