#include "partition/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "partition/embedding_layout.hpp"
#include "partition/gradient_bucket_cap.hpp"
#include "partition/zero1_layout.hpp"

namespace meshtrain {

namespace {

constexpr double kFloat = 4.0;  // bytes per element of activations (float32)

std::string shape_text(int64_t m, int64_t k, int64_t n) {
  std::ostringstream s;
  s << "[" << m << " x " << k << " x " << n << "]";
  return s.str();
}

std::string group_text(const std::vector<std::string>& axes, const Mesh& mesh) {
  if (axes.empty()) return "";
  return (axes.size() == 1 ? axes[0] : "(" + join(axes) + ")") + "=" +
         std::to_string(mesh.size_of(axes));
}

// Whether the layer's weight is gathered over exactly one group (Linear::can_prefetch_weight).
bool can_prefetch(const LinearLayout& l) {
  return l.weight_gather_dim0.empty() != l.weight_gather_dim1.empty();
}

// What a call costs beyond its bytes: its `latencies` latencies, or the overhead a step pays per
// call (calibrate's collective_overhead), whichever is more (collective_seconds says why).
double call_overhead_seconds(const LinkProfile& link, double latencies) {
  return std::max(latencies * link.latency, link.collective_overhead);
}

}  // namespace

double collective_seconds(CollectiveKind kind, double bytes, int ranks, const LinkProfile& link) {
  if (ranks <= 1) return 0.0;
  const double p = ranks;
  // An all-to-all (pairwise exchange: p - 1 steps, each sending S/p to one rank while
  // receiving from another) moves what an all-gather's ring moves through a rank: at its rate.
  const double bandwidth = kind == CollectiveKind::all_gather || kind == CollectiveKind::all_to_all
                               ? link.collective_bandwidth
                           : kind == CollectiveKind::reduce_scatter ? link.reduce_scatter_bandwidth
                                                                    : link.all_reduce_bandwidth;
  // What a call costs beyond its bytes: its `latencies` latencies, or the overhead a step pays
  // per call (the wait for the last rank to arrive after its own compute: calibrate's
  // collective_overhead), whichever is more. A wait happens once per call, whatever its size,
  // so it adds to the bytes' time rather than hiding under it.
  const auto fixed = [&](double latencies) { return call_overhead_seconds(link, latencies); };
  const double moved = (p - 1) / p * bytes / bandwidth;
  if (kind != CollectiveKind::all_reduce) return moved + fixed(p - 1);
  // All-reduce: the cheaper of a ring (reduce-scatter then all-gather) and recursive
  // doubling (log2 p exchanges of the whole operand), as MPI picks for small operands.
  const double exchanges = std::ceil(std::log2(p));
  const double doubling = exchanges * bytes / bandwidth + fixed(exchanges);
  return std::min(2 * moved + fixed(2 * (p - 1)), doubling);
}

double overlapped_seconds(double a, double c, double overlap) {
  return std::max(a, c) + (1.0 - overlap) * std::min(a, c);  // exact max at overlap 1
}

double collective_matmul_seconds(const CollectiveMatmulShape& s,
                                 CollectiveMatmulAlgorithm algorithm, const LinkProfile& link,
                                 const HardwareProfile& hw) {
  const double naive_gemms = s.naive_calls * hw.gemm_seconds(s.naive);
  if (s.ranks <= 1) return naive_gemms;
  if (algorithm == CollectiveMatmulAlgorithm::automatic) {
    algorithm = choose_collective_matmul(s, algorithm, link, hw);
  }
  const double n = s.ranks;
  if (algorithm == CollectiveMatmulAlgorithm::naive) {
    const CollectiveKind kind = s.kind == CollectiveMatmulKind::all_gather
                                    ? CollectiveKind::all_gather
                                    : CollectiveKind::reduce_scatter;
    return naive_gemms + collective_seconds(kind, n * s.block_bytes, s.ranks, link);
  }
  const bool ring = algorithm == CollectiveMatmulAlgorithm::ring;
  const double g = ring ? hw.gemm_seconds(s.block) : 2 * hw.gemm_seconds(s.half);
  // Each hop is a call entered after the step's GEMM: its latency, or the overhead such a call
  // costs a step when that is more (collective_seconds).
  const double hop =
      call_overhead_seconds(link, 1) +
      s.block_bytes / (ring ? link.exchange_bandwidth : link.bidirectional_bandwidth);
  const double step = overlapped_seconds(g, hop, hw.overlap);
  if (s.kind == CollectiveMatmulKind::all_gather) return (n - 1) * step + g;
  const double add = 3 * s.block_bytes / hw.memory_bandwidth;
  return g + (n - 1) * (step + add);
}

std::vector<GradientBucketRun> gradient_bucket_elements(
    const std::vector<GradientBucketRun>& gradients, double bucket_mb) {
  const int64_t cap = gradient_bucket_cap_elements(bucket_mb);  // as GradientBuckets cuts them
  std::vector<GradientBucketRun> buckets;
  for (const GradientBucketRun& g : gradients) {
    for (int64_t offset = 0; offset < g.elements;) {
      if (buckets.empty() || buckets.back().group != g.group || buckets.back().elements == cap) {
        buckets.push_back({g.group, 0});
      }
      const int64_t n = std::min(cap - buckets.back().elements, g.elements - offset);
      buckets.back().elements += n;
      offset += n;
    }
  }
  return buckets;
}

CollectiveMatmulAlgorithm choose_collective_matmul(const CollectiveMatmulShape& s,
                                                   CollectiveMatmulAlgorithm requested,
                                                   const LinkProfile& link,
                                                   const HardwareProfile& hw) {
  if (requested != CollectiveMatmulAlgorithm::automatic) return requested;
  if (s.ranks <= 1) return CollectiveMatmulAlgorithm::naive;
  const CollectiveMatmulAlgorithm simplest_first[] = {CollectiveMatmulAlgorithm::naive,
                                                      CollectiveMatmulAlgorithm::ring,
                                                      CollectiveMatmulAlgorithm::bidirectional};
  double seconds[3], fastest = 0.0;
  for (int a = 0; a < 3; ++a) {
    seconds[a] = collective_matmul_seconds(s, simplest_first[a], link, hw);
    fastest = a == 0 ? seconds[a] : std::min(fastest, seconds[a]);
  }
  for (int a = 0; a < 3; ++a) {
    if (seconds[a] <= fastest * (1.0 + kAutomaticMargin)) return simplest_first[a];
  }
  return CollectiveMatmulAlgorithm::naive;  // unreachable: the fastest is within its margin
}

std::vector<CollectiveMatmulShape> layer_matmul_shapes(const LinearLayout& l, int64_t rows,
                                                       Dtype wire) {
  // Each moves one [rows, out/tp] block of the output or of its gradient and runs its GEMM
  // as tp column blocks of the output (naive and ring alike); bidirectional splits the
  // block's rows in two.
  const int64_t half = rows - rows / 2, cols = l.out_local, in = l.in_compute;
  const double block = static_cast<double>(bytes_of(wire)) * rows * cols;
  const GemmShape forward{rows, in, cols, false, false}, forward_half{half, in, cols, false, false};
  const GemmShape weight{in, rows, cols, true, false}, weight_half{in, half, cols, true, false};
  const GemmShape input{rows, cols, in, false, true}, input_half{half, cols, in, false, true};
  const int n = static_cast<int>(l.tp);
  if (l.column_parallel) {
    // Column-parallel (input split): each moves one [rows, in/tp] block of the input or of
    // its gradient; forward and weight gradient accumulate the gathered K blocks, the input
    // gradient reduce-scatters dY @ Wᵀ over its columns.
    const int64_t k = l.in / n;
    const double in_block = static_cast<double>(bytes_of(wire)) * rows * k;
    const GemmShape fwd{rows, k, cols, false, false}, fwd_half{half, k, cols, false, false};
    const GemmShape wg{k, rows, cols, true, false}, wg_half{k, half, cols, true, false};
    const GemmShape ig{rows, cols, k, false, true}, ig_half{half, cols, k, false, true};
    return {{CollectiveMatmulKind::all_gather, fwd, n, fwd, fwd_half, in_block, n},
            {CollectiveMatmulKind::all_gather, wg, n, wg, wg_half, in_block, n},
            {CollectiveMatmulKind::reduce_scatter, ig, n, ig, ig_half, in_block, n}};
  }
  return {{CollectiveMatmulKind::reduce_scatter, forward, n, forward, forward_half, block, n},
          {CollectiveMatmulKind::all_gather, weight, n, weight, weight_half, block, n},
          {CollectiveMatmulKind::all_gather, input, n, input, input_half, block, n}};
}

LayerMatmulAlgorithms layer_matmul_algorithms(const LinearLayout& l, int64_t rows,
                                              CollectiveMatmulAlgorithm requested,
                                              const HardwareProfile& hw, Dtype wire) {
  LayerMatmulAlgorithms out;
  if (!l.runs_collective_matmuls()) return out;
  const LinkProfile link = hw.group_link({l.feature_axis});
  const auto shapes = layer_matmul_shapes(l, rows, wire);
  out.forward = choose_collective_matmul(shapes[0], requested, link, hw);
  out.weight_grad = choose_collective_matmul(shapes[1], requested, link, hw);
  out.input_grad = choose_collective_matmul(shapes[2], requested, link, hw);
  return out;
}

namespace {
// A layer without collective matmuls, as layers/linear.cpp runs it: forward x @ W (NN),
// weight gradient xᵀ @ dY (TN), input gradient dY @ Wᵀ (NT).
struct PlainLayerGemms {
  GemmShape forward, weight_grad, input_grad;
};
PlainLayerGemms plain_layer_gemms(const LinearLayout& l, int64_t rows) {
  const int64_t cols = l.compute_cols();
  return {{rows, l.in_compute, cols, false, false},
          {l.in_compute, rows, cols, true, false},
          {rows, cols, l.in_compute, false, true}};
}

// An MoE layer's GEMMs at uniform routing (partition/moe_layout.hpp): the router's on the
// local rows (x @ Wr NN [R x in x E], Xᵀ @ dLogits TN [in x R x E], dLogits @ Wrᵀ NT
// [R x E x in]) and one per local expert on its rows: the R*k rows a rank receives split as
// evenly as they go over its experts_local experts (`count` experts with `rows` rows each,
// one or two groups), x_e @ W_e NN [rows x in x out], X_eᵀ @ dY_e TN [in x rows x out],
// dY_e @ W_eᵀ NT [rows x out x in].
struct ExpertGemms {
  int64_t count = 0, rows = 0;
  GemmShape forward, weight_grad, input_grad;
};
struct MoeLayerGemms {
  PlainLayerGemms router;
  std::vector<ExpertGemms> experts;
};
MoeLayerGemms moe_layer_gemms(const MoeLayout& m, int64_t rows) {
  MoeLayerGemms g;
  g.router = {{rows, m.in, m.experts, false, false},
              {m.in, rows, m.experts, true, false},
              {rows, m.experts, m.in, false, true}};
  const int64_t local = std::max<int64_t>(m.experts_local, 1);
  const int64_t routed = rows * m.top_k, base = routed / local, extra = routed % local;
  // Feed-forward experts: one entry per projection ((gate,) up in -> hidden, down hidden ->
  // out), each with its three GEMMs.
  auto group = [&](int64_t count, int64_t n) {
    if (count <= 0 || n <= 0) return;
    auto projection = [&](int64_t in, int64_t out) {
      g.experts.push_back({count, n, GemmShape{n, in, out, false, false},
                           GemmShape{in, n, out, true, false}, GemmShape{n, out, in, false, true}});
    };
    if (!m.feed_forward()) {
      projection(m.in, m.out);
      return;
    }
    if (m.gated) projection(m.in, m.hidden);
    projection(m.in, m.hidden);
    projection(m.hidden, m.out);
  };
  group(extra, base + 1);
  group(local - extra, base);
  return g;
}
}  // namespace

std::vector<GemmShape> step_gemm_shapes(const ShardingPlan& plan) {
  std::vector<GemmShape> shapes;
  const int64_t r = plan.local_batch_rows;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LinearLayout& l = plan.layers[i].layout;
    if (plan.layers[i].moe) {
      const MoeLayerGemms g = moe_layer_gemms(plan.layers[i].moe_layout, r);
      shapes.push_back(g.router.forward);
      shapes.push_back(g.router.weight_grad);
      if (i > 0) shapes.push_back(g.router.input_grad);
      for (const ExpertGemms& e : g.experts) {
        shapes.push_back(e.forward);
        shapes.push_back(e.weight_grad);
        if (i > 0) shapes.push_back(e.input_grad);
      }
    } else if (l.runs_collective_matmuls()) {
      const auto matmuls = layer_matmul_shapes(l, r);
      for (size_t k = 0; k < matmuls.size(); ++k) {
        if (k == 2 && i == 0) continue;  // the first layer has no input gradient
        shapes.insert(shapes.end(), {matmuls[k].naive, matmuls[k].block, matmuls[k].half});
      }
    } else {
      const PlainLayerGemms g = plain_layer_gemms(l, r);
      shapes.push_back(g.forward);
      shapes.push_back(g.weight_grad);
      if (i > 0) shapes.push_back(g.input_grad);
    }
  }
  std::sort(shapes.begin(), shapes.end());
  shapes.erase(std::unique(shapes.begin(), shapes.end()), shapes.end());
  shapes.erase(std::remove_if(shapes.begin(), shapes.end(),
                              [](const GemmShape& g) { return g.flops() <= 0.0; }),
               shapes.end());
  return shapes;
}

