// `meshtrain sweep`: the grid's runs on groups of ranks (MPI_Comm_split of the world), each a
// TrainingRun on its group's communicator; results gathered to world rank 0 (docs/sweeps.md).

#include "apps/sweep.hpp"
#include "apps/command.hpp"

#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/metrics.hpp"
#include "framework/train/config.hpp"
#include "framework/train/hardware_file.hpp"
#include "run/dlrm_run.hpp"  // require_command_builds
#include "run/training_run.hpp"

namespace meshtrain {
namespace {

// The values of "v1,v2,...": split at the commas outside brackets, braces and quotes, so a
// TOML array or a quoted string with commas stays one value.
std::vector<std::string> split_values(const std::string& text) {
  std::vector<std::string> values;
  std::string current;
  int depth = 0;
  char quote = 0;
  for (const char c : text) {
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '[' || c == '{') {
      ++depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    } else if (c == ',' && depth == 0) {
      values.push_back(trim(current));
      current.clear();
      continue;
    }
    current += c;
  }
  values.push_back(trim(current));
  return values;
}

// A run's folder name from its grid values: "optimizer.lr=0.1,data.batch_size=32" (Hydra's
// override_dirname), every character but letters, digits and ._=+-, replaced by '_', at most
// 120 characters.
std::string folder_label(const std::vector<std::string>& point) {
  std::string label;
  for (const std::string& assignment : point) {
    if (!label.empty()) label += ',';
    for (const char c : assignment) {
      const bool safe = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                        c == '=' || c == '+' || c == '-';
      if (safe) {
        label += c;
      } else if (c != ' ' && (label.empty() || label.back() != '_')) {
        label += '_';
      }
    }
  }
  if (label.size() > 120) label.resize(120);
  return label;
}

// One run of the grid as every rank knows it before any run starts.
struct PlannedRun {
  int64_t index = 0;
  std::vector<std::pair<std::string, std::string>> values;  // (key, value text) per grid axis
  std::string label;                                        // "optimizer.lr=0.1, ..."
  std::string dir;
  RunConfig config;
};

void print_line(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::string ranks_text(int first, int count) {
  if (count == 1) return "rank " + std::to_string(first);
  return "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// Trains `run` on `group` (collective over it). Returns the table's row, complete on the
// group's rank 0. An AgreedError (set-up, a non-finite loss, unreadable data: every rank of
// the group holds it) fails this run only; any other error propagates.
nlohmann::json train_one(const PlannedRun& run, MPI_Comm group, bool leader) {
  nlohmann::json row;
  row["index"] = run.index;
  row["dir"] = run.dir;
  nlohmann::json grid = nlohmann::json::object();
  for (const auto& [key, value] : run.values) grid[key] = value;
  row["grid"] = grid;

  const double start = MPI_Wtime();
  std::shared_ptr<std::FILE> log;  // the run's train.log (the group's rank 0)
  auto write_log = [&log](const std::string& line) {
    if (!log) return;
    std::fprintf(log.get(), "%s\n", line.c_str());
    std::fflush(log.get());
  };
  std::optional<LogEvent> last_log;
  try {
    on_every_rank(group, [&] {
      if (!leader) return;
      std::error_code ec;
      std::filesystem::create_directories(run.dir, ec);
      if (ec) {
        MESHTRAIN_BAD_INPUT("cannot create the run's folder '", run.dir, "': ", ec.message());
      }
      // The config as run: the file with --set, the grid's values and the run's folders.
      std::ofstream config_file(run.dir + "/config.toml");
      config_file << (run.config.text.empty() ? config_to_toml(run.config) : run.config.text);
      if (!config_file) MESHTRAIN_BAD_INPUT("cannot write '", run.dir, "/config.toml'");
      log.reset(std::fopen((run.dir + "/train.log").c_str(), "w"), [](std::FILE* f) {
        if (f) std::fclose(f);
      });
      if (!log) MESHTRAIN_BAD_INPUT("cannot write '", run.dir, "/train.log'");
    });
    RunEvents events;
    events.on_log = [&](const LogEvent& e) {
      last_log = e;
      write_log(format_log_line(e));
    };
    events.on_eval = [&](const EvalEvent& e) { write_log(format_eval_line(e)); };
    events.on_checkpoint = [&](int64_t, const std::string& path) {
      write_log("checkpoint " + path);
    };
    TrainingRun training(run.config, std::move(events), std::nullopt, group);
    for (const std::string& line : training.describe()) write_log(line);
    for (const std::string& note : training.config().notes) write_log("note: " + note);
    for (const std::string& warning : training.warnings()) write_log("warning: " + warning);
    const RunSummary summary = training.train();
    const EvalMetric metric =
        training.config().checkpoint.keep_best.value_or(EvalMetric::test_loss);
    row["status"] = "ok";
    row["steps"] = training.steps_done();
    row["final_loss"] = last_log ? last_log->loss : std::nan("");
    if (summary.last_eval) {
      nlohmann::json eval = nlohmann::json::parse(eval_event_json(*summary.last_eval));
      eval.erase("event");
      row["final_eval"] = eval;
    }
    row["best_metric"] = to_string(metric);
    row["best"] = training.best_metric();
    row["best_step"] = training.best_step();
  } catch (const AgreedError& error) {
    row["status"] = "failed";
    row["error"] = error.what();
    write_log(std::string("error: ") + error.what());
  }
  row["wall_s"] = MPI_Wtime() - start;
  if (leader && log) {
    std::ofstream(run.dir + "/result.json")
        << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  return row;
}

// A number as the table prints it: 5 significant digits, "-" when absent or NaN.
std::string figure(const nlohmann::json& row, const std::string& key,
                   const std::string& inner = "") {
  const nlohmann::json* value = row.contains(key) ? &row.at(key) : nullptr;
  if (value && !inner.empty()) value = value->contains(inner) ? &value->at(inner) : nullptr;
  if (!value || !value->is_number()) return "-";
  char text[32];
  if (value->is_number_integer()) {
    std::snprintf(text, sizeof text, "%lld", static_cast<long long>(value->get<int64_t>()));
  } else if (std::isnan(value->get<double>())) {
    return "-";
  } else {
    std::snprintf(text, sizeof text, "%.5g", value->get<double>());
  }
  return text;
}

// The table of `rows` (sorted by index) as aligned columns, then one line per failed run.
void print_table(const std::vector<nlohmann::json>& rows, const std::vector<GridAxis>& axes) {
  std::vector<std::string> header = {"run"};
  for (const GridAxis& axis : axes) header.push_back(axis.key);
  // The metric the runs keep their best by (the same key for every run unless the grid
  // varies checkpoint.keep_best: then the first ok run's name heads the column).
  std::string metric = "test_loss";
  for (const nlohmann::json& row : rows) {
    if (row.contains("best_metric")) {
      metric = row["best_metric"].get<std::string>();
      break;
    }
  }
  const bool metric_is_loss = metric == "test_loss";
  for (const char* name : {"status", "steps", "train_loss", "test_loss"}) header.push_back(name);
  if (!metric_is_loss) header.push_back(metric);
  for (const std::string& name :
       {"best_" + metric, std::string("best_step"), std::string("wall_s")}) {
    header.push_back(name);
  }

  std::vector<std::vector<std::string>> cells;
  for (const nlohmann::json& row : rows) {
    std::vector<std::string> line = {figure(row, "index")};
    for (const GridAxis& axis : axes) line.push_back(row["grid"].value(axis.key, ""));
    line.push_back(row.value("status", ""));
    line.push_back(figure(row, "steps"));
    line.push_back(figure(row, "final_loss"));
    line.push_back(figure(row, "final_eval", "test_loss"));
    if (!metric_is_loss) line.push_back(figure(row, "final_eval", metric));
    line.push_back(figure(row, "best"));
    line.push_back(figure(row, "best_step"));
    char wall[32];
    std::snprintf(wall, sizeof wall, "%.1f", row.value("wall_s", 0.0));
    line.push_back(wall);
    cells.push_back(std::move(line));
  }
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& line : cells) width[c] = std::max(width[c], line[c].size());
  }
  auto print_row = [&](const std::vector<std::string>& line) {
    std::string text;
    for (size_t c = 0; c < line.size(); ++c) {
      text += line[c] + std::string(width[c] - line[c].size() + (c + 1 < line.size() ? 2 : 0), ' ');
    }
    print_line(trim(text));
  };
  print_row(header);
  for (const auto& line : cells) print_row(line);
  for (const nlohmann::json& row : rows) {
    if (row.value("status", "") != "ok") {
      print_line("run " + figure(row, "index") + " failed: " + row.value("error", "(no message)"));
    }
  }
}

// Waits for every rank of the world without spinning on a core: the groups end at different
// times, and a finished rank must not slow a group still training on a shared core. No
// timeout: a run may take hours; a group that hangs fails by its own collective timeouts.
void wait_for_every_rank() {
  MPI_Request request;
  check_mpi(MPI_Ibarrier(MPI_COMM_WORLD, &request), "MPI_Ibarrier (the end of the sweep)");
  for (int done = 0;;) {
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test (the end of the sweep)");
    if (done) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Every rank's `text` at world rank 0, in rank order (empty elsewhere).
std::vector<std::string> gather_text(const std::string& text, int world_rank, int world_size) {
  int length = static_cast<int>(text.size());
  std::vector<int> lengths(world_rank == 0 ? world_size : 0);
  check_mpi(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, MPI_COMM_WORLD),
            "MPI_Gather (the sweep's results)");
  std::vector<int> offsets(lengths.size());
  int total = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    offsets[r] = total;
    total += lengths[r];
  }
  std::string all(static_cast<size_t>(total), '\0');
  check_mpi(MPI_Gatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                        MPI_CHAR, 0, MPI_COMM_WORLD),
            "MPI_Gatherv (the sweep's results)");
  std::vector<std::string> parts;
  for (size_t r = 0; r < lengths.size(); ++r) {
    parts.push_back(all.substr(static_cast<size_t>(offsets[r]), static_cast<size_t>(lengths[r])));
  }
  return parts;
}

}  // namespace

