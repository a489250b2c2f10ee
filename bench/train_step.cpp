// Training-step benchmark: a TrainingRun (run/training_run.hpp, what `meshtrain train`
// runs: Mlp, cross-entropy Loss, AdamW) timed over full steps (forward, loss, backward,
// optimizer step; TrainingRun::step_on_loaded_batch) on a mesh made from the world size. Prints ONE
// JSON line on rank 0 with the step time, the throughput and how it compares with a roofline made
// of rank 0's single-thread sgemm rate.
//
//   OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/bin/bench_train_step \
//       --sizes 784,4096,4096,10 --batch 256 --mode fsdp --steps 10 --warmup 2
//
// Modes and their meshes (N ranks): dp -> dp=N, fsdp -> fsdp=N, tp -> tp=N,
// fsdp_tp -> fsdp=N/2 x tp=2, dp_tp -> dp=N/2 x tp=2, dp_fsdp -> dp=N/2 x fsdp=2; the
// partition preset of the same name, min_sharding_size 0 (every tensor that divides is
// sharded). zero1 -> dp=N with the dp preset and optimizer.zero_stage = 1 (ZeRO-1).
// ep -> ep=N with the dp preset (MoE models: --moe-layers 1 --experts 8 --top-k 2; the
// experts split over ep, everything else replicated); with MoE layers the other modes add
// ep=1 (experts replicated: each rank computes every expert its rows choose).
//
// The data is one global batch made in code (random inputs, labels row % classes, the same
// rows on every mesh), loaded once before timing: data loading is not measured. Each timed step is
// bracketed by MPI_Barrier, so a step's time is the slowest rank's. The JSON line also counts the
// Kokkos allocations and C++ heap allocations (operator new) made inside the timed steps:
// both should be 0 (--trace-allocations N prints where the first N heap ones come from).
//
//   flops_per_step          6 * batch * sum(in * out)   (forward 2, backward 4; an MoE
//                           layer counts its router and top_k experts: what a row uses)
//   roofline_samples_per_s  ranks * sgemm_gflops * 1e9 / (flops_per_step / batch)
//   ratio                   samples_per_s / roofline_samples_per_s
//   ratio_cpu               the same from CPU times (step: the largest rank's; sgemm: rank
//                           0's), which sharing the cores with other processes does not
//                           inflate; on an idle machine it is close to `ratio`

#include <execinfo.h>
#include <mpi.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "framework/comm/exit_policy.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/tensor_values.hpp"
#include "framework/train/hardware_file.hpp"
#include "partition/cost_model.hpp"
#include "run/training_run.hpp"