StepCost predict_step(const ShardingPlan& plan, const PlanOptions& options,
                      const HardwareProfile& hw, CollectiveMatmulAlgorithm algorithm) {
  check_hardware_profile(hw);
  if (plan.layers.empty() || plan.local_batch_rows <= 0) {
    MESHTRAIN_BAD_INPUT("the cost model needs the model's layers and a global batch that ",
                        "divides by the batch shards");
  }
  const Mesh& mesh = plan.mesh;
  const int64_t r = plan.local_batch_rows;
  StepCost cost;
  cost.accumulation_steps = std::max<int64_t>(1, options.accumulation_steps);
  auto add = [&](const std::string& layer, const std::string& phase, const char* category,
                 const std::string& what, const std::string& group, double seconds) {
    cost.items.push_back({layer, phase, category, what, group, seconds});
  };
  auto gemm = [&](const std::string& layer, const char* phase, const std::string& what,
                  const GemmShape& shape) {
    add(layer, phase, "gemm", what + " " + shape_text(shape.m, shape.k, shape.n), "",
        hw.gemm_seconds(shape));
  };
  auto memory = [&](const std::string& layer, const char* phase, const std::string& what,
                    double bytes) {
    add(layer, phase, "memory", what, "", bytes / hw.memory_bandwidth);
  };
  // An elementwise kernel over `elements` that reads and writes `passes` of them: at its
  // measured rate when the profile has one (its arithmetic sets the pace), else its bytes at
  // memory_bandwidth.
  auto elementwise = [&](const std::string& layer, const char* phase, const std::string& what,
                         const std::string& kernel, double elements, double passes) {
    const auto rate = hw.elementwise_rates.find(kernel);
    if (rate != hw.elementwise_rates.end()) {
      add(layer, phase, "memory", what + " (" + kernel + " at its measured rate)", "",
          elements / rate->second);
    } else {
      memory(layer, phase, what, passes * kFloat * elements);
    }
  };
  // The plan's collective, unless a collective matmul does it.
  const Dtype param_dtype = options.precision.param;
  auto collective = [&](const std::string& layer, const LayerCollective& c) {
    double elements = 1.0;
    for (int64_t d : c.shape) elements *= static_cast<double>(d);
    const double bytes = elements * c.element_bytes;
    add(layer, c.phase, "collective", std::string(to_string(c.kind)) + " " + c.operand,
        group_text(c.axes, mesh),
        collective_seconds(c.kind, bytes, c.ranks, hw.group_link(c.axes)));
    // 16 bits on the wire: the operand packed (read 4, write 2 bytes an element) and
    // unpacked (read 2, write 4), over the whole operand.
    if (c.element_bytes == 2 && c.ranks > 1) {
      memory(layer, c.phase.c_str(), "16-bit pack and unpack of " + c.operand, 12 * elements);
    }
    // Columns move through staging (Communicator's dim-1 all_gather / reduce_scatter):
    // one more pass over the full operand, read and written.
    if (c.dim == 1 && c.ranks > 1 && c.shape.size() == 2 && c.shape[0] > 1) {
      memory(layer, c.phase.c_str(),
             std::string(c.kind == CollectiveKind::all_gather ? "unpack gathered columns of "
                                                              : "pack columns to scatter of ") +
                 c.operand,
             2 * bytes);
    }
  };
  auto matmul = [&](const std::string& layer, const char* phase, const std::string& what,
                    const CollectiveMatmulShape& shape, CollectiveMatmulAlgorithm chosen,
                    const std::string& feature) {
    add(layer, phase, "collective matmul",
        what + " (" +
            (chosen == CollectiveMatmulAlgorithm::ring            ? "ring"
             : chosen == CollectiveMatmulAlgorithm::bidirectional ? "bidirectional"
                                                                  : "naive") +
            ")",
        group_text({feature}, mesh),
        collective_matmul_seconds(shape, chosen, hw.group_link({feature}), hw));
  };

  const size_t count = plan.layers.size();
  const bool zero1 =
      options.zero_stage == 1 && mesh.has_axis(kZeroAxis) && mesh.size_of({kZeroAxis}) > 1;
  // FSDP prefetch (options.overlap): a weight gather started at item `start` (the layer
  // before has its own weight) and waited for at item `gather`.
  struct Prefetch {
    size_t start, gather;
    std::string under;
  };
  std::vector<Prefetch> prefetches;
  std::vector<size_t> forward_start(count, 0), backward_start(count, 0);
  // Gradient all-reduces ZeRO-1 does once per step instead (deferred by the layer).
  std::vector<std::pair<std::string, LayerCollective>> deferred_reductions;
  // Gradient all-reduces run in buckets (options.gradient_bucket_mb), in the order backward
  // finishes them: each gradient's group, elements, bytes per element and layer.
  struct BucketedGradient {
    std::string layer;
    std::vector<std::string> axes;
    int ranks = 1;
    int64_t elements = 0;
    double element_bytes = 0.0;
  };
  std::vector<BucketedGradient> bucketed;
  auto add_to_bucket = [&](const std::string& layer, const LayerCollective& c) {
    int64_t elements = 1;
    for (int64_t d : c.shape) elements *= d;
    bucketed.push_back({layer, c.axes, c.ranks, elements, static_cast<double>(c.element_bytes)});
  };
  // An MoE parameter gathered over its group arrives as the members' blocks in rank order and
  // is placed into [d0, d1, d2]; its gradient is cut into blocks before the reduce-scatter
  // (ShardedParameter, as_blocks, in layers/sharded_parameter.cpp): one pass over the compute
  // block each, read and written.
  auto moe_storage_of = [](const MoeLayout& m, const std::string& operand) {
    const MoeParameterStorage* none = nullptr;
    if (operand == "router" || operand == "router gradient") return &m.router;
    if (operand == "expert weights" || operand == "expert weight gradient") {
      return &m.experts_weight;
    }
    if (operand == "expert biases" || operand == "expert bias gradient") return &m.experts_bias;
    if (operand == "expert gate weights" || operand == "expert gate weight gradient") {
      return &m.experts_gate_weight;
    }
    if (operand == "expert gate biases" || operand == "expert gate bias gradient") {
      return &m.experts_gate_bias;
    }
    if (operand == "expert down weights" || operand == "expert down weight gradient") {
      return &m.experts_down_weight;
    }
    if (operand == "expert down biases" || operand == "expert down bias gradient") {
      return &m.experts_down_bias;
    }
    return none;
  };
  // An MoE layer's collectives by operand ("": all those of the phase left), in the order the
  // layer runs them; `done` marks those already costed.
  auto moe_collectives = [&](const LayerPlan& lp, std::vector<bool>& done, const char* phase,
                             const std::string& operand) {
    for (size_t k = 0; k < lp.collectives.size(); ++k) {
      const LayerCollective& c = lp.collectives[k];
      if (done[k] || c.phase != phase || (!operand.empty() && c.operand != operand)) continue;
      done[k] = true;
      const MoeParameterStorage* p = moe_storage_of(lp.moe_layout, c.operand);
      const double block = p ? 2.0 * kFloat * static_cast<double>(p->compute_elements()) : 0.0;
      if (p && c.kind == CollectiveKind::reduce_scatter) {
        memory(lp.name, phase, "cut into blocks: " + c.operand, block);
      }
      collective(lp.name, c);
      if (p && c.kind == CollectiveKind::all_gather) {
        memory(lp.name, phase, "place gathered blocks: " + c.operand, block);
      }
    }
  };
  // Memory passes of an MoE layer, in floats read + written (see the header).
  auto moe_memory = [&](const LayerPlan& lp, const char* phase, const std::string& what,
                        double floats) { memory(lp.name, phase, what, kFloat * floats); };
  auto moe_experts = [&](const LayerPlan& lp, const char* phase, const char* what,
                         GemmShape ExpertGemms::*shape, const MoeLayerGemms& g) {
    for (const ExpertGemms& e : g.experts) {
      const GemmShape& one = e.*shape;
      add(lp.name, phase, "gemm",
          std::string(what) + " " + std::to_string(e.count) + " x " +
              shape_text(one.m, one.k, one.n) + " (uniform routing)",
          "", e.count * hw.gemm_seconds(one));
    }
  };
  // Under mixed precision a parameter the layer does not gather is cast (a rounded copy) each
  // time it is used.
  auto moe_cast = [&](const LayerPlan& lp, const char* phase, const MoeParameterStorage& p) {
    if (param_dtype == Dtype::fp32 || !p.gather().empty()) return;
    memory(lp.name, phase, "cast " + p.name,
           2.0 * kFloat * static_cast<double>(p.compute_elements()));
  };
  // A dispatch without an expert group (ep = 1) is a copy of the rows.
  auto moe_dispatch = [&](const LayerPlan& lp, std::vector<bool>& done, const char* phase,
                          const char* operand, double floats) {
    if (lp.moe_layout.ep > 1) {
      moe_collectives(lp, done, phase, operand);
    } else {
      moe_memory(lp, phase, std::string("copy of ") + operand + " (one rank holds every expert)",
                 floats);
    }
  };
  auto moe_forward = [&](size_t i) {
    const LayerPlan& lp = plan.layers[i];
    const MoeLayout& m = lp.moe_layout;
    const MoeLayerGemms g = moe_layer_gemms(m, r);
    const double R = static_cast<double>(r), k = static_cast<double>(m.top_k);
    const double in = static_cast<double>(m.in), out = static_cast<double>(m.out);
    const double E = static_cast<double>(m.experts);
    std::vector<bool> done(lp.collectives.size(), false);
    if (param_dtype != Dtype::fp32 && i == 0) moe_memory(lp, "forward", "input cast", 2 * R * in);
    moe_collectives(lp, done, "forward", "input");
    moe_collectives(lp, done, "forward", "router");
    moe_cast(lp, "forward", m.router);
    forward_start[i] = cost.items.size();
    gemm(lp.name, "forward", "router x @ Wr", g.router.forward);
    moe_memory(lp, "forward", "router softmax and top-k", 3 * R * E);
    moe_memory(lp, "forward", "routing counts and positions", E * R * (1 + 2 * k) + R * k);
    moe_collectives(lp, done, "forward", "expert counts");
    moe_collectives(lp, done, "forward", "routing statistics");
    moe_memory(lp, "forward", "dispatch plan", 3 * R * k);
    moe_memory(lp, "forward", "pack rows by destination", 2 * R * k * in);
    moe_dispatch(lp, done, "forward", "dispatched rows", 2 * R * k * in);
    moe_memory(lp, "forward", "permute to expert-major", 2 * R * k * in);
    moe_collectives(lp, done, "forward", "expert weights");
    moe_cast(lp, "forward", m.experts_weight);
    moe_experts(lp, "forward", "experts x @ W", &ExpertGemms::forward, g);
    moe_collectives(lp, done, "forward", "expert biases");
    moe_cast(lp, "forward", m.experts_bias);
    moe_memory(lp, "forward", "expert bias add", 2 * R * k * out);
    moe_memory(lp, "forward", "permute back to source order", 2 * R * k * out);
    moe_dispatch(lp, done, "forward", "expert outputs", 2 * R * k * out);
    moe_memory(lp, "forward", "combine with gates", R * k * out + R * out);
    moe_collectives(lp, done, "forward", "");
    // The activation after the layer (an MoE block of a residual_mlp has none after it).
    if (i + 1 < count && lp.output_op != LayerOutputOp::none) {
      moe_memory(lp, "forward", "activation", 2 * R * out);
    }
  };
  auto moe_backward = [&](size_t j) {
    const LayerPlan& lp = plan.layers[j];
    const MoeLayout& m = lp.moe_layout;
    const MoeLayerGemms g = moe_layer_gemms(m, r);
    const double R = static_cast<double>(r), k = static_cast<double>(m.top_k);
    const double in = static_cast<double>(m.in), out = static_cast<double>(m.out);
    const double E = static_cast<double>(m.experts);
    const bool input_grad = j > 0, mixed = param_dtype != Dtype::fp32;
    std::vector<bool> done(lp.collectives.size(), false);
    if (j + 1 < count && lp.output_op != LayerOutputOp::none) {
      moe_memory(lp, "backward", "activation gradient", 3 * R * out);
    }
    backward_start[j] = cost.items.size();
    moe_memory(lp, "backward", "gate gradients", R * k * out + R * out);
    moe_memory(lp, "backward", "pack output gradients times gates", 2 * R * k * out);
    moe_dispatch(lp, done, "backward", "expert output gradients", 2 * R * k * out);
    moe_memory(lp, "backward", "permute to expert-major", 2 * R * k * out);
    moe_experts(lp, "backward", "experts xᵀ @ dY", &ExpertGemms::weight_grad, g);
    if (mixed) {
      moe_memory(lp, "backward", "expert weight gradient rounding",
                 2 * static_cast<double>(m.experts_weight.compute_elements()));
    }
    moe_memory(lp, "backward", "expert bias gradient", R * k * out);
    if (input_grad) {
      moe_collectives(lp, done, "backward", "expert weights");
      moe_cast(lp, "backward", m.experts_weight);
      moe_experts(lp, "backward", "experts dY @ Wᵀ", &ExpertGemms::input_grad, g);
      if (mixed) moe_memory(lp, "backward", "expert input gradient rounding", 2 * R * k * in);
      moe_memory(lp, "backward", "permute back to source order", 2 * R * k * in);
      moe_dispatch(lp, done, "backward", "dispatched row gradients", 2 * R * k * in);
    }
    moe_memory(lp, "backward", "router softmax backward", 3 * R * E);
    gemm(lp.name, "backward", "router xᵀ @ dLogits", g.router.weight_grad);
    if (mixed) {
      moe_memory(lp, "backward", "router gradient rounding",
                 2 * static_cast<double>(m.router.compute_elements()));
    }
    if (input_grad) {
      moe_collectives(lp, done, "backward", "router");
      moe_cast(lp, "backward", m.router);
      gemm(lp.name, "backward", "router dLogits @ Wrᵀ", g.router.input_grad);
      moe_memory(lp, "backward", "combine input gradients", R * k * in + 2 * R * in);
      if (m.gathers_input()) {
        moe_memory(lp, "backward", "input gradient slice",
                   2 * R * static_cast<double>(m.input_width()));
      }
    }
    moe_collectives(lp, done, "backward", "");  // the gradient reduce-scatters and all-reduces
    for (const MoeParameterStorage* p : {&m.experts_weight, &m.experts_bias, &m.router}) {
      if (p->nonbatch_replication > 1) {
        memory(lp.name, "backward", "gradient scale " + p->name,
               2.0 * options.bytes_per_element * static_cast<double>(p->stored_elements()));
      }
    }
  };
  // What runs on layer i's output before the next layer (LayerPlan::output_op), over its
  // E = r * out_local elements: the activation (reads E, writes E) or SwiGLU (reads gate and
  // value, writes E: 3 E), then dropout (read, write: 2 E). Not after the last layer, nor
  // after MoE layers (moe_forward charges their activation).
  auto elementwise_forward = [&](size_t i) {
    const LayerPlan& lp = plan.layers[i];
    if (i + 1 >= count || lp.output_op == LayerOutputOp::none) return;
    const double e = static_cast<double>(r) * static_cast<double>(lp.layout.out_local);
    if (lp.output_op == LayerOutputOp::swiglu) {
      elementwise(lp.name, "forward", "SwiGLU silu(gate) * value (read 2, write 1)",
                  "swiglu_forward", e, 3);
    } else {
      elementwise(lp.name, "forward", options.activation + " activation (read 1, write 1)",
                  options.activation + "_forward", e, 2);
    }
    if (options.dropout > 0.0) {
      memory(lp.name, "forward", "dropout mask (read 1, write 1)", 2 * kFloat * e);
    }
  };
  // Backward of the same, in reverse: dropout on the gradient in place (2 E); the
  // activation's gradient (reads z and dY, writes dZ: 3 E) or SwiGLU's (reads gate, value and
  // dY, writes both gradients: 5 E).
  auto elementwise_backward = [&](size_t j) {
    const LayerPlan& lp = plan.layers[j];
    if (j + 1 >= count || lp.output_op == LayerOutputOp::none) return;
    const double e = static_cast<double>(r) * static_cast<double>(lp.layout.out_local);
    if (options.dropout > 0.0) {
      memory(lp.name, "backward", "dropout mask on the gradient (read 1, write 1)", 2 * kFloat * e);
    }
    if (lp.output_op == LayerOutputOp::swiglu) {
      elementwise(lp.name, "backward", "SwiGLU gate and value gradients (read 3, write 2)",
                  "swiglu_backward", e, 5);
    } else {
      elementwise(lp.name, "backward", options.activation + " gradient (read 2, write 1)",
                  options.activation + "_backward", e, 3);
    }
  };
  // Norms (residual_mlp, layers/norm.cpp) over W = r * local_width elements, each run right
  // after the linear layer whose output it reads (NormPlan's `after`, past that block's
  // residual add). Forward: the row statistics (RMSNorm: sum of squares, 1 W; LayerNorm: sum,
  // then the centred sums, 2 W), their all-reduce over tp when the features are split (the
  // plan's collectives, with the parameters' gathers), then x_hat * scale (+ bias): read 1,
  // write 1. Backward, before layer `after`'s: the parameter gradients' column sums (read x
  // and dY: 2 W), the row sums (2 W), their all-reduce over tp, the input gradient (read x and
  // dY, write dX: 3 W), the gradients' reductions; then, for a block's norm, the residual's
  // gradient added to it (read 2, write 1: 3 W of the block's width).
  auto norm_width = [&](const NormPlan& n) {
    return static_cast<double>(r) * static_cast<double>(n.layout.local_width);
  };
  // The blocks' widths by the layer before each (the block's input): where its backward
  // ends with the residual add.
  struct BlockEnd {
    double elements = 0.0;
    std::string layer;  // the block's last layer
  };
  std::vector<BlockEnd> block_before(count);
  for (size_t k = 0, before = 0; k < count; ++k) {
    if (!plan.layers[k].ends_residual_block) continue;
    block_before[before] = {
        static_cast<double>(r) * static_cast<double>(plan.layers[k].layout.out_local),
        plan.layers[k].name};
    before = k;
  }
  auto norms_forward = [&](size_t i) {
    for (const NormPlan& n : plan.norms) {
      if (n.after != i) continue;
      const double w = norm_width(n);
      const bool layernorm = n.layout.kind == NormKind::layernorm;
      memory(n.name, "forward",
             layernorm ? "layernorm row sums, then centred sums (read 2)"
                       : "rmsnorm row sums of squares (read 1)",
             (layernorm ? 2 : 1) * kFloat * w);
      for (const auto& c : n.collectives) {
        if (c.phase == "forward") collective(n.name, c);
      }
      memory(n.name, "forward", "norm output x_hat * scale (read 1, write 1)", 2 * kFloat * w);
    }
  };
  auto norms_backward = [&](size_t j) {
    for (const NormPlan& n : plan.norms) {
      if (n.after != j) continue;
      const double w = norm_width(n);
      memory(n.name, "backward", "norm parameter gradients: column sums (read 2)", 2 * kFloat * w);
      memory(n.name, "backward", "norm gradient row sums (read 2)", 2 * kFloat * w);
      for (const auto& c : n.collectives) {
        if (c.phase == "backward") collective(n.name, c);
      }
      memory(n.name, "backward", "norm input gradient (read 2, write 1)", 3 * kFloat * w);
    }
    if (block_before[j].elements > 0.0) {
      memory(block_before[j].layer, "backward",
             "residual gradient added to the block's input gradient (read 2, write 1)",
             3 * kFloat * block_before[j].elements);
    }
  };
  // Forward, layer by layer.
  for (size_t i = 0; i < count; ++i) {
    const LayerPlan& lp = plan.layers[i];
    const LinearLayout& l = lp.layout;
    if (lp.moe) {
      cost.matmuls.push_back({});
      moe_forward(i);
      if (lp.ends_residual_block) {  // an MoE block of a residual_mlp
        memory(lp.name, "forward", "residual add (read 2, write 1)",
               3 * kFloat * r * static_cast<double>(l.out_local));
      }
      norms_forward(i);
      continue;
    }
    const LayerMatmulAlgorithms chosen = layer_matmul_algorithms(l, r, algorithm, hw, param_dtype);
    cost.matmuls.push_back(chosen);
    // Not under an MoE layer, which starts no prefetch.
    const bool prefetched = options.overlap && i > 0 && can_prefetch(l) && !plan.layers[i - 1].moe;
    for (const auto& c : lp.collectives) {
      // The collective matmuls' collectives are charged with their GEMMs.
      if (c.phase != "forward" || (l.split_output && c.operand == "output") ||
          (l.column_gathers_input() && c.operand == "input")) {
        continue;
      }
      if (prefetched && c.operand == "weight") {
        prefetches.push_back({forward_start[i - 1], cost.items.size(), plan.layers[i - 1].name});
      }
      collective(lp.name, c);
    }
    forward_start[i] = cost.items.size();
    // Mixed precision's extra passes (read and write fp32): the input cast and the cast of a
    // weight that is not gathered (the output and the activation round in their own passes).
    const bool cast = param_dtype != Dtype::fp32;
    if (cast && i == 0) memory(lp.name, "forward", "input cast", 2 * kFloat * r * l.in);
    if (cast && !l.gathers_weight()) {
      memory(lp.name, "forward", "weight cast", 2 * kFloat * l.in_compute * l.compute_cols());
    }
    if (l.slices_input()) memory(lp.name, "forward", "input slice", 2 * kFloat * r * l.in_compute);
    if (l.column_gathers_input()) {
      matmul(lp.name, "forward", "all-gathered x @ W " + shape_text(r, l.in, l.out_local),
             layer_matmul_shapes(l, r, param_dtype)[0], chosen.forward, l.feature_axis);
    } else if (l.column_parallel) {
      gemm(lp.name, "forward", "x @ W", plain_layer_gemms(l, r).forward);
    } else if (l.split_output) {
      matmul(lp.name, "forward", "x @ W reduce-scattered " + shape_text(r, l.in_compute, l.out),
             layer_matmul_shapes(l, r, param_dtype)[0], chosen.forward, l.feature_axis);
    } else {
      gemm(lp.name, "forward", "x @ W", plain_layer_gemms(l, r).forward);
    }
    memory(lp.name, "forward", "bias add", 2 * kFloat * r * l.out_local);
    elementwise_forward(i);
    if (lp.ends_residual_block) {
      memory(lp.name, "forward", "residual add (read 2, write 1)", 3 * kFloat * r * l.out_local);
    }
    norms_forward(i);
  }
  const LinearLayout& last = plan.layers.back().layout;
  memory("loss", "forward", "loss and its gradient", 4 * kFloat * r * last.out_local);
  add("loss", "forward", "collective", "all-reduce loss sums (3 numbers)",
      group_text(mesh.active_axes(), mesh),
      collective_seconds(CollectiveKind::all_reduce, 24, mesh.world_size(),
                         hw.group_link(mesh.active_axes())));
  // Backward, last layer first.
  for (size_t j = count; j-- > 0;) {
    const LayerPlan& lp = plan.layers[j];
    const LinearLayout& l = lp.layout;
    norms_backward(j);
    if (lp.moe) {
      if (lp.ends_residual_block) {
        memory(lp.name, "backward", "residual gradient copy (read 1, write 1)",
               2 * kFloat * r * static_cast<double>(l.out_local));
      }
      moe_backward(j);
      continue;
    }
    const LayerMatmulAlgorithms& chosen = cost.matmuls[j];
    if (lp.ends_residual_block) {
      memory(lp.name, "backward", "residual gradient copy (read 1, write 1)",
             2 * kFloat * r * l.out_local);
    }
    elementwise_backward(j);
    const bool prefetched =
        options.overlap && j + 1 < count && can_prefetch(l) && !plan.layers[j + 1].moe;
    for (const auto& c : lp.collectives) {
      if (c.phase != "backward" || c.operand != "weight") continue;
      if (prefetched) {
        prefetches.push_back({backward_start[j + 1], cost.items.size(), plan.layers[j + 1].name});
      }
      collective(lp.name, c);
    }
    backward_start[j] = cost.items.size();
    if (param_dtype != Dtype::fp32) {
      if (!l.gathers_weight()) {
        memory(lp.name, "backward", "weight cast", 2 * kFloat * l.in_compute * l.compute_cols());
      }
      memory(lp.name, "backward", "weight gradient rounding",
             2 * kFloat * l.in_compute * l.compute_cols());
      if (j > 0) {
        memory(lp.name, "backward", "input gradient rounding", 2 * kFloat * r * l.in_compute);
      }
    }
    const auto shapes = layer_matmul_shapes(l, r, param_dtype);
    if (l.column_gathers_input()) {
      matmul(lp.name, "backward", "all-gathered xᵀ @ dY " + shape_text(l.in, r, l.out_local),
             shapes[1], chosen.weight_grad, l.feature_axis);
      if (j > 0) {
        matmul(lp.name, "backward", "dY @ Wᵀ reduce-scattered " + shape_text(r, l.out_local, l.in),
               shapes[2], chosen.input_grad, l.feature_axis);
      }
    } else if (l.column_parallel) {
      const PlainLayerGemms g = plain_layer_gemms(l, r);
      gemm(lp.name, "backward", "xᵀ @ dY", g.weight_grad);
      if (j > 0) gemm(lp.name, "backward", "dY @ Wᵀ", g.input_grad);
    } else if (l.split_output) {
      matmul(lp.name, "backward", "xᵀ @ all-gathered dY " + shape_text(l.in_compute, r, l.out),
             shapes[1], chosen.weight_grad, l.feature_axis);
      if (j > 0) {
        matmul(lp.name, "backward", "all-gathered dY @ Wᵀ " + shape_text(r, l.out, l.in_compute),
               shapes[2], chosen.input_grad, l.feature_axis);
      }
    } else {
      const PlainLayerGemms g = plain_layer_gemms(l, r);
      gemm(lp.name, "backward", "xᵀ @ dY", g.weight_grad);
      if (j > 0) gemm(lp.name, "backward", "dY @ Wᵀ", g.input_grad);
    }
    if (j > 0 && (l.slices_input() || l.gathers_input())) {
      memory(lp.name, "backward", "input gradient copy", 2 * kFloat * r * l.in_compute);
    }
    for (const auto& c : lp.collectives) {
      const bool done =
          c.phase == "forward" || c.operand == "weight" ||
          (l.split_output && c.operand == "output gradient") ||
          (l.column_gathers_input() && (c.operand == "input" || c.operand == "input gradient"));
      if (done) continue;
      const bool gradient = c.operand == "weight gradient" || c.operand == "bias gradient";
      // Deferred to the end of the step (once, not per micro-batch) with accumulation; and
      // reduce-scattered there under ZeRO-1.
      const bool deferred = zero1 || cost.accumulation_steps > 1;
      if (deferred && l.defers_reduction() && gradient && c.kind == CollectiveKind::all_reduce) {
        deferred_reductions.push_back({lp.name, c});
        continue;
      }
      if (options.gradient_bucket_mb > 0 && l.defers_reduction() && gradient &&
          c.kind == CollectiveKind::all_reduce) {
        add_to_bucket(lp.name, c);
        continue;
      }
      collective(lp.name, c);
    }
    if (l.nonbatch_replication > 1) {
      memory(lp.name, "backward", "gradient scale",
             2.0 * options.bytes_per_element * l.stored_rows * l.stored_cols);
    }
    memory(lp.name, "backward", "bias gradient", kFloat * r * l.out_local);
    // A SwiGLU's gate (the layer before its value): the input gradients of gate and value
    // summed (read 2, write 1) over the input as it arrives.
    if (j > 0 && j + 1 < count && plan.layers[j + 1].output_op == LayerOutputOp::swiglu) {
      memory(lp.name, "backward", "SwiGLU input gradients summed (read 2, write 1)",
             3 * kFloat * r * l.input_width());
    }
  }
  // Bucketed gradients (options.gradient_bucket_mb: a DLRM's linear layers, layers/dlrm.cpp):
  // waited for at the end of backward, one all-reduce per bucket, cut as
  // layers/gradient_buckets.cpp cuts them (gradient_bucket_elements): one item per run of
  // gradients over the same group, its buckets full but the last.
  for (size_t first = 0; first < bucketed.size();) {
    size_t end = first + 1;
    while (end < bucketed.size() && bucketed[end].axes == bucketed[first].axes) ++end;
    std::vector<GradientBucketRun> run;
    std::vector<std::string> layers;
    for (size_t g = first; g < end; ++g) {
      run.push_back({bucketed[g].axes, bucketed[g].elements});
      if (layers.empty() || layers.back() != bucketed[g].layer) layers.push_back(bucketed[g].layer);
    }
    const BucketedGradient& b = bucketed[first];
    const LinkProfile link = hw.group_link(b.axes);
    double seconds = 0.0;
    const std::vector<GradientBucketRun> buckets =
        gradient_bucket_elements(run, options.gradient_bucket_mb);
    for (const GradientBucketRun& bucket : buckets) {
      seconds +=
          collective_seconds(CollectiveKind::all_reduce,
                             static_cast<double>(bucket.elements) * b.element_bytes, b.ranks, link);
    }
    std::ostringstream what;
    what << "all-reduce gradients in " << buckets.size() << " bucket"
         << (buckets.size() == 1 ? "" : "s") << " (" << end - first << " gradients of "
         << layers.size() << " layers: " << join(layers) << ")";
    if (!buckets.empty()) {
      add("gradient buckets", "backward", "collective", what.str(), group_text(b.axes, mesh),
          seconds);
    }
    first = end;
  }
  // The prefetched gathers: the part the compute between start and wait hides (the other
  // communication in between runs on the same links and hides nothing).
  for (const Prefetch& p : prefetches) {
    double window = 0.0;
    for (size_t k = p.start; k < p.gather; ++k) {
      if (cost.items[k].category != std::string("collective")) window += cost.items[k].seconds;
    }
    CostItem& g = cost.items[p.gather];
    const double hideable = std::min(window, g.seconds);
    const double hidden = hw.overlap * hideable;
    std::ostringstream what;
    what << " (prefetched under " << p.under << ": " << static_cast<int>(100 * hw.overlap + 0.5)
         << "% of " << static_cast<int>(1e6 * hideable + 0.5) << " us hidden)";
    g.what += what.str();
    g.seconds -= hidden;
    cost.overlap_hidden_s += hidden * cost.accumulation_steps;
    cost.full_overlap_hidden_s += hideable * cost.accumulation_steps;
  }
  if (cost.accumulation_steps > 1) {
    memory("optimizer", "update", "gradient sum", 3.0 * plan.totals.gradient_bytes);
  }
  // Per micro-batch so far; the optimizer once per step.
  const size_t per_micro = cost.items.size();
  double updated_bytes = static_cast<double>(plan.totals.parameter_bytes);
  if (options.sparse_tables) {
    // Every table's touched rows are updated by the sparse optimizer, not this pass (its cost
    // is not charged: a few rows per id): table-wise tables too. Their share of the plan's
    // parameter bytes is what the other tensors do not account for (the most loaded member of
    // each group, as in the ZeRO-1 branch below); a table-wise entry is only allowed on a table
    // (planner.cpp), so that share is all tables.
    double table_wise_share = static_cast<double>(plan.totals.parameter_bytes);
    for (const ParameterPlan& p : plan.parameters) {
      if (p.spec.table_entry() < 0) table_wise_share -= static_cast<double>(p.bytes_per_rank);
    }
    updated_bytes -= table_wise_share;
    for (const ParameterPlan& p : plan.parameters) {
      if (is_embedding_weight_name(p.name) && p.spec.table_entry() < 0) {
        updated_bytes -= static_cast<double>(p.bytes_per_rank);
      }
    }
  }
  if (!zero1) {
    // Gradient accumulation: the layers with DP storage all-reduce the sum of their
    // micro-batches' gradients once, in apply_update.
    for (auto& [layer, c] : deferred_reductions) {
      c.operand += " (once per step)";
      c.phase = "update";
      collective(layer, c);
    }
  }
  if (zero1) {
    // ZeRO-1 (framework/train/zero1.hpp): the deferred gradient all-reduces over dp become
    // reduce-scatters, the update runs on this rank's chunk of every tensor not split over
    // dp, and each such tensor's chunk is copied out and all-gathered over dp afterwards.
    for (auto& [layer, c] : deferred_reductions) {
      if (c.axes == std::vector<std::string>{kZeroAxis}) c.kind = CollectiveKind::reduce_scatter;
      c.operand += " (ZeRO-1)";
      c.phase = "update";
      collective(layer, c);
    }
    const int64_t dp = mesh.size_of({kZeroAxis});
    // Table-wise tensors are not split (zero1_splits): their share of the plan's parameter
    // bytes (the most loaded member of each group), not every table's holder bytes.
    updated_bytes = static_cast<double>(plan.totals.parameter_bytes);
    for (const ParameterPlan& p : plan.parameters) {
      if (p.spec.table_entry() < 0) updated_bytes -= static_cast<double>(p.bytes_per_rank);
    }
    for (const ParameterPlan& p : plan.parameters) {
      if (p.spec.table_entry() >= 0) continue;
      const double bytes = static_cast<double>(p.bytes_per_rank);
      if (!zero1_splits(p.local_shape.size(), p.spec, dp) || p.local_shape[0] <= 0) {
        updated_bytes += bytes;
        continue;
      }
      const double chunk = bytes / p.local_shape[0] * zero1_chunk_rows(p.local_shape[0], dp);
      updated_bytes += chunk;
      memory("optimizer", "update", "ZeRO-1 chunk copy " + p.name, 2 * chunk);
      add("optimizer", "update", "collective", "all-gather " + p.name + " (ZeRO-1)",
          group_text({kZeroAxis}, mesh),
          collective_seconds(CollectiveKind::all_gather, chunk * dp, static_cast<int>(dp),
                             hw.group_link({kZeroAxis})));
    }
  }
  memory("optimizer", "update",
         "optimizer step (" + std::to_string(3 + 2 * options.optimizer_slots) +
             " passes over the parameters" + (zero1 ? ", this rank's ZeRO-1 chunks" : "") + ")",
         static_cast<double>(3 + 2 * options.optimizer_slots) * updated_bytes);
  for (size_t k = 0; k < cost.items.size(); ++k) {
    const CostItem& item = cost.items[k];
    const double t = item.seconds * (k < per_micro ? cost.accumulation_steps : 1);
    if (item.category == std::string("gemm")) {
      cost.gemm_s += t;
    } else if (item.category == std::string("collective")) {
      cost.collective_s += t;
    } else if (item.category == std::string("collective matmul")) {
      cost.collective_matmul_s += t;
    } else {
      cost.memory_s += t;
    }
  }
  cost.total_s = cost.gemm_s + cost.collective_s + cost.collective_matmul_s + cost.memory_s;
  cost.serial_s = cost.total_s + cost.overlap_hidden_s;
  cost.full_overlap_s = cost.serial_s - cost.full_overlap_hidden_s;
  return cost;
}

