#include "framework/io/checkpoint_report.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "framework/io/checkpoint.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

int print_checkpoint(const std::string& path, bool verify, std::ostream& out) {
  const CheckpointListing listing = list_checkpoint(path);
  const CheckpointInfo& info = listing.info;
  const TrainState& s = info.train_state;
  out << "checkpoint: " << path << "\n";
  out << "framework version: " << info.framework_version << "\n";
  out << "step: " << s.step << "\n";
  out << "mesh: " << info.mesh << " (" << info.world_size
      << (info.world_size == 1 ? " rank" : " ranks") << ")\n";
  out << "train state: epoch=" << s.epoch << " batch_in_epoch=" << s.batch_in_epoch
      << " seed=" << s.seed << " rng_offset=" << s.rng_offset
      << " optimizer_step=" << s.optimizer_step << "\n";
  out << "data order: " << (s.data_order.empty() ? "not recorded" : s.data_order) << "\n";
  if (!std::isnan(s.best_metric) || s.evals_since_best > 0) {
    out << "best evaluation: "
        << (s.best_metric_name.empty() ? "(metric not recorded)" : s.best_metric_name) << " "
        << s.best_metric << " (" << s.evals_since_best << " evaluations since)\n";
  }
  if (s.loss_scale > 0) {
    out << "loss scale: " << s.loss_scale << " (" << s.loss_scale_clean_steps
        << " clean steps since it last changed)\n";
  }

  // Columns: path, dtype, shape, spec, storage.
  size_t width = 0;
  for (const auto& d : listing.datasets) width = std::max(width, d.path.size());
  out << "datasets (" << listing.datasets.size() << "):\n";
  for (const auto& d : listing.datasets) {
    std::string storage = d.chunk.empty() ? "contiguous" : "chunks " + format_shape(d.chunk);
    if (!d.checksum.empty()) storage += ", " + d.checksum;
    std::string padded = d.path;
    padded.resize(width, ' ');
    out << "  " << padded << "  " << d.dtype << "  " << format_shape(d.shape) << "  "
        << (d.spec.empty() ? "-" : d.spec) << "  (" << storage << ")\n";
  }

  out << "config:\n";
  std::istringstream config(info.config_text);
  std::string line;
  bool any = false;
  while (std::getline(config, line)) {
    out << "  " << line << "\n";
    any = true;
  }
  if (!any) out << "  (none)\n";

  if (verify) {
    const int64_t checked = verify_checkpoint(path);
    out << "verify: " << checked << " datasets read, all checksums match\n";
  }
  return 0;
}

}  // namespace meshtrain
