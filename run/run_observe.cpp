// What a TrainingRun tells about itself: describe(), the trace window ([runtime]
// trace_steps) and its files, and every rank's memory against the plan.

#include "run/training_run.hpp"

#include <mpi.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/tensor_values.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "framework/observe/trace.hpp"
#include "run/run_common.hpp"

namespace meshtrain {
namespace {
// "memory per rank, planned: 12.30 MiB: Kokkos 10.10 MiB (parameters 2.55 MiB, gradients
// 2.55 MiB, optimizer state 5.11 MiB, data staging 12.00 KiB), host 2.20 MiB (data in memory)"
std::string describe_planned_memory(const PlannedMemory& m) {
  std::string kokkos;
  const auto item = [&](const char* name, int64_t bytes) {
    if (bytes <= 0) return;
    kokkos += (kokkos.empty() ? "" : ", ") + std::string(name) + " " + format_bytes(bytes);
  };
  const PlanTotals& t = m.totals;
  item("parameters", t.parameter_bytes);
  item("gradients", t.gradient_bytes);
  item("optimizer state", t.optimizer_bytes);
  item("gradient accumulation", t.accumulation_bytes);
  item("evaluation batch", t.evaluation_bytes);
  item("ZeRO-1 buffers", t.zero1_buffer_bytes);
  item("MoE buffers", t.moe_buffer_bytes);
  item("activations", m.workspace.activation_bytes);
  item("batch buffers", m.workspace.batch_bytes);
  item("gathered weights", m.workspace.gathered_weight_bytes);
  item("collective matmul workspace", m.workspace.collective_matmul_bytes);
  item("communicator scratch", m.workspace.comm_scratch_bytes);
  item("staging (ckpt)", m.checkpoint_staging_bytes);
  item("data staging", m.data.staging_bytes);
  item("ring reductions", m.ring.total());
  std::string text = "memory per rank, planned: " + format_bytes(m.total_bytes()) + ": Kokkos " +
                     format_bytes(m.kokkos_bytes()) + " (" + kokkos + "), host " +
                     format_bytes(m.host_bytes()) + " (data " + m.data.source;
  if (m.data.cache_bytes > 0) text += ", chunk caches " + format_bytes(m.data.cache_bytes);
  return text + ")";
}

}  // namespace

std::string TrainingRun::run_dir() const {
  return run_directory(config_);
}

std::string TrainingRun::trace_dir() const {
  return run_dir() + "/trace";
}

// [runtime] trace_steps: the tracer records from the first traced step on; every rank's
// timestamps go onto rank 0's clock. Collective (all ranks step together).
void TrainingRun::begin_trace() {
  const TraceClock clock = start_trace(comm_, rank_, config_.runtime, trace_dir());
  trace_clock_offset_ns_ = clock.offset_ns;
  trace_origin_ns_ = clock.origin_ns;
  const int64_t steps = config_.runtime.trace_last - config_.runtime.trace_first + 1;
  // Kernels, copies and fences per traced step (passes.json beside the trace).
  traced_passes_ = TracedPasses{};
  traced_passes_.rank = rank_;
  traced_passes_.steps.reserve(static_cast<std::size_t>(std::min<int64_t>(steps, 4096)));
  install_pass_counter();
  tracing_ = true;
}

// After the last traced step: the run's traces (write_traces) and rank 0's passes.json.
// Collective; errors are agreed.
void TrainingRun::end_trace() {
  tracer().stop();
  tracing_ = false;
  // The last traced step's counts by label: what the counter holds since that step's reset.
  traced_passes_.labels = pass_counts();
  traced_passes_.labels_step = traced_passes_.steps.empty() ? 0 : traced_passes_.steps.back().step;
  uninstall_pass_counter();
  const std::string dir = trace_dir();
  write_traces(comm_, rank_, {trace_clock_offset_ns_, trace_origin_ns_}, dir, config_, [&] {
    write_trace_file(dir + "/passes.json", traced_passes_json(traced_passes_).dump(2) + "\n");
  });
}

std::string TrainingRun::plan_item_of(const TrackedAllocation& a) const {
  // Kokkos reports the start of an allocation: the View's data, or the header before it.
  const auto holds = [&](const std::vector<ShardedTensor>& tensors) {
    for (const ShardedTensor& t : tensors) {
      // Its block as stored: `local`, or the 16 bits of a 16-bit storage.
      const void* data = data_pointer(t);
      const auto offset = static_cast<const char*>(data) - static_cast<const char*>(a.data);
      if (data != nullptr &&
          (offset == 0 || offset == sizeof(Kokkos::Impl::SharedAllocationHeader))) {
        return true;
      }
    }
    return false;
  };
  const auto starts = [&](const char* prefix) { return a.label.rfind(prefix, 0) == 0; };
  if (holds(std::as_const(*model_).parameters())) return "parameters";  // read: copies stay current
  if (holds(model_->gradients())) return "gradients";
  // Under overlap a gradient stored as 16 bits is its range of the DP buckets' 16-bit buffer
  // (Mlp::store_gradients_16bit): the training model's buffer, the one that holds such a
  // gradient's bits, is the gradients' storage (the plan counts all of it: the stored weights'
  // ranges and the other gradients' 16-bit copies). Another model's (the evaluation model's)
  // is not.
  if (starts("meshtrain::grad_bucket_16bit")) {
    const char* begin = static_cast<const char*>(a.data);
    for (const ShardedTensor& g : model_->gradients()) {
      const char* bits = reinterpret_cast<const char*>(g.bits.data());
      if (g.stored_16bit() && bits >= begin && bits < begin + a.bytes) return "gradients";
    }
  }
  for (const std::string& slot : optimizer_->slot_names()) {
    if (holds(optimizer_->slot(slot))) return "optimizer state";
  }
  if (holds(gradient_sum_)) return "gradient accumulation";
  if (zero1_ && (holds(zero1_->grad_chunks()) || starts("meshtrain::zero1_"))) {
    return "ZeRO-1 buffers";
  }
  if (starts("meshtrain::checkpoint_staging")) return "staging (ckpt)";
  if (starts("meshtrain::staged_")) return "data staging";
  if (starts("meshtrain::ring_partial_sums") || starts("meshtrain::started_ring_partial_sums")) {
    return "ring reductions";
  }
  if (eval_model_ && (starts("meshtrain::eval_x") || starts("meshtrain::eval_labels") ||
                      starts("meshtrain::eval_targets"))) {
    return "evaluation batch";
  }
  // The step's workspace (PlannedMemory::workspace). A separate evaluation model's buffers
  // carry the training layers' labels: they are matched as activations too.
  if (starts("meshtrain::scratch_")) return "gathered weights";
  if (starts("meshtrain::collective_matmul_workspace")) return "collective matmul workspace";
  if (starts("meshtrain::comm_scratch")) return "communicator scratch";
  if (starts("meshtrain::batch_")) return "batch buffers";
  // An MoE layer's buffers: the plan counts its dispatch buffers (the rest is not counted).
  for (const LayerPlan& layer : plan_->layers) {
    if (layer.moe && starts((layer.name + "/").c_str())) return "MoE buffers";
  }
  if (starts("layers/") || starts("blocks/") || starts("input/") || starts("output/") ||
      starts("output_norm/") || starts("model/") || starts("meshtrain::loss_")) {
    return "activations";
  }
  return "";
}

MemoryEvent TrainingRun::measure_memory(const std::string& when) {
  install_memory_tracker();     // a program may have set callbacks of its own since
  constexpr int kScanned = 32;  // the largest live allocations looked at on the worst rank
  constexpr int kListed = 8;    // and listed (the largest, then unplanned ones further down)
  const KokkosMemory kokkos = kokkos_memory(kScanned);
  const HostMemory host = host_memory();
  int64_t device_peak = -1;
#ifdef KOKKOS_ENABLE_CUDA
  for (const SpaceMemory& space : kokkos.spaces) {
    if (space.space == Kokkos::CudaSpace::name()) device_peak = space.peak_bytes;
  }
  if (device_peak < 0) device_peak = 0;
#endif
  // Every rank's figures, by a sum of slots each rank fills with its own (under the
  // collective timeout, like every reduction of the run).
  constexpr int kFields = 6;
  const int world = mesh_->world_size();
  std::vector<int64_t> all(static_cast<size_t>(kFields) * world, 0);
  int64_t* mine = all.data() + static_cast<size_t>(kFields) * rank_;
  mine[0] = kokkos.peak_bytes;
  mine[1] = kokkos.live_bytes;
  mine[2] = device_peak;
  mine[3] = host.peak_rss_bytes;
  mine[4] = host.current_rss_bytes;
  mine[5] = kokkos.complete ? 1 : 0;
  all_reduce_collective(all.data(), kFields * world, MPI_INT64_T, MPI_SUM, comm_,
                        "the reduction of the memory figures");
  MemoryEvent event;
  event.step = steps_done_;
  event.when = when;
  event.planned_bytes = planned_memory_.total_bytes();
  event.planned_kokkos_bytes = planned_memory_.kokkos_bytes();
  for (int r = 0; r < world; ++r) {
    const int64_t* f = all.data() + static_cast<size_t>(kFields) * r;
    event.kokkos_peak_bytes.push_back(f[0]);
    event.kokkos_live_bytes.push_back(f[1]);
    if (f[2] >= 0) event.device_peak_bytes.push_back(f[2]);
    event.rss_peak_bytes.push_back(f[3]);
    event.rss_bytes.push_back(f[4]);
    event.kokkos_complete.push_back(f[5] != 0);
  }
  // Every rank has the same plan: the worst rank is the one with the largest Kokkos peak.
  event.worst_rank = static_cast<int>(
      std::max_element(event.kokkos_peak_bytes.begin(), event.kokkos_peak_bytes.end()) -
      event.kokkos_peak_bytes.begin());
  const int64_t worst_peak = event.kokkos_peak_bytes[event.worst_rank];
  event.over_plan =
      static_cast<double>(worst_peak) >
          (1.0 + kOverPlanFraction) * static_cast<double>(event.planned_kokkos_bytes) &&
      worst_peak - event.planned_kokkos_bytes > kOverPlanMinBytes;
  // The worst rank's largest live allocations, each with its plan item, go to every rank.
  std::string listed;
  if (rank_ == event.worst_rank) {
    nlohmann::json list = nlohmann::json::array();
    int unplanned_beyond = 0;
    for (size_t i = 0; i < kokkos.largest.size(); ++i) {
      const TrackedAllocation& a = kokkos.largest[i];
      const std::string item = plan_item_of(a);
      const bool among_largest = i < static_cast<size_t>(kListed);
      if (!among_largest && (!item.empty() || unplanned_beyond == kListed)) continue;
      if (!among_largest) ++unplanned_beyond;
      list.push_back({a.label, a.space, a.bytes, item});
    }
    // A label cut at 47 bytes may end inside a UTF-8 character: replaced, not thrown.
    listed = list.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  broadcast_string(listed, event.worst_rank, comm_, "the broadcast of the largest allocations");
  for (const auto& a : nlohmann::json::parse(listed)) {
    event.largest.push_back({a[0].get<std::string>(), a[1].get<std::string>(),
                             a[3].get<std::string>(), a[2].get<int64_t>()});
  }
  return event;
}

void TrainingRun::report_memory(const std::string& when, RunSummary* summary) {
  const double begin = window_.now();
  MemoryEvent event = measure_memory(when);
  metrics_->memory(event);
  if (events_.on_memory) events_.on_memory(event);
  if (summary) summary->memory = std::move(event);
  window_.add_paused(window_.now() - begin);  // not training time
}

std::vector<std::string> TrainingRun::describe() const {
  std::vector<std::string> lines;
  lines.push_back(detail::concat(
      mesh_->world_size(), " ranks, mesh ", mesh_->short_description(), ", batch ",
      config_.data.batch_size, " (", slice_.rows, " rows per rank)",
      accumulation_ > 1 ? detail::concat(" x ", accumulation_, " micro-batches per step")
                        : std::string(),
      ", eval batch ", eval_slice_.global_batch, ", ", total_steps_, " steps, lr ",
      to_string(lr_schedule_.kind)));
  lines.push_back(detail::concat("  compute on ", Kokkos::DefaultExecutionSpace::name(),
                                 ", communication ", to_string(backend_), ", matmul precision ",
                                 to_string(matmul_precision())));
  if (config_.optimizer.zero_stage == 1) {
    lines.push_back(zero1_ ? "  optimizer state and update split over dp (ZeRO-1)"
                           : "  optimizer.zero_stage = 1 changes nothing with dp = 1");
  }
  lines.push_back("  GEMM: " + gemm_kernels());
  const DataShape& data = train_source_->shape();
  if (stream_) {
    const StreamSection& stream = config_.stream;
    lines.push_back(detail::concat(
        "  data: ", data.description, " from ", stream_->producers(), " producer(s), ",
        to_string(stream.policy), " of ", stream.buffer_rows, " rows per rank, order ",
        to_string(stream.order), ", read in the step, ", data_bytes() >> 10, " KiB on this rank"));
  } else {
    lines.push_back(detail::concat(
        "  data: ", data.description, ", ", data.num_samples, " rows, order ",
        schedule_->order().name(), ", ",
        config_.data.prefetch > 0 ? detail::concat(config_.data.prefetch, " batches read ahead")
                                  : std::string("read in the step"),
        ", ", data_bytes() >> 10, " KiB on this rank"));
  }
  for (const std::string& line : model_->describe()) lines.push_back("  " + line);
  lines.push_back("  " + describe_planned_memory(planned_memory_));
  lines.push_back("  " + graphs_note_);
  // Last: tests index the lines above.
  if (!reduction_choices_.empty()) {
    std::string groups;
    for (const auto& choice : reduction_choices_) groups += (groups.empty() ? "" : "; ") + choice;
    lines.push_back(
        detail::concat("  reductions (", to_string(config_.runtime.reductions), "): ", groups));
  }
  return lines;
}

}  // namespace meshtrain