double data_read_seconds(const DataRead& read, const HardwareProfile& hw) {
  const double rows = static_cast<double>(read.rows);
  const double bytes = rows * static_cast<double>(read.row_bytes);
  if (read.tables > 0) {
    // Not read.pattern: the rows' order is in hdf5_row_seconds (measured on the config's
    // data.shuffle), the chunks cached (cost_model.hpp).
    const double row_tables = rows * static_cast<double>(read.tables);
    const double ids = rows * static_cast<double>(read.ids_per_row);
    // Not measured (sparse_row_seconds 0): a 64-byte line per offset and id.
    const bool measured = hw.sparse_row_seconds > 0.0;
    const double per_row_table = measured ? hw.sparse_row_seconds : 128.0 / hw.memory_bandwidth;
    const double per_id = measured ? hw.sparse_id_seconds : 64.0 / hw.memory_bandwidth;
    return rows * hw.hdf5_row_seconds + row_tables * per_row_table + ids * per_id +
           2.0 * bytes / hw.memory_bandwidth;
  }
  switch (read.pattern) {
    case ReadPattern::memory:
      return 2.0 * bytes / hw.memory_bandwidth;  // read and written once
    case ReadPattern::sequential:
      return hw.storage_read_latency + bytes / hw.storage_read_bandwidth;
    case ReadPattern::random_rows: {
      const double page = std::max<double>(4096.0, static_cast<double>(read.row_bytes));
      return rows * (hw.storage_read_latency + page / hw.storage_read_bandwidth);
    }
    case ReadPattern::blocks: {
      const double global_bytes =
          static_cast<double>(read.global_rows) * static_cast<double>(read.row_bytes);
      const double blocks_started = static_cast<double>(read.global_rows) /
                                    static_cast<double>(std::max<int64_t>(read.block_rows, 1));
      return blocks_started * hw.storage_read_latency + global_bytes / hw.storage_read_bandwidth;
    }
  }
  return 0.0;
}

double data_agree_seconds(const DataRead& read, const HardwareProfile& hw) {
  if (read.tables <= 0 || read.agree_ranks <= 1) return 0.0;
  return collective_seconds(CollectiveKind::all_reduce, 5.0 * 8.0, read.agree_ranks,
                            hw.group_link(read.agree_axes));
}

void add_data_read(StepCost& cost, const DataRead& read, const HardwareProfile& hw) {
  const double read_s = data_read_seconds(read, hw);
  const double agree_s = data_agree_seconds(read, hw);
  cost.data_read_s = read_s + agree_s;
  cost.data_agree_s = agree_s;
  const double rest = cost.total_s;
  cost.data_exposed_s = (read.prefetch > 0 ? std::max(0.0, read_s - rest) : read_s) + agree_s;
  cost.total_s += cost.data_exposed_s;
  cost.serial_s += cost.data_exposed_s;
  cost.full_overlap_s += cost.data_exposed_s;
}

}  // namespace meshtrain
