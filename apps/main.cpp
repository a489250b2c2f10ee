// The `meshtrain` command (docs/running.md, "The command"). Each subcommand parses its own
// arguments, then calls into the library; this file is the only place that turns a
// meshtrain::Error into an exit status: 2 for bad input, 1 for a failure while running.
//
//   meshtrain plan CONFIG [--world N] [--json] [--hardware FILE] [--set section.key=value ...]
//   mpirun -np N meshtrain train CONFIG [--hardware FILE] [--set ...]
//   mpirun -np N meshtrain calibrate [CONFIG] [--out FILE] [--set ...]
//   meshtrain inspect CHECKPOINT.h5 [--verify]
//   mpirun -np N meshtrain predict CHECKPOINT --input PATH... --output FILE.h5 [--overwrite]
//                                   [--set ...] [--batch-size N] [--flight-dir DIR]
//                                   [--jacobian [--jacobian-mode auto|forward|reverse]]
//   meshtrain export CHECKPOINT --format onnx --output FILE.onnx [--dtype fp32|fp16|bf16]
//                    [--overwrite]
//   meshtrain export CHECKPOINT --format pytorch --output DIR [--overwrite]
//   mpirun -np N meshtrain evaluate CHECKPOINT --data PATH... [--json FILE|-] [--set ...]
//                                    [--flight-dir DIR]
//   mpirun -np N meshtrain sweep CONFIG --grid section.key=v1,v2 ... [--ranks-per-run K]
//                                 [--set ...] [--hardware FILE]

#include <CLI/CLI.hpp>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "apps/calibrate.hpp"
#include "apps/command.hpp"
#include "apps/evaluate.hpp"
#include "apps/export.hpp"
#include "apps/predict.hpp"
#include "apps/sweep.hpp"
#include "apps/train.hpp"
#include "base/error.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/core/version.hpp"
#include "framework/io/checkpoint_report.hpp"
#include "framework/observe/flight_report.hpp"
#include "framework/observe/step_passes.hpp"
#include "framework/observe/trace_report.hpp"
#include "framework/train/config.hpp"
#include "framework/train/hardware_file.hpp"
#include "framework/train/plan_report.hpp"

