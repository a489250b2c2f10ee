#include "framework/observe/step_passes.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <ostream>
#include <tuple>

#include "base/error.hpp"

namespace meshtrain {

std::string pass_label_key(const LabelPasses& label) {
  return std::string(to_string(label.kind)) + " " + label.label;
}

nlohmann::ordered_json pass_counts_json(const PassCounts& counts) {
  nlohmann::ordered_json doc;
  doc["kernels"] = counts.kernels;
  doc["copies"] = counts.copies;
  doc["copy_bytes"] = counts.copy_bytes;
  doc["fences"] = counts.fences;
  doc["complete"] = counts.complete;
  nlohmann::ordered_json labels = nlohmann::ordered_json::object();
  for (const LabelPasses& l : counts.labels) labels[pass_label_key(l)] = l.count;
  doc["labels"] = labels;
  return doc;
}

PassCounts pass_counts_from_json(const nlohmann::json& doc) {
  PassCounts counts;
  try {
    counts.kernels = doc.at("kernels").get<int64_t>();
    counts.copies = doc.at("copies").get<int64_t>();
    counts.copy_bytes = doc.value("copy_bytes", int64_t{0});
    counts.fences = doc.at("fences").get<int64_t>();
    counts.complete = doc.value("complete", true);
    for (const auto& [key, count] : doc.at("labels").items()) {
      LabelPasses label;
      const std::size_t space = key.find(' ');
      const std::string kind = key.substr(0, space);
      label.kind = kind == "copy"    ? PassKind::copy
                   : kind == "fence" ? PassKind::fence
                                     : PassKind::kernel;
      label.label = space == std::string::npos ? "" : key.substr(space + 1);
      label.count = count.get<int64_t>();
      counts.labels.push_back(label);
    }
  } catch (const nlohmann::json::exception& e) {
    MESHTRAIN_FAIL("pass counts of an unexpected shape: ", e.what());
  }
  // In pass_counts()'s order (the JSON object's is by key).
  std::sort(counts.labels.begin(), counts.labels.end(),
            [](const LabelPasses& a, const LabelPasses& b) {
              return std::tie(a.kind, a.label) < std::tie(b.kind, b.label);
            });
  return counts;
}

nlohmann::ordered_json traced_passes_json(const TracedPasses& passes) {
  nlohmann::ordered_json doc;
  doc["rank"] = passes.rank;
  doc["steps"] = nlohmann::ordered_json::array();
  for (const StepPasses& s : passes.steps) {
    doc["steps"].push_back({{"step", s.step},
                            {"kernels", s.totals.kernels},
                            {"copies", s.totals.copies},
                            {"copy_bytes", s.totals.copy_bytes},
                            {"fences", s.totals.fences}});
  }
  doc["labels_step"] = passes.labels_step;
  doc["labels"] = pass_counts_json(passes.labels);
  return doc;
}

std::optional<TracedPasses> read_traced_passes(const std::string& trace_dir) {
  const std::string path = trace_dir + "/passes.json";
  if (!std::filesystem::exists(path)) return std::nullopt;
  std::ifstream in(path);
  if (!in) MESHTRAIN_BAD_INPUT("cannot read the pass counts '", path, "'");
  TracedPasses passes;
  try {
    const nlohmann::json doc = nlohmann::json::parse(in);
    passes.rank = doc.at("rank").get<int>();
    for (const auto& s : doc.at("steps")) {
      StepPasses step;
      step.step = s.at("step").get<int64_t>();
      step.totals.kernels = s.at("kernels").get<int64_t>();
      step.totals.copies = s.at("copies").get<int64_t>();
      step.totals.copy_bytes = s.at("copy_bytes").get<int64_t>();
      step.totals.fences = s.at("fences").get<int64_t>();
      passes.steps.push_back(step);
    }
    passes.labels_step = doc.at("labels_step").get<int64_t>();
    passes.labels = pass_counts_from_json(doc.at("labels"));
  } catch (const nlohmann::json::exception& e) {
    MESHTRAIN_BAD_INPUT("the pass counts '", path, "' are not readable: ", e.what());
  } catch (const Error& e) {
    MESHTRAIN_BAD_INPUT("the pass counts '", path, "' are not readable: ", e.what());
  }
  return passes;
}

void print_traced_passes(const TracedPasses& passes, std::ostream& out) {
  out << "passes per step on rank " << passes.rank
      << " (Kokkos kernels, deep copies, fences; BLAS/oneDNN/cuBLAS GEMMs not included)\n";
  out << "step     kernels   copies   copied bytes   fences\n";
  for (const StepPasses& s : passes.steps) {
    out << std::setw(4) << s.step << std::setw(12) << s.totals.kernels << std::setw(9)
        << s.totals.copies << std::setw(15) << s.totals.copy_bytes << std::setw(9)
        << s.totals.fences << "\n";
  }
  if (passes.labels.labels.empty()) return;
  out << "by label, step " << passes.labels_step << ":\n";
  for (const LabelPasses& l : passes.labels.labels) {
    out << std::setw(8) << l.count << "  " << to_string(l.kind) << "  " << l.label << "\n";
  }
  if (!passes.labels.complete) out << "(more labels than the counter's table holds)\n";
}

}  // namespace meshtrain