GridAxis parse_grid_axis(const std::string& text, const std::string& file) {
  const size_t equals = text.find('=');
  if (equals == std::string::npos) {
    MESHTRAIN_BAD_INPUT("--grid '", text, "' must look like section.key=v1,v2 (e.g. ",
                        "optimizer.lr=0.1,0.01)");
  }
  // The schema's parser names an unknown section or key and lists the known ones.
  GridAxis axis;
  axis.key = override_key_path(text, file);  // 3 parts for a table member
  if (axis.key == "run.output_dir" || axis.key == "checkpoint.dir") {
    MESHTRAIN_BAD_INPUT("--grid '", text, "': the sweep gives each run its own run.output_dir ",
                        "and checkpoint.dir (<run.output_dir>/sweep/<index>-<values>); choose ",
                        "the sweep's folder with --set run.output_dir=DIR");
  }
  axis.values = split_values(text.substr(equals + 1));
  for (const std::string& value : axis.values) {
    if (value.empty()) {
      MESHTRAIN_BAD_INPUT("--grid '", text, "' has an empty value (the values of a key are ",
                          "separated by commas: ", axis.key, "=v1,v2)");
    }
  }
  return axis;
}

std::vector<std::vector<std::string>> grid_points(const std::vector<GridAxis>& axes) {
  std::vector<std::vector<std::string>> points = {{}};
  for (const GridAxis& axis : axes) {
    std::vector<std::vector<std::string>> longer;
    for (const auto& point : points) {
      for (const std::string& value : axis.values) {
        longer.push_back(point);
        longer.back().push_back(axis.key + "=" + value);
      }
    }
    points = std::move(longer);
  }
  return points;
}