// --- Heap allocation counter: counts operator new while `g_count_heap` is set, and prints
// the call stacks of the first `g_trace_left` of them (--trace-allocations). -------------
namespace {
std::atomic<bool> g_count_heap{false};
std::atomic<int64_t> g_heap_allocations{0};
std::atomic<int> g_trace_left{0};
thread_local bool t_tracing = false;

void trace_allocation(std::size_t bytes) {
  if (t_tracing || g_trace_left.load() <= 0) return;
  t_tracing = true;
  --g_trace_left;
  void* frames[24];
  const int depth = backtrace(frames, 24);
  std::fprintf(stderr, "heap allocation of %zu bytes inside a timed step:\n", bytes);
  backtrace_symbols_fd(frames, depth, 2);
  t_tracing = false;
}

// The body of operator new, in a plain host function: nvcc compiles a replaced global
// operator new for the device too, where a throw does not compile.
void* counted_allocate(std::size_t bytes) {
  if (g_count_heap.load(std::memory_order_relaxed)) {
    ++g_heap_allocations;
    trace_allocation(bytes);
  }
  if (void* p = std::malloc(bytes ? bytes : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t bytes) {
  return counted_allocate(bytes);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

namespace {

using meshtrain::Matrix;
using meshtrain::Mesh;

int64_t g_kokkos_allocations = 0;
bool g_trace_kokkos = false;
void count_kokkos_allocation(const Kokkos::Profiling::SpaceHandle, const char* label, const void*,
                             const uint64_t bytes) {
  ++g_kokkos_allocations;
  if (g_trace_kokkos) {
    std::fprintf(stderr, "Kokkos allocation '%s' of %llu bytes inside a timed step\n", label,
                 static_cast<unsigned long long>(bytes));
  }
}

std::vector<int64_t> parse_sizes(const std::string& text) {
  std::vector<int64_t> sizes;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long long value = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || value < 1) {
      MESHTRAIN_BAD_INPUT("--sizes '", text, "': '", item, "' is not a positive integer");
    }
    sizes.push_back(value);
  }
  if (sizes.size() < 2) MESHTRAIN_BAD_INPUT("--sizes '", text, "' needs at least two sizes");
  return sizes;
}

// The mesh axes of a mode for `world` ranks (the pairs of the combined modes are neighbours).
std::vector<std::pair<std::string, int>> axes_for_mode(const std::string& mode, int world) {
  std::vector<std::pair<std::string, int>> axes;
  if (mode == "dp" || mode == "fsdp" || mode == "tp") {
    axes = {{mode, world}};
  } else if (mode == "ep") {
    axes = {{"dp", 1}, {"ep", world}};
  } else if (mode == "zero1") {
    axes = {{"dp", world}};
  } else if (mode == "fsdp_tp") {
    axes = {{"fsdp", -1}, {"tp", 2}};
  } else if (mode == "dp_tp") {
    axes = {{"dp", -1}, {"tp", 2}};
  } else if (mode == "dp_fsdp") {
    axes = {{"dp", -1}, {"fsdp", 2}};
  } else {
    MESHTRAIN_BAD_INPUT("--mode '", mode,
                        "' is not one of dp, fsdp, tp, fsdp_tp, dp_tp, dp_fsdp, zero1, ep");
  }
  return axes;
}

// One global batch of `batch` rows: inputs uniform in [0, 1) from (seed, row), labels
// row % classes; the same rows on every mesh.
meshtrain::Dataset one_batch(int64_t batch, int64_t features, int64_t classes, uint64_t seed) {
  meshtrain::Dataset data;
  data.description = "the benchmark's batch";
  data.num_samples = batch;
  data.features = features;
  data.num_classes = classes;
  data.inputs.resize(static_cast<size_t>(batch * features));
  data.labels.resize(static_cast<size_t>(batch));
  for (int64_t r = 0; r < batch; ++r) {
    std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(r));
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (int64_t f = 0; f < features; ++f) data.inputs[r * features + f] = uniform(rng);
    data.labels[r] = static_cast<int32_t>(r % classes);
  }
  return data;
}

int64_t local_bytes(const std::vector<meshtrain::ShardedTensor>& tensors) {
  int64_t bytes = 0;
  // As stored (2 bytes an element for a 16-bit storage: a gradient Mlp::store_gradients_16bit
  // keeps in 16 bits).
  for (const auto& t : tensors) bytes += meshtrain::held_elements(t) * t.element_bytes();
  return bytes;
}

int64_t max_over_ranks(int64_t value) {
  long long in = value, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Single-thread sgemm rate of C [m, n] = A [m, k] B [k, n] on this rank (GFLOP/s, median
// of `repeats` after one warm-up call).
// CPU time of this process (all its threads) in seconds.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Rate {
  double wall = 0.0;  // GFLOP/s over wall-clock time
  double cpu = 0.0;   // GFLOP/s over this process's CPU time (insensitive to time-sharing)
};

Rate sgemm_gflops(int64_t m, int64_t k, int64_t n, int repeats) {
  Matrix a("meshtrain::bench_a", m, k), b("meshtrain::bench_b", k, n),
      c("meshtrain::bench_c", m, n);
  Kokkos::deep_copy(a, 0.5f);
  Kokkos::deep_copy(b, 0.25f);
  meshtrain::gemm(meshtrain::plain(a), meshtrain::plain(b), 0.0f, c);
  std::vector<double> times, cpu_times;
  for (int r = 0; r < repeats; ++r) {
    const double start = MPI_Wtime(), cpu_start = process_cpu_seconds();
    meshtrain::gemm(meshtrain::plain(a), meshtrain::plain(b), 0.0f, c);
    Kokkos::fence();
    times.push_back(MPI_Wtime() - start);
    cpu_times.push_back(process_cpu_seconds() - cpu_start);
  }
  const double flops = 2.0 * m * k * n;
  return {flops / median(times) * 1e-9, flops / median(cpu_times) * 1e-9};
}

// A field of /proc/self/status in bytes: "VmRSS:" (resident now) or "VmHWM:" (peak so
// far); 0 if unknown.
int64_t proc_status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t length = std::string(field).size();
  while (std::getline(in, line)) {
    if (line.compare(0, length, field) == 0) return std::atoll(line.c_str() + length) * 1024;
  }
  return 0;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

}  // namespace

int main(int argc, char** argv) {
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    CLI::App app{"Timed training steps of the meshtrain MLP (one JSON line on rank 0)"};
    std::string sizes_text = "784,4096,4096,10", mode = "dp", algorithm = "auto";
    std::string backend = "auto", precision = "fp32", reductions = "auto";
    int64_t batch = 256;
    int steps = 10, warmup = 2, sgemm_size = 2048, sgemm_repeats = 3;
    uint64_t seed = 0;
    app.add_option("--sizes", sizes_text, "model.sizes, comma-separated (in, hidden..., out)");
    app.add_option("--batch", batch, "global batch size");
    app.add_option("--mode", mode, "dp|fsdp|tp|fsdp_tp|dp_tp|dp_fsdp|zero1|ep");
    std::string moe_layers_text;
    int64_t experts = 8, top_k = 2;
    app.add_option("--moe-layers", moe_layers_text, "model.moe_layers, comma-separated (none)");
    app.add_option("--experts", experts, "model.experts")->check(CLI::PositiveNumber);
    app.add_option("--top-k", top_k, "model.top_k")->check(CLI::PositiveNumber);
    std::string residual_text, norm = "rmsnorm", activation = "swiglu";
    app.add_option("--residual", residual_text,
                   "a residual_mlp instead: WIDTH,HIDDEN,DEPTH (inputs and outputs: the first "
                   "and last of --sizes)");
    app.add_option("--norm", norm, "residual_mlp model.norm: rmsnorm|layernorm|none");
    app.add_option("--activation", activation, "residual_mlp model.activation (swiglu, relu, ...)");
    app.add_option("--steps", steps, "timed steps (median reported)")->check(CLI::PositiveNumber);
    app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
    app.add_option("--algorithm", algorithm, "collective matmul: naive|ring|bidirectional|auto");
    app.add_option("--sgemm-size", sgemm_size, "edge of the square reference sgemm")
        ->check(CLI::PositiveNumber);
    app.add_option("--seed", seed, "weights and inputs");
    app.add_option("--backend", backend, "runtime.backend: auto|mpi|nccl");
    app.add_option("--reductions", reductions, "runtime.reductions: auto|mpi|ring");
    app.add_option("--precision", precision, "runtime.matmul_precision: fp32|tf32");
    std::string hardware;
    app.add_option("--hardware", hardware,
                   "hardware profile (meshtrain calibrate): auto's choices and the predicted "
                   "step time (default: the built-in defaults)");
    std::string hardware_cpu;
    app.add_option("--hardware-cpu", hardware_cpu,
                   "a second profile measured with calibrate --clock cpu: predicted_cpu_s, "
                   "to compare with the step's CPU time");
    bool overlap = false;
    app.add_option("--overlap", overlap,
                   "runtime.overlap: 0|1 (FSDP weight prefetch, DP gradient buckets)");
    std::string comm_thread = "auto";
    app.add_option("--comm-thread", comm_thread, "runtime.comm_thread: auto|0|1");
    double bucket_mb = 25.0;
    app.add_option("--bucket-mb", bucket_mb, "runtime.bucket_mb: DP gradient bucket cap (MiB)");
    std::string param_dtype = "fp32", reduce_dtype = "fp32";
    app.add_option("--param-dtype", param_dtype, "mixed_precision.param_dtype: fp32|bf16|fp16");
    app.add_option("--reduce-dtype", reduce_dtype, "mixed_precision.reduce_dtype: fp32|bf16|fp16");
    int trace_allocations = 0;
    app.add_option("--trace-allocations", trace_allocations,
                   "print the call stacks of the first N heap allocations in timed steps "
                   "(rank 0)");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (runtime->world_rank() == 0) app.exit(e);
      return e.get_exit_code() == 0 ? 0 : 2;
    }
    const int rank = runtime->world_rank();
    const int world = runtime->world_size();
    const std::string load_at_start = load_average();
    // The largest rank's resident set and peak resident set after each setup stage.
    nlohmann::json rss_stages;
    auto note_rss = [&](const char* stage) {
      rss_stages[stage] = {{"rss", max_over_ranks(proc_status_bytes("VmRSS:"))},
                           {"peak", max_over_ranks(proc_status_bytes("VmHWM:"))}};
    };
    note_rss("start");

    // --- The run: mesh, plan, model, loss and AdamW (the config defaults). ---------------
    const std::vector<int64_t> sizes = parse_sizes(sizes_text);
    meshtrain::RunConfig config;
    config.file = "bench_train_step";
    config.run.seed = seed;
    config.run.output_dir = "/tmp/meshtrain-bench-train-step";  // nothing is written
    config.mesh.axes = axes_for_mode(mode, world);
    if (!moe_layers_text.empty()) {
      std::stringstream in(moe_layers_text);
      for (std::string item; std::getline(in, item, ',');) {
        config.model.moe_layers.push_back(std::stoll(item));
      }
      config.model.experts = experts;
      config.model.top_k = top_k;
      if (mode != "ep") config.mesh.axes.push_back({"ep", 1});
    }
    config.mesh.source = "--mode " + mode;
    config.model.sizes = sizes;
    const std::vector<int64_t> residual =
        residual_text.empty() ? std::vector<int64_t>{} : parse_sizes(residual_text);
    if (!residual.empty()) {  // residual_mlp inputs -> width, depth blocks, -> outputs
      if (residual.size() != 3) MESHTRAIN_BAD_INPUT("--residual needs WIDTH,HIDDEN,DEPTH");
      config.model.kind = meshtrain::ModelKind::residual_mlp;
      config.model.sizes.clear();
      config.model.inputs = sizes.front();
      config.model.outputs = sizes.back();
      config.model.width = residual[0];
      config.model.hidden = residual[1];
      config.model.depth = residual[2];
      config.model.norm = norm == "none"        ? meshtrain::ModelNorm::none
                          : norm == "layernorm" ? meshtrain::ModelNorm::layernorm
                                                : meshtrain::ModelNorm::rmsnorm;
      if (norm != "none" && norm != "layernorm" && norm != "rmsnorm") {
        MESHTRAIN_BAD_INPUT("--norm '", norm, "' must be rmsnorm, layernorm or none");
      }
      config.model.swiglu = activation == "swiglu";
      config.model.activation = config.model.swiglu
                                    ? meshtrain::Activation::silu
                                    : meshtrain::parse_activation(activation, "--activation");
    }
    config.model.loss = meshtrain::LossKind::cross_entropy;
    config.partition.preset = mode == "zero1" || mode == "ep" ? "dp" : mode;
    config.optimizer.zero_stage = mode == "zero1" ? 1 : 0;
    config.partition.min_sharding_size = 0;  // every tensor that divides is sharded
    config.partition.collective_matmul =
        meshtrain::parse_collective_matmul_algorithm(algorithm, "--algorithm");
    config.data.batch_size = batch;
    config.data.shuffle = meshtrain::ShuffleMode::none;
    config.train.steps = warmup + steps;
    config.runtime.backend = meshtrain::parse_comm_backend(backend, "--backend");
    config.runtime.matmul_precision = meshtrain::parse_matmul_precision(precision, "--precision");
    const meshtrain::HardwareProfile profile = hardware.empty()
                                                   ? meshtrain::default_hardware_profile()
                                                   : meshtrain::read_hardware_profile(hardware);
    meshtrain::set_collective_matmul_hardware(profile);
    config.runtime.overlap = overlap;
    config.runtime.reductions = meshtrain::parse_reduction_algorithm(reductions, "--reductions");
    config.runtime.bucket_mb = bucket_mb;
    if (comm_thread == "auto") {
      config.runtime.comm_thread = meshtrain::CommThreadChoice::automatic;
    } else if (comm_thread == "0" || comm_thread == "1") {
      config.runtime.comm_thread =
          comm_thread == "1" ? meshtrain::CommThreadChoice::on : meshtrain::CommThreadChoice::off;
    } else {
      MESHTRAIN_BAD_INPUT("--comm-thread '", comm_thread, "' must be auto, 0 or 1");
    }
    config.mixed_precision.param_dtype = meshtrain::parse_dtype(param_dtype, "--param-dtype");
    config.mixed_precision.reduce_dtype = meshtrain::parse_dtype(reduce_dtype, "--reduce-dtype");
    meshtrain::RunData data;
    data.train = one_batch(batch, sizes.front(), sizes.back(), seed);
    meshtrain::TrainingRun run(config, {}, std::move(data));
    meshtrain::Mlp& model = run.model();
    meshtrain::Optimizer& optimizer = run.optimizer();
    const meshtrain::ShardingPlan& plan = run.plan();
    const Mesh& mesh = run.mesh();
    const meshtrain::BatchSlice& slice = run.batch_slice();
    note_rss("run_built");
    run.load_batch(0);

    double first_loss = 0.0;
    auto step = [&] { return run.step_on_loaded_batch().loss; };

    // --- Steps: warm-up, then timed (allocations counted inside the timed ones). --------
    for (int s = 0; s < warmup; ++s) {
      const double l = step();
      if (s == 0) first_loss = l;
    }
    note_rss("after_warmup");
    std::vector<double> times, cpu_times;  // per step: wall, the largest rank's CPU time
    double last_loss = 0.0;
    g_kokkos_allocations = 0;
    g_heap_allocations = 0;
    if (rank == 0) g_trace_left = trace_allocations;
    g_trace_kokkos = rank == 0 && trace_allocations > 0;
    for (int s = 0; s < steps; ++s) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime(), cpu_start = process_cpu_seconds();
      Kokkos::Tools::Experimental::set_allocate_data_callback(count_kokkos_allocation);
      g_count_heap = true;
      last_loss = step();
      Kokkos::fence();
      g_count_heap = false;
      Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
      double cpu = process_cpu_seconds() - cpu_start;
      MPI_Barrier(MPI_COMM_WORLD);
      times.push_back(MPI_Wtime() - start);
      MPI_Allreduce(MPI_IN_PLACE, &cpu, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      cpu_times.push_back(cpu);
      if (warmup == 0 && s == 0) first_loss = last_loss;
    }
    note_rss("after_timed_steps");
    const int64_t kokkos_allocations = max_over_ranks(g_kokkos_allocations);
    const int64_t heap_allocations = max_over_ranks(g_heap_allocations);
    const double step_time = median(times);
    const double step_cpu_time = median(cpu_times);

    // --- Memory: peak RSS and the model's own bytes (max over ranks). ------------------
    int64_t state_bytes = 0;
    for (const std::string& slot : optimizer.slot_names()) {
      state_bytes += local_bytes(optimizer.slot(slot));
    }
    const int64_t param_bytes = max_over_ranks(local_bytes(model.parameters()));
    const int64_t grad_bytes = max_over_ranks(local_bytes(model.gradients()));
    const int64_t opt_bytes = max_over_ranks(state_bytes);
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    const int64_t peak_rss = max_over_ranks(static_cast<int64_t>(usage.ru_maxrss) * 1024);

    // --- The roofline: rank 0's single-thread sgemm (the others wait). ----------------
    Rate sgemm, layer_sgemm;
    int64_t widest = 0;  // the layer with the most multiply-adds, at the full batch
    for (size_t i = 0; i + 1 < sizes.size(); ++i) {
      if (sizes[i] * sizes[i + 1] > sizes[widest] * sizes[widest + 1]) widest = i;
    }
    if (rank == 0) {
      sgemm = sgemm_gflops(sgemm_size, sgemm_size, sgemm_size, sgemm_repeats);
      layer_sgemm = sgemm_gflops(batch, sizes[widest], sizes[widest + 1], sgemm_repeats);
    }
    MPI_Barrier(MPI_COMM_WORLD);

    if (rank == 0) {
      nlohmann::json line_residual;  // the residual_mlp's shape (--residual)
      double multiply_adds = 0.0;    // per row: what the row's forward multiplies
      const meshtrain::MoeSettings moe = config.model.moe();
      for (size_t i = 0; i + 1 < sizes.size() && residual.empty(); ++i) {
        const double layer = double(sizes[i]) * sizes[i + 1];
        multiply_adds += moe.is_moe(static_cast<int64_t>(i))
                             ? double(sizes[i]) * moe.experts + moe.top_k * layer
                             : layer;
      }
      if (!residual.empty()) {  // input, (gate,) up and down per block, output
        const double w = double(residual[0]), h = double(residual[1]);
        multiply_adds = double(sizes.front()) * w + double(sizes.back()) * w +
                        double(residual[2]) * (config.model.swiglu ? 3 : 2) * w * h;
        line_residual = {{"width", residual[0]},
                         {"hidden", residual[1]},
                         {"depth", residual[2]},
                         {"norm", norm},
                         {"activation", activation}};
      }
      const double flops_per_step = 6.0 * batch * multiply_adds;
      const double samples_per_s = batch / step_time;
      const double roofline = world * sgemm.wall * 1e9 / (flops_per_step / batch);
      // The same with CPU times (step: the largest rank's), which time-sharing with other
      // processes does not inflate: what the ratio would be on an idle machine.
      const double roofline_cpu = world * sgemm.cpu * 1e9 / (flops_per_step / batch);
      nlohmann::json line;
      if (!line_residual.is_null()) line["residual_mlp"] = line_residual;
      line["bench"] = "train_step";
      line["mode"] = mode;
      line["mesh"] = mesh.short_description();
      line["sizes"] = sizes;
      line["batch"] = batch;
      line["rows_per_rank"] = slice.rows;
      line["ranks"] = world;
      line["algorithm"] = algorithm;
      line["backend"] = meshtrain::to_string(run.backend());
      line["precision"] = precision;
      line["overlap"] = overlap;
      line["reductions"] = reductions;
      line["comm_thread"] = comm_thread;
      line["comm_thread_running"] = meshtrain::running_comm_progress() != nullptr;
      // Polling passes the thread made in this process so far (0: it only slept).
      line["comm_thread_passes"] = meshtrain::comm_progress().passes();
      line["bucket_mb"] = bucket_mb;
      line["param_dtype"] = param_dtype;
      line["reduce_dtype"] = reduce_dtype;
      line["gradient_buckets"] = model.gradient_buckets().size();
      line["execution_space"] = Kokkos::DefaultExecutionSpace::name();
      line["steps"] = steps;
      line["warmup"] = warmup;
      line["step_time_median_s"] = step_time;
      line["step_time_min_s"] = *std::min_element(times.begin(), times.end());
      line["step_time_max_s"] = *std::max_element(times.begin(), times.end());
      line["samples_per_s"] = samples_per_s;
      line["flops_per_step"] = flops_per_step;
      line["gflops_per_rank"] = flops_per_step / step_time / world * 1e-9;
      line["single_rank_sgemm_gflops"] = sgemm.wall;
      line["sgemm_shape"] = {sgemm_size, sgemm_size, sgemm_size};
      line["layer_sgemm_gflops"] = layer_sgemm.wall;
      line["layer_sgemm_shape"] = {batch, sizes[widest], sizes[widest + 1]};
      line["roofline_samples_per_s"] = roofline;
      line["ratio"] = samples_per_s / roofline;
      line["step_cpu_time_median_s"] = step_cpu_time;
      line["single_rank_sgemm_gflops_cpu"] = sgemm.cpu;
      line["ratio_cpu"] = (batch / step_cpu_time) / roofline_cpu;
      line["peak_rss_bytes_max_rank"] = peak_rss;
      line["rss_bytes_max_rank_by_stage"] = rss_stages;
      line["model_bytes_per_rank"] = {{"parameters", param_bytes},
                                      {"gradients", grad_bytes},
                                      {"optimizer_state", opt_bytes},
                                      {"total", param_bytes + grad_bytes + opt_bytes}};
      line["plan_bytes_per_rank"] = {{"parameters", plan.totals.parameter_bytes},
                                     {"gradients", plan.totals.gradient_bytes},
                                     {"optimizer_state", plan.totals.optimizer_bytes}};
      if (config.model.moe().any()) {
        int64_t expert_bytes = 0;  // rank 0's experts (every rank holds as many)
        for (const meshtrain::ShardedTensor& p : model.parameters()) {
          if (p.name.find("/experts/") != std::string::npos) {
            expert_bytes += static_cast<int64_t>(p.local.extent(0) * sizeof(float));
          }
        }
        line["moe_layers"] = config.model.moe_layers;
        line["experts"] = experts;
        line["top_k"] = top_k;
        line["expert_bytes_per_rank"] = expert_bytes;
        line["moe_buffer_bytes_per_rank"] = plan.totals.moe_buffer_bytes;
      }
      line["kokkos_allocations_in_timed_steps"] = kokkos_allocations;
      line["heap_allocations_in_timed_steps"] = heap_allocations;
      // The cost model's prediction for the same plan (partition/cost_model.hpp).
      const meshtrain::StepCost predicted = meshtrain::predict_step(
          plan, meshtrain::plan_options(config), profile, config.partition.collective_matmul);
      line["hardware"] = profile.source;
      line["predicted_step_time_s"] = predicted.total_s;
      line["predicted_over_measured"] = predicted.total_s / step_time;
      if (!hardware_cpu.empty()) {
        const meshtrain::StepCost on_cpu = meshtrain::predict_step(
            plan, meshtrain::plan_options(config), meshtrain::read_hardware_profile(hardware_cpu),
            config.partition.collective_matmul);
        line["predicted_cpu_s"] = on_cpu.total_s;
        line["predicted_cpu_over_measured_cpu"] = on_cpu.total_s / step_cpu_time;
      }
      line["predicted_parts_s"] = {{"gemm", predicted.gemm_s},
                                   {"collective", predicted.collective_s},
                                   {"collective_matmul", predicted.collective_matmul_s},
                                   {"memory", predicted.memory_s}};
      line["predicted_serial_s"] = predicted.serial_s;
      line["predicted_full_overlap_s"] = predicted.full_overlap_s;
      line["hardware_overlap"] = profile.overlap;
      line["first_loss"] = first_loss;
      line["last_loss"] = last_loss;
      line["loadavg_start"] = load_at_start;
      line["loadavg_end"] = load_average();
      std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    }
    return 0;
  });
}