namespace {

constexpr int kExitBadInput = 2;
constexpr int kExitFailure = 1;

// A rank count: an integer from 1 to INT_MAX.
const CLI::Validator kRankCount(
    [](std::string& text) -> std::string {
      errno = 0;
      char* end = nullptr;
      const long value = std::strtol(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || errno != 0 || value < 1 || value > INT_MAX) {
        return "expected a number of ranks from 1 to " + std::to_string(INT_MAX) + ", got '" +
               text + "'";
      }
      return {};
    },
    "N");

// Adds the repeatable `--set section.key=value` option: one value per --set, so a
// positional argument after it is not swallowed.
void add_set_option(CLI::App& command, std::vector<std::string>& overrides) {
  command
      .add_option("--set", overrides,
                  "Override a config key, e.g. --set train.steps=20 or "
                  "--set 'model.sizes=[784, 256, 10]' (repeatable)")
      ->type_name("SECTION.KEY=VALUE")
      ->allow_extra_args(false)
      ->take_all();
}

// --- plan: how a run's parameters are sharded, without MPI --------------------------------
struct PlanArgs {
  std::string config;
  int world = 1;
  bool json = false;
  std::string hardware;
  std::vector<std::string> overrides;
};

void add_plan_command(CLI::App& app, PlanArgs& args) {
  CLI::App* plan = app.add_subcommand(
      "plan",
      "Show how each parameter of a run is sharded over the mesh, and the bytes per "
      "rank, for any world size (no MPI needed)");
  plan->add_option("config", args.config, "The run's TOML file")->required();
  plan->add_option("--world", args.world, "Number of ranks to plan for (default 1)")
      ->check(kRankCount);
  plan->add_flag("--json", args.json, "Print the plan as one JSON object");
  plan->add_option("--hardware", args.hardware,
                   "Hardware profile (TOML from meshtrain calibrate) for the predicted step "
                   "time; default: the built-in profile (1 CPU core, MPI inside one node)");
  add_set_option(*plan, args.overrides);
}

int run_plan(const PlanArgs& args) {
  const meshtrain::RunConfig config = meshtrain::load_config(args.config, args.overrides);
  std::optional<meshtrain::HardwareProfile> hardware;
  if (!args.hardware.empty()) {
    hardware = meshtrain::read_hardware_profile(args.hardware);
    // The reduce-scatter and all-reduce rates of the algorithm [runtime] reductions picks.
    const meshtrain::ReductionAlgorithm reductions = config.runtime.reductions;
    meshtrain::select_reduction_rates(*hardware, reductions != meshtrain::ReductionAlgorithm::mpi,
                                      reductions != meshtrain::ReductionAlgorithm::ring);
  }
  meshtrain::print_plan(config, args.world, args.json, std::cout, hardware ? &*hardware : nullptr);
  std::cout.flush();
  return std::cout ? 0 : kExitFailure;
}

// --- trace-report: where a traced run's steps spent their time --------------------------
struct TraceReportArgs {
  std::string run_dir;
  std::string hardware;
  bool json = false;
};

void add_trace_report_command(CLI::App& app, TraceReportArgs& args) {
  CLI::App* command = app.add_subcommand(
      "trace-report",
      "Split a traced run's steps into compute, communication (exposed and overlapped), data "
      "wait and idle per rank, and compare its collectives with the cost model; the kernels, "
      "copies and fences per step ([runtime] trace_steps; docs/running.md)");
  command->add_option("run_dir", args.run_dir, "The run's folder (its trace/ holds the files)")
      ->required();
  command->add_option("--hardware", args.hardware,
                      "Hardware profile (meshtrain calibrate) for the prediction; default: the "
                      "built-in profile");
  command->add_flag("--json", args.json, "Print the report as one JSON object");
}

int run_trace_report(const TraceReportArgs& args) {
  const std::string dir = args.run_dir + "/trace";
  const std::vector<meshtrain::RankTrace> ranks = meshtrain::read_trace_dir(dir);
  // The prediction for the traced config (trace/config.toml) on as many ranks as traced.
  std::optional<meshtrain::StepCost> cost;
  const std::string config_path = dir + "/config.toml";
  if (std::filesystem::exists(config_path)) {
    const meshtrain::RunConfig config = meshtrain::load_config(config_path, {});
    meshtrain::HardwareProfile hardware = meshtrain::default_hardware_profile();
    if (!args.hardware.empty()) {
      hardware = meshtrain::read_hardware_profile(args.hardware);
      const meshtrain::ReductionAlgorithm reductions = config.runtime.reductions;
      meshtrain::select_reduction_rates(hardware, reductions != meshtrain::ReductionAlgorithm::mpi,
                                        reductions != meshtrain::ReductionAlgorithm::ring);
    }
    cost = meshtrain::predict_run_step(config, static_cast<int>(ranks.size()), hardware);
  }
  const meshtrain::TraceReport report = meshtrain::summarize_trace(ranks, cost ? &*cost : nullptr);
  // Kernels, copies and fences per step (trace/passes.json; absent in older traces).
  const std::optional<meshtrain::TracedPasses> passes = meshtrain::read_traced_passes(dir);
  if (args.json) {
    nlohmann::ordered_json doc = meshtrain::trace_report_json(report);
    if (passes) doc["passes"] = meshtrain::traced_passes_json(*passes);
    std::cout << doc.dump(2) << "\n";
  } else {
    meshtrain::print_trace_report(report, std::cout);
    if (passes) meshtrain::print_traced_passes(*passes, std::cout);
  }
  std::cout.flush();
  return std::cout ? 0 : kExitFailure;
}

// --- flight-report: which ranks never entered the collective a run stopped in ----------
struct FlightReportArgs {
  std::string run_dir;
};

void add_flight_report_command(CLI::App& app, FlightReportArgs& args) {
  CLI::App* command = app.add_subcommand(
      "flight-report",
      "Compare the ranks' flight records of a run that hung or failed, name the first "
      "collective some rank never entered and the rank at the root of the wait "
      "([runtime] flight_records; docs/running.md)");
  command->add_option("run_dir", args.run_dir, "The run's folder (its flight/ holds the files)")
      ->required();
}

int run_flight_report(const FlightReportArgs& args) {
  const std::string dir = args.run_dir + "/flight";
  const std::vector<meshtrain::FlightRecordFile> records = meshtrain::read_flight_records(dir);
  if (records.empty()) {
    MESHTRAIN_BAD_INPUT("'", dir, "' holds no flight records (rank-<k>.json): a run writes them ",
                        "on a timeout, a failure, SIGUSR1 or SIGTERM while [runtime] ",
                        "flight_records > 0");
  }
  std::cout << records.size() << " flight record" << (records.size() == 1 ? "" : "s") << " in "
            << dir << "/";
  for (std::size_t k = 0; k < records.size(); ++k) {
    std::cout << (k == 0 ? " (" : ", ") << "rank " << records[k].rank << ": " << records[k].reason
              << (k + 1 == records.size() ? ")" : "");
  }
  std::cout << "\n";
  const std::vector<meshtrain::FlightFinding> findings = meshtrain::find_stuck_collectives(records);
  if (findings.empty()) std::cout << "every group's last collective completed on every rank\n";
  for (const meshtrain::FlightFinding& finding : findings) std::cout << finding.sentence() << "\n";
  // Then where the wait chain ends: the rank at its root, or a cycle.
  const std::string roots = meshtrain::find_hang_roots(records).sentence();
  if (!roots.empty()) std::cout << roots << "\n";
  std::cout.flush();
  return std::cout ? 0 : kExitFailure;
}

// --- train: runs under mpirun; MPI is initialized for this subcommand only -------------
struct TrainArgs {
  std::string config;
  std::string hardware;
  std::vector<std::string> overrides;
};

void add_train_command(CLI::App& app, TrainArgs& args) {
  CLI::App* train = app.add_subcommand(
      "train",
      "Train the run's MLP on the mesh of the MPI world (mpirun -np N meshtrain train ...)");
  train->add_option("config", args.config, "The run's TOML file")->required();
  train->add_option("--hardware", args.hardware,
                    "Hardware profile (meshtrain calibrate) that collective_matmul = auto "
                    "and reductions = auto choose with");
  add_set_option(*train, args.overrides);
}

// Errors on some ranks only end every rank (no rank is left waiting in a collective);
// errors every rank agreed on are printed once by train_command itself.
int run_train(const TrainArgs& args, int& argc, char**& argv) {
  return meshtrain::run_mpi_command(argc, argv, [&] {
    return meshtrain::train_command(args.config, args.overrides, args.hardware);
  });
}

// --- sweep: a grid of runs on groups of ranks of one MPI job -----------------------------
void add_sweep_command(CLI::App& app, meshtrain::SweepArgs& args) {
  CLI::App* sweep = app.add_subcommand(
      "sweep",
      "Train every combination of the --grid values, side by side on groups of "
      "--ranks-per-run ranks of the job, each run in <run.output_dir>/sweep/<index>-<values>/, "
      "and print a table of their metrics (docs/sweeps.md)");
  sweep->add_option("config", args.config, "The runs' TOML file")->required();
  sweep
      ->add_option("--grid", args.grid,
                   "A config key and its values, e.g. --grid optimizer.lr=0.1,0.01 (repeatable: "
                   "every combination runs, the first key varying slowest)")
      ->type_name("SECTION.KEY=V1,V2")
      ->allow_extra_args(false)
      ->take_all()
      ->required();
  sweep
      ->add_option("--ranks-per-run", args.ranks_per_run,
                   "Ranks of each run (default: every rank of the job, the runs one after "
                   "another); the job's ranks must be a multiple")
      ->check(kRankCount);
  sweep->add_option("--hardware", args.hardware,
                    "Hardware profile (meshtrain calibrate) that collective_matmul = auto and "
                    "reductions = auto choose with");
  add_set_option(*sweep, args.overrides);
}

int run_sweep(const meshtrain::SweepArgs& args, int& argc, char**& argv) {
  return meshtrain::run_mpi_command(argc, argv, [&] { return meshtrain::sweep_command(args); });
}

// --- calibrate: measures a hardware profile under mpirun -----------------------------------
struct CalibrateArgs {
  std::string config;
  std::string out;
  std::string clock = "wall";
  std::vector<std::string> overrides;
};

void add_calibrate_command(CLI::App& app, CalibrateArgs& args) {
  CLI::App* calibrate = app.add_subcommand(
      "calibrate",
      "Measure this job's hardware profile (sgemm, a memory pass, ping-pong and all-reduce "
      "per mesh axis) as TOML for plan --hardware (mpirun -np N meshtrain calibrate ...)");
  calibrate->add_option("config", args.config,
                        "A run's TOML file: its mesh for N ranks (default: dp = N)");
  calibrate->add_option("--out", args.out, "Write the profile here (default: standard output)");
  calibrate->add_option("--clock", args.clock,
                        "wall (default) | cpu: time in process CPU time, the idle machine's "
                        "profile where other jobs share the cores");
  add_set_option(*calibrate, args.overrides);
}

int run_calibrate(const CalibrateArgs& args, int& argc, char**& argv) {
  return meshtrain::run_mpi_command(argc, argv, [&] {
    try {
      return meshtrain::calibrate_command(args.config, args.overrides, args.out, args.clock);
    } catch (const meshtrain::AgreedError& error) {
      return meshtrain::report_agreed_error(error);  // every rank holds it: printed once
    }
  });
}

// --flight-dir DIR of predict and evaluate: where their flight records go (none without it;
// never the training run's folder that the checkpoint's config names).
void add_flight_dir_option(CLI::App& command, std::string& dir) {
  command
      .add_option("--flight-dir", dir,
                  "Write flight records (runtime.flight_records) to DIR/flight/, for "
                  "meshtrain flight-report DIR; default: none")
      ->type_name("DIR");
}

// --- predict: a checkpoint's model over HDF5 inputs, under mpirun ------------------------
void add_predict_command(CLI::App& app, meshtrain::PredictOptions& args) {
  CLI::App* predict = app.add_subcommand(
      "predict",
      "Run a checkpoint's model on HDF5 inputs and write its predictions to one HDF5 file "
      "(mpirun -np N meshtrain predict ...)");
  predict
      ->add_option("checkpoint", args.checkpoint,
                   "A checkpoint file, a latest or best pointer file, or a checkpoint directory "
                   "(its latest)")
      ->required();
  predict
      ->add_option("--input", args.inputs,
                   "HDF5 input files or globs, read in this order (dataset: the checkpoint's "
                   "data.x_key)")
      ->required()
      ->take_all();
  predict->add_option("--output", args.output, "The HDF5 file to write (FILE.h5)")->required();
  predict->add_flag("--overwrite", args.overwrite, "Replace the output when it exists");
  predict
      ->add_option("--batch-size", args.batch_size,
                   "Global rows per batch (default: the checkpoint's data.eval_batch_size, "
                   "else data.batch_size)")
      ->check(CLI::PositiveNumber);
  CLI::Option* jacobian = predict->add_flag(
      "--jacobian", args.jacobian,
      "Also write /jacobian [N, outputs, inputs]: each row's derivatives of the outputs by the "
      "inputs, in the user's units (docs/derivatives.md)");
  predict
      ->add_option("--jacobian-mode", args.jacobian_mode,
                   "auto (default: forward when inputs <= outputs, else reverse), forward "
                   "(tangents of the inputs) or reverse (one gradient pass per output)")
      ->type_name("MODE")
      ->needs(jacobian);
  add_flight_dir_option(*predict, args.flight_dir);
  add_set_option(*predict, args.overrides);
}

int run_predict(const meshtrain::PredictOptions& args, int& argc, char**& argv) {
  return meshtrain::run_mpi_command(argc, argv, [&] { return meshtrain::predict_command(args); });
}

// --- evaluate: a checkpoint's metrics on labelled data, under mpirun ---------------------
void add_evaluate_command(CLI::App& app, meshtrain::EvaluateArgs& args) {
  CLI::App* evaluate = app.add_subcommand(
      "evaluate",
      "Evaluate a checkpoint on labelled HDF5 data: loss, accuracy (top-5, per class) or "
      "MSE / MAE / R^2 per output (mpirun -np N meshtrain evaluate CHECKPOINT --data ...)");
  evaluate
      ->add_option("checkpoint", args.checkpoint,
                   "A checkpoint file, a latest/best pointer file, or a checkpoint directory "
                   "(its latest)")
      ->required();
  evaluate
      ->add_option("--data", args.data,
                   "HDF5 files or globs with inputs and labels or targets (data.x_key, "
                   "data.y_key; the shards form one data set in this order)")
      ->required();
  evaluate->add_option("--json", args.json,
                       "Also write the metrics as one JSON object to FILE ('-': standard "
                       "output, the report then goes to standard error)");
  add_flight_dir_option(*evaluate, args.flight_dir);
  evaluate
      ->add_option("--set", args.overrides,
                   "Override a key that leaves the model alone: " +
                       meshtrain::overridable_keys(meshtrain::ConfigCommand::evaluate) +
                       " (repeatable)")
      ->type_name("SECTION.KEY=VALUE")
      ->allow_extra_args(false)
      ->take_all();
}

int run_evaluate(const meshtrain::EvaluateArgs& args, int& argc, char**& argv) {
  return meshtrain::run_mpi_command(argc, argv, [&] { return meshtrain::evaluate_command(args); });
}

// --- inspect: a checkpoint's step, mesh, config and datasets (no MPI launch needed) ----
struct InspectArgs {
  std::string checkpoint;
  bool verify = false;
};

void add_inspect_command(CLI::App& app, InspectArgs& args) {
  CLI::App* inspect = app.add_subcommand(
      "inspect", "Show a checkpoint's step, mesh, config and datasets (shapes, dtypes, specs)");
  inspect->add_option("checkpoint", args.checkpoint, "A checkpoint file (ckpt-*.h5)")->required();
  inspect->add_flag("--verify", args.verify, "Read every dataset and check its checksum");
}

// --- export: a checkpoint as an ONNX model or a PyTorch module (no MPI launch needed)
// -------------------------
void add_export_command(CLI::App& app, meshtrain::ExportArgs& args) {
  CLI::App* command = app.add_subcommand(
      "export",
      "Write a checkpoint's model as a self-contained ONNX file or a PyTorch module "
      "(docs/export.md)");
  command
      ->add_option("checkpoint", args.checkpoint,
                   "A checkpoint file, a latest or best pointer file, or a checkpoint "
                   "directory (its latest)")
      ->required();
  command->add_option("--format", args.format, "The format to write: onnx or pytorch")->required();
  command
      ->add_option("--output", args.output,
                   "The file to write (onnx: FILE.onnx), or the folder (pytorch: DIR/model.py "
                   "and DIR/model.safetensors)")
      ->required();
  command->add_option("--dtype", args.dtype,
                      "How the weights are stored: fp32 (default), fp16 or bf16 (onnx only: "
                      "cast to float32 inside the graph)");
  command->add_flag("--overwrite", args.overwrite, "Replace the output if it exists");
}

bool verbose() {
  const char* value = std::getenv("MESHTRAIN_VERBOSE");
  return value && *value && std::string(value) != "0";
}

int report(const meshtrain::Error& e) {
  std::cerr << "meshtrain: error: " << e.what() << "\n";
  if (verbose()) std::cerr << "meshtrain: thrown at " << e.where() << "\n";
  return e.kind() == meshtrain::ErrorKind::bad_input ? kExitBadInput : kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtrain: train MLPs sharded over a device mesh by partition rules", "meshtrain"};
  app.set_version_flag("--version", std::string("meshtrain ") + meshtrain::framework_version());
  app.require_subcommand(1);
  // CLI11's own errors (unknown option, missing argument) as one line, exit status 2.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("meshtrain: error: ") + e.what() + " (see meshtrain --help)\n";
  });

  PlanArgs plan_args;
  add_plan_command(app, plan_args);
  TraceReportArgs trace_report_args;
  add_trace_report_command(app, trace_report_args);
  FlightReportArgs flight_report_args;
  add_flight_report_command(app, flight_report_args);
  TrainArgs train_args;
  add_train_command(app, train_args);
  InspectArgs inspect_args;
  add_inspect_command(app, inspect_args);
  CalibrateArgs calibrate_args;
  add_calibrate_command(app, calibrate_args);
  meshtrain::PredictOptions predict_args;
  add_predict_command(app, predict_args);
  meshtrain::ExportArgs export_args;
  add_export_command(app, export_args);
  meshtrain::EvaluateArgs evaluate_args;
  add_evaluate_command(app, evaluate_args);
  meshtrain::SweepArgs sweep_args;
  add_sweep_command(app, sweep_args);

  // A first word that is no subcommand (a typo, or a command of a newer meshtrain): CLI11
  // would only say that a subcommand is required. Name the word and list the commands.
  std::string commands;
  bool known = false;
  for (const CLI::App* command : app.get_subcommands({})) {
    commands += (commands.empty() ? "" : ", ") + command->get_name();
    known = known || (argc > 1 && command->get_name() == argv[1]);
  }
  if (argc > 1 && argv[1][0] != '-' && !known) {
    std::cerr << "meshtrain: error: unknown command '" << argv[1] << "'; the commands are "
              << commands << " (see meshtrain --help)\n";
    return kExitBadInput;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int status = app.exit(e);  // prints help, the version or the error
    return status == 0 ? 0 : kExitBadInput;
  }

  try {
    if (app.got_subcommand("plan")) return run_plan(plan_args);
    if (app.got_subcommand("trace-report")) return run_trace_report(trace_report_args);
    if (app.got_subcommand("flight-report")) return run_flight_report(flight_report_args);
    if (app.got_subcommand("train")) return run_train(train_args, argc, argv);
    if (app.got_subcommand("calibrate")) return run_calibrate(calibrate_args, argc, argv);
    if (app.got_subcommand("predict")) return run_predict(predict_args, argc, argv);
    if (app.got_subcommand("export")) return meshtrain::export_command(export_args, std::cout);
    if (app.got_subcommand("evaluate")) return run_evaluate(evaluate_args, argc, argv);
    if (app.got_subcommand("sweep")) return run_sweep(sweep_args, argc, argv);
    if (app.got_subcommand("inspect")) {
      return meshtrain::print_checkpoint(inspect_args.checkpoint, inspect_args.verify, std::cout);
    }
  } catch (const meshtrain::Error& e) {
    return report(e);
  } catch (const std::exception& e) {
    std::cerr << "meshtrain: error: unexpected failure: " << e.what() << "\n";
    return kExitFailure;
  }
  return kExitBadInput;  // unreachable: require_subcommand(1) accepted no other command
}