int sweep_command(const SweepArgs& args) {
  int world_rank = 0, world_size = 1;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "MPI_Comm_size");
  const int ranks_per_run = args.ranks_per_run > 0 ? args.ranks_per_run : world_size;

  // Everything refusable is refused here, on every rank alike, before any run starts.
  std::vector<GridAxis> axes;
  std::vector<PlannedRun> runs;
  std::string sweep_dir;
  if (auto error = run_agreed(MPI_COMM_WORLD, [&] {
        if (world_size % ranks_per_run != 0) {
          MESHTRAIN_BAD_INPUT("--ranks-per-run ", ranks_per_run, " does not divide the job's ",
                              world_size, " ranks: each run takes a group of ", ranks_per_run,
                              " ranks, so start the job on a multiple of ", ranks_per_run);
        }
        if (args.grid.empty()) {
          MESHTRAIN_BAD_INPUT("meshtrain sweep needs at least one --grid section.key=v1,v2");
        }
        std::set<std::string> keys;
        for (const std::string& text : args.grid) {
          axes.push_back(parse_grid_axis(text, args.config));
          if (!keys.insert(axes.back().key).second) {
            MESHTRAIN_BAD_INPUT("--grid names ", axes.back().key,
                                " twice; give its values once: ", axes.back().key, "=v1,v2,...");
          }
        }
        if (!args.hardware.empty()) {
          set_collective_matmul_hardware(read_hardware_profile(args.hardware));
        }
        const RunConfig base = load_config(args.config, args.overrides);
        require_command_builds(base.model, "meshtrain sweep");
        sweep_dir = base.run.output_dir + "/sweep";
        const std::vector<std::vector<std::string>> points = grid_points(axes);
        const size_t digits = std::to_string(points.size() - 1).size();
        for (size_t i = 0; i < points.size(); ++i) {
          PlannedRun run;
          run.index = static_cast<int64_t>(i);
          std::string index = std::to_string(i);
          index.insert(0, digits - index.size(), '0');
          run.dir = sweep_dir + "/" + index + "-" + folder_label(points[i]);
          std::vector<std::string> overrides = args.overrides;
          for (size_t a = 0; a < axes.size(); ++a) {
            const std::string& value = points[i][a].substr(axes[a].key.size() + 1);
            run.values.emplace_back(axes[a].key, value);
            run.label += (a ? ", " : "") + points[i][a];
            overrides.push_back(points[i][a]);
          }
          overrides.push_back("run.output_dir=" + toml_string_value(run.dir));
          overrides.push_back("checkpoint.dir=" + toml_string_value(run.dir + "/checkpoints"));
          run.config = load_config(args.config, overrides);
          try {
            run.config.mesh.resolve(ranks_per_run);
          } catch (const Error& e) {
            MESHTRAIN_BAD_INPUT("run ", i, " (", run.label, ") on --ranks-per-run ", ranks_per_run,
                                " ranks: ", e.what());
          }
          runs.push_back(std::move(run));
        }
        if (world_rank == 0) {
          std::error_code ec;
          std::filesystem::create_directories(sweep_dir, ec);
          if (ec) {
            MESHTRAIN_BAD_INPUT("cannot create the sweep's folder '", sweep_dir,
                                "': ", ec.message());
          }
        }
      })) {
    return report_agreed_error(*error);  // every rank holds it; no run has started
  }

  // Group g: world ranks [g * ranks_per_run, (g + 1) * ranks_per_run); it trains runs g,
  // g + groups, g + 2 * groups, ... one after another.
  const int groups = world_size / ranks_per_run;
  const int group_index = world_rank / ranks_per_run;
  MPI_Comm group = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, group_index, world_rank, &group),
            "MPI_Comm_split (the sweep's groups)");
  int group_rank = 0;
  check_mpi(MPI_Comm_rank(group, &group_rank), "MPI_Comm_rank");
  const bool leader = group_rank == 0;
  if (world_rank == 0) {
    print_line("meshtrain sweep " + args.config + ": " + std::to_string(runs.size()) + " runs on " +
               std::to_string(groups) + " group" + (groups == 1 ? "" : "s") + " of " +
               std::to_string(ranks_per_run) + " rank" + (ranks_per_run == 1 ? "" : "s") + ", in " +
               sweep_dir + "/");
  }

  std::string rows;  // this group's rows, one JSON line each (on its rank 0)
  int failed_here = 0;
  const std::string total = std::to_string(runs.size());
  for (size_t i = static_cast<size_t>(group_index); i < runs.size();
       i += static_cast<size_t>(groups)) {
    const PlannedRun& run = runs[i];
    const std::string name = "run " + std::to_string(i) + "/" + total + " (" + run.label + ")";
    if (leader) {
      print_line("sweep: " + name + " on " +
                 ranks_text(group_index * ranks_per_run, ranks_per_run) + " -> " + run.dir);
    }
    const nlohmann::json row = train_one(run, group, leader);
    if (!leader) continue;
    rows += row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    char wall[32];
    std::snprintf(wall, sizeof wall, "%.1f s", row.value("wall_s", 0.0));
    if (row.value("status", "") == "ok") {
      print_line("sweep: " + name + " done in " + wall + ": train loss " +
                 figure(row, "final_loss") + ", test loss " +
                 figure(row, "final_eval", "test_loss"));
    } else {
      ++failed_here;
      print_line("sweep: " + name + " failed after " + wall + ": " + row.value("error", ""));
    }
  }
  check_mpi(MPI_Comm_free(&group), "MPI_Comm_free");

  wait_for_every_rank();
  int failed = 0;
  check_mpi(MPI_Allreduce(&failed_here, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce (the sweep's failed runs)");
  const int status = failed > 0 ? 1 : 0;  // some run failed: the table says which and why
  const std::vector<std::string> parts = gather_text(rows, world_rank, world_size);
  if (world_rank != 0) return status;
  std::vector<nlohmann::json> table;
  for (const std::string& part : parts) {
    std::istringstream lines(part);
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty()) table.push_back(nlohmann::json::parse(line));
    }
  }
  std::sort(table.begin(), table.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a["index"].get<int64_t>() < b["index"].get<int64_t>();
  });
  const std::string table_path = sweep_dir + "/sweep.jsonl";
  std::ofstream out(table_path);
  for (const nlohmann::json& row : table) {
    out << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  out.close();
  print_table(table, axes);
  print_line(std::to_string(table.size() - static_cast<size_t>(failed)) + " of " +
             std::to_string(table.size()) + " runs ok; table: " + table_path +
             (out ? "" : " (could not be written)"));
  // An AgreedError escaping a group (none should: train_one keeps a run's) is not caught here:
  // the other groups would wait for this one at the end. run_or_abort ends every rank.
  return status;
}

}  // namespace meshtrain
