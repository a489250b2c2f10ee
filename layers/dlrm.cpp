#include "layers/dlrm.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/observe/trace.hpp"
#include "partition/embedding_layout.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

namespace {

// The kernels are free functions: nvcc rejects a device lambda inside a private member.

// to(r, first + c) = from(r, c) for every column c of `from`.
void place_columns(MatrixView from, MatrixView to, int64_t first) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::dlrm_place_features"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0},
          {static_cast<int64_t>(from.extent(0)), static_cast<int64_t>(from.extent(1))}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t c) { to(r, first + c) = from(r, c); });
}

// to(r, c) = from(r, first + c) for every column c of `to`.
void take_columns(MatrixView from, MatrixView to, int64_t first) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::dlrm_take_features"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0},
          {static_cast<int64_t>(to.extent(0)), static_cast<int64_t>(to.extent(1))}),
      KOKKOS_LAMBDA(const int64_t r, const int64_t c) { to(r, c) = from(r, first + c); });
}

}  // namespace

// dot: out = [z, F_i . F_j for i = 1 .. blocks-1, j < i] from the features [z, e_1, ..] (each
// d wide), one row per thread, the pairs in that order.
void dlrm_dot_interaction(MatrixView features, MatrixView out, int64_t d, int64_t blocks) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::dlrm_dot"), device_range(0, static_cast<int64_t>(out.extent(0))),
      KOKKOS_LAMBDA(const int64_t r) {
        for (int64_t c = 0; c < d; ++c) out(r, c) = features(r, c);
        int64_t column = d;
        for (int64_t i = 1; i < blocks; ++i) {
          for (int64_t j = 0; j < i; ++j) {
            float sum = 0.0f;
            for (int64_t k = 0; k < d; ++k) sum += features(r, i * d + k) * features(r, j * d + k);
            out(r, column++) = sum;
          }
        }
      });
}

// Its backward: d/dF_i of F_i . F_j is F_j and d/dF_j is F_i; per row, the pairs in forward's
// order, z's own columns passed through.
void dlrm_dot_interaction_backward(MatrixView features, MatrixView g, MatrixView grads, int64_t d,
                                   int64_t blocks) {
  const int64_t width = static_cast<int64_t>(grads.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::dlrm_dot_backward"),
      device_range(0, static_cast<int64_t>(grads.extent(0))), KOKKOS_LAMBDA(const int64_t r) {
        for (int64_t c = 0; c < width; ++c) grads(r, c) = c < d ? g(r, c) : 0.0f;
        int64_t column = d;
        for (int64_t i = 1; i < blocks; ++i) {
          for (int64_t j = 0; j < i; ++j) {
            const float gp = g(r, column++);
            for (int64_t k = 0; k < d; ++k) {
              grads(r, i * d + k) += gp * features(r, j * d + k);
              grads(r, j * d + k) += gp * features(r, i * d + k);
            }
          }
        }
      });
}

Dlrm::Dlrm(const DlrmShape& shape, Activation activation, const SpecLookup& spec_of,
           ParallelContext& context, int64_t local_rows, int64_t max_ids,
           TableGradients table_gradients)
    : shape_(shape), rows_(local_rows), table_gradients_(table_gradients) {
  check_dlrm_shape(shape);
  if (shape.table_dtype == Dtype::fp16) {
    MESHTRAIN_BAD_INPUT("dlrm tables are stored as fp32 or bf16, not fp16 (model.table_dtype)");
  }
  if (shape.table_dtype == Dtype::bf16 && table_gradients == TableGradients::dense) {
    // The dense optimizer sizes its state from each parameter's fp32 block, which a bf16 table
    // does not have: the table would never train.
    MESHTRAIN_BAD_INPUT(
        "dlrm tables stored as bf16 (model.table_dtype = \"bf16\") are updated by the sparse "
        "optimizers only, not with dense table gradients (optimizer.embeddings = \"dense\")");
  }
  if (rows_ < 1) MESHTRAIN_BAD_INPUT("the local batch must have at least one row, got ", rows_);
  if (context.precision().param != Dtype::fp32) {
    MESHTRAIN_BAD_INPUT("dlrm computes in fp32 only; this run asks for ",
                        to_string(context.precision().param),
                        " (mixed_precision.param_dtype = \"fp32\")");
  }
  if (context.precision().reduce != Dtype::fp32) {
    // The linear layers' buckets and the tables' packed sums add in fp32: a 16-bit reduce
    // dtype would sum the layers that reduce their own (FSDP) differently from the bucketed ones.
    MESHTRAIN_BAD_INPUT("dlrm sums its gradients in fp32 only; this run asks for ",
                        to_string(context.precision().reduce),
                        " (mixed_precision.reduce_dtype = \"fp32\")");
  }
  const Mesh& mesh = context.mesh();
  size_t table_index = 0;
  for (const ParameterShape& p : dlrm_parameter_shapes(shape)) {
    const PartitionSpec spec = spec_of(p.name);
    if (is_embedding_weight_name(p.name)) {
      // A table's spec is refused naming the table (e.g. a column split of a dim it does not
      // divide) before the generic divisibility check below names only the parameter.
      embedding_layout(shape.tables[table_index++].name, {p.name, p.shape, spec}, mesh,
                       LayerAxes{context.batch_axes(), context.feature_axis()});
    }
    spec.check_axes(mesh, p.name);
    check_divisible(p.shape, spec, mesh, p.name);
    const bool bf16_table = shape.table_dtype == Dtype::bf16 && is_embedding_weight_name(p.name);
    params_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank(),
                                              bf16_table ? Dtype::bf16 : Dtype::fp32));
    if (table_gradients != TableGradients::dense && is_embedding_weight_name(p.name)) {
      // Sparse updates: a table's backward leaves the gradients of the rows it touched
      // (EmbeddingBag::use_sparse_gradient) and never its dense gradient, so none is allocated;
      // a model that only predicts (none) has no backward. The tensor keeps its name and spec,
      // and its box and `local` are empty (matrix() is [0, 0]), so nothing reads a block that
      // is not there.
      ShardedTensor g;
      g.name = p.name;
      g.global_shape = p.shape;
      g.spec = spec;
      g.box = shard_box(p.shape, spec, mesh, context.rank());
      std::fill(g.box.extent.begin(), g.box.extent.end(), int64_t{0});
      grads_.push_back(std::move(g));
    } else {
      grads_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
    }
  }
  size_t param = 0;
  auto next = [this, &param]() {
    const size_t p = param++;
    return ParameterRef{&params_[p], &grads_[p]};
  };
  auto build_mlp = [&](const std::string& prefix, const std::vector<int64_t>& sizes,
                       bool activate_last, std::vector<Linear>& linear,
                       std::vector<ActivationLayer>& activations) {
    const size_t n = sizes.size() - 1;
    linear.reserve(n);
    activations.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const ParameterRef weight = next();
      const ParameterRef bias = next();
      linear.emplace_back(weight, bias, FeatureLayout::replicated, rows_, context);
      if (linear.back().output_layout() != FeatureLayout::replicated) {
        MESHTRAIN_BAD_INPUT(prefix, "/", i, ": dlrm needs every linear layer's output whole on ",
                            "each rank, but the specs of ", weight.value->name, " (",
                            weight.value->spec.to_string(),
                            ") split it over the feature axis; use a rule without tp for it");
      }
      if (i + 1 < n || activate_last) {
        activations.emplace_back(activation, prefix + "/" + std::to_string(i) + "/activation",
                                 rows_, sizes[i + 1], FeatureLayout::replicated, 0, Dtype::fp32);
      }
    }
  };
  build_mlp("bottom", shape.bottom, /*activate_last=*/true, bottom_, bottom_act_);
  tables_.reserve(shape.tables.size());
  for (const DlrmTable& t : shape.tables) {
    tables_.emplace_back(t.name, next(), t.pooling, rows_, max_ids, context, RowExchange::shared);
    if (table_gradients == TableGradients::sparse) {
      tables_.back().use_sparse_gradient(context, /*bucketed=*/true);
    }
  }
  build_mlp("top", shape.top, /*activate_last=*/false, top_, top_act_);
  MESHTRAIN_REQUIRE(param == params_.size(), "dlrm took ", param, " of ", params_.size(),
                    " parameters");
  if (table_gradients != TableGradients::none) {
    std::vector<Layer*> sequence;
    for (Linear& l : bottom_) sequence.push_back(&l);
    for (Linear& l : top_) sequence.push_back(&l);
    dense_plan_ = GradientReductionPlan(sequence);
    // Bucketed whatever runtime.overlap says (one all-reduce waited for at the end of backward
    // is fewer collectives either way), cut at runtime.bucket_mb.
    dense_buckets_ = GradientBuckets(dense_plan_.bucket_gradients(), context.bucket_mb());
  }
  // The tables that exchange rows, one exchange per communicator (in table order, the same on
  // every rank), its buffers made now for every table's capacity.
  for (size_t t = 0; t < tables_.size(); ++t) {
    EmbeddingBag& table = tables_[t];
    if (!table.exchanges_rows()) continue;
    auto same = std::find_if(row_groups_.begin(), row_groups_.end(), [&](const RowGroup& g) {
      return g.members.front()->row_comm() == table.row_comm();
    });
    if (same == row_groups_.end()) {
      row_groups_.emplace_back();
      same = row_groups_.end() - 1;
    }
    same->tables.push_back(t);
    same->members.push_back(&table);
  }
  for (RowGroup& g : row_groups_) {
    g.exchange = std::make_unique<EmbeddingExchange>(g.members);
    g.bags.assign(g.members.size(), SparseBags{});
  }
  table_bucket_.assign(tables_.size(), -1);
  for (size_t t = 0; t < tables_.size(); ++t) {
    const EmbeddingBag& table = tables_[t];
    if (!table.bucketed()) continue;
    // One group per communicator (two axes lists of the same ranks share it).
    auto same =
        std::find_if(sparse_buckets_.begin(), sparse_buckets_.end(),
                     [&](const SparseBucket& b) { return b.comm == table.gradient_comm(); });
    if (same == sparse_buckets_.end()) {
      sparse_buckets_.emplace_back();
      same = sparse_buckets_.end() - 1;
      same->axes = table.gradient_axes();
      same->comm = table.gradient_comm();
    }
    table_bucket_[t] = static_cast<int>(same - sparse_buckets_.begin());
    same->tables.push_back(t);
    same->at.push_back(same->rank_rows);
    same->rank_rows += table.touched_message_rows();
  }
  for (SparseBucket& b : sparse_buckets_) {
    int64_t floats = 0;
    for (size_t t : b.tables) floats += tables_[t].gradient_capacity();
    const std::string axes = join(b.axes, "_");
    const std::string prefix = "dlrm/sparse_bucket_" + axes + "_";
    const int64_t n = b.comm->size();
    // Every count below becomes an int in the communicator: checked here, once, for the
    // largest a step can send. The batch size and the tables' ids and dims set them: bad input.
    if (n * b.rank_rows * 2 > std::numeric_limits<int>::max() ||
        floats > std::numeric_limits<int>::max()) {
      MESHTRAIN_BAD_INPUT("dlrm: the tables summed over (", join(b.axes), ") exchange ",
                          n * b.rank_rows * 2, " values of touched rows and ", floats,
                          " floats of compact gradients a step, more than an MPI count holds (",
                          std::numeric_limits<int>::max(),
                          "); lower data.batch_size or shard more of model.tables row-wise");
    }
    b.send = Matrix(prefix + "touched_send", static_cast<size_t>(b.rank_rows), 2);
    b.recv = Matrix(prefix + "touched_recv", static_cast<size_t>(n * b.rank_rows), 2);
    b.send_host = host_mirror(b.send);
    b.recv_host = host_mirror(b.recv);
    b.grads = Vector(prefix + "grads", static_cast<size_t>(floats));
    const size_t gathered = b.recv.size() * sizeof(float);
    b.comm->reserve_staging(gathered, gathered);
    const size_t grads = static_cast<size_t>(floats) * sizeof(float);
    b.comm->reserve_staging(grads, grads);
    b.comm->reserve_reductions(static_cast<size_t>(floats));
  }

  LayerScratchNeeds needs;
  for (const Linear& l : bottom_) needs.merge(l.scratch_needs());
  for (const Linear& l : top_) needs.merge(l.scratch_needs());
  scratch_ = LayerScratch(needs, false);

  width_d_ = shape.bottom.back();
  feature_width_ = width_d_;
  block_first_.assign(shape.tables.size() + 1, 0);
  for (size_t t = 0; t < shape.tables.size(); ++t) {
    block_first_[t + 1] = feature_width_;
    feature_width_ += shape.tables[t].dim;
    if (table_gradients != TableGradients::none) {
      table_grads_.emplace_back("dlrm/" + shape.tables[t].name + "/pooled_grad", rows_,
                                shape.tables[t].dim);
    }
  }
  features_ = Matrix("dlrm/features", rows_, feature_width_);
  top_input_ = Matrix("dlrm/interaction", rows_, shape.top.front());
  if (table_gradients != TableGradients::none) {
    feature_grads_ = Matrix("dlrm/feature_grads", rows_, feature_width_);
    dz_ = Matrix("dlrm/bottom_output_grad", rows_, width_d_);
  }
}

std::vector<ShardedTensor> Dlrm::dense_parameters() const {
  std::vector<ShardedTensor> dense;
  for (const ShardedTensor& p : params_) {
    if (!is_embedding_weight_name(p.name)) dense.push_back(p);
  }
  return dense;
}

std::vector<ShardedTensor> Dlrm::dense_gradients() const {
  std::vector<ShardedTensor> dense;
  for (const ShardedTensor& g : grads_) {
    if (!is_embedding_weight_name(g.name)) dense.push_back(g);
  }
  return dense;
}

void Dlrm::initialize(InitScheme scheme, uint64_t seed) {
  size_t table = 0;
  for (ShardedTensor& p : params_) {
    if (!is_embedding_weight_name(p.name)) {
      meshtrain::initialize(p, scheme, seed);
      continue;
    }
    // DLRM's tables: uniform in [-sqrt(1 / rows), sqrt(1 / rows)), by global index.
    const int64_t rows = shape_.tables[table++].rows;
    const double bound = std::sqrt(1.0 / static_cast<double>(rows));
    const uint64_t stream = name_stream(p.name);
    // Element (r, c) of the block is global (first row + r, first column + c): a column slice
    // gets the same values as those columns of a whole table.
    // A bf16 table holds each value rounded to the nearest bf16 (as keep_tables_in_bf16 rounds
    // an fp32 one: the same values either way).
    const int64_t dim = p.global_shape[1];
    const int64_t columns = p.box.extent[1];
    const auto value = [&](int64_t i) {
      const int64_t global = (p.box.offset[0] + i / columns) * dim + p.box.offset[1] + i % columns;
      const double u = counter_uniform(seed, stream, static_cast<uint64_t>(global));
      return static_cast<float>((2.0 * u - 1.0) * bound);
    };
    if (p.stored_16bit()) {
      auto h = Kokkos::create_mirror_view(p.bits);
      for (int64_t i = 0; i < static_cast<int64_t>(h.extent(0)); ++i) {
        h(i) = float_to_bf16(value(i));
      }
      Kokkos::deep_copy(p.bits, h);
      continue;
    }
    auto h = Kokkos::create_mirror_view(p.local);
    for (int64_t i = 0; i < static_cast<int64_t>(h.extent(0)); ++i) h(i) = value(i);
    Kokkos::deep_copy(p.local, h);
  }
}

void Dlrm::interact() {
  // The features side by side: z (the bottom's output), then each table's pooled rows.
  place_columns(bottom_act_.back().output(), features_, 0);
  for (size_t t = 0; t < tables_.size(); ++t) {
    place_columns(tables_[t].output(), features_, block_first_[t + 1]);
  }
  if (shape_.interaction == DlrmInteraction::cat) {
    take_columns(features_, top_input_, 0);
  } else {
    dlrm_dot_interaction(features_, top_input_, width_d_, static_cast<int64_t>(tables_.size()) + 1);
  }
}

void Dlrm::interact_backward(MatrixView top_input_grad) {
  if (shape_.interaction == DlrmInteraction::cat) {
    take_columns(top_input_grad, feature_grads_, 0);
  } else {
    dlrm_dot_interaction_backward(features_, top_input_grad, feature_grads_, width_d_,
                                  static_cast<int64_t>(tables_.size()) + 1);
  }
  // Each block's gradient into its own buffer (the layers below take whole matrices).
  take_columns(feature_grads_, dz_, 0);
  for (size_t t = 0; t < tables_.size(); ++t) {
    take_columns(feature_grads_, table_grads_[t], block_first_[t + 1]);
  }
}

MatrixView Dlrm::forward(MatrixView dense, const std::vector<SparseBags>& bags) {
  MESHTRAIN_REQUIRE(bags.size() == tables_.size(), "dlrm forward: ", bags.size(),
                    " bag batches for ", tables_.size(), " tables");
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dense.extent(0)) == rows_ &&
                        static_cast<int64_t>(dense.extent(1)) == shape_.bottom.front(),
                    "dlrm dense input is [", dense.extent(0), ", ", dense.extent(1),
                    "], expected [", rows_, ", ", shape_.bottom.front(), "]");
  LayerPass pass;
  pass.scratch = &scratch_;
  MatrixView x = dense;
  // Traced ([runtime] trace_steps) by part: the bottom MLP, the tables (their lookups, pooling
  // and all-to-alls), the interaction, the top MLP.
  {
    TraceSpan span("bottom mlp", TraceKind::layer);
    span.detail("forward");
    for (size_t i = 0; i < bottom_.size(); ++i) {
      x = bottom_[i].forward(x, pass);
      x = bottom_act_[i].forward(x, pass);
    }
  }
  {
    TraceSpan span("embeddings", TraceKind::layer);
    span.detail("forward");
    // The tables that exchange no rows (replicated, column-wise) in table order, then each
    // group of those that do: its 3 all-to-alls for all its tables.
    for (size_t t = 0; t < tables_.size(); ++t) {
      if (!tables_[t].exchanges_rows()) tables_[t].forward(bags[t], pass);
    }
    for (RowGroup& g : row_groups_) {
      for (size_t k = 0; k < g.tables.size(); ++k) g.bags[k] = bags[g.tables[k]];
      g.exchange->forward(g.members.data(), g.bags.data());
    }
  }
  {
    TraceSpan span("interaction", TraceKind::layer);
    span.detail("forward");
    interact();
  }
  {
    TraceSpan span("top mlp", TraceKind::layer);
    span.detail("forward");
    x = top_input_;
    for (size_t i = 0; i < top_.size(); ++i) {
      x = top_[i].forward(x, pass);
      if (i < top_act_.size()) x = top_act_[i].forward(x, pass);
    }
  }
  logits_ = x;
  return logits_;
}

void Dlrm::backward(MatrixView output_grad) {
  MESHTRAIN_REQUIRE(table_gradients_ != TableGradients::none,
                    "dlrm backward: the model was built for prediction only "
                    "(TableGradients::none) and has no gradients");
  MESHTRAIN_REQUIRE(
      static_cast<int64_t>(output_grad.extent(0)) == rows_ && output_grad.extent(1) == 1,
      "dlrm output gradient is [", output_grad.extent(0), ", ", output_grad.extent(1),
      "], expected [", rows_, ", 1]");
  // The linear layers the plan defers report to the buckets (one all-reduce, waited for at the
  // end); the others, and the tables, reduce their own.
  LayerPass pass;
  pass.scratch = &scratch_;
  const bool buckets = !dense_buckets_.empty();
  LayerPass linear_pass = pass;
  if (buckets) linear_pass.buckets = &dense_buckets_;
  const auto linear = [&](size_t k) {
    linear_pass.index = k;
    linear_pass.deferred =
        buckets ? dense_plan_.for_layer(k, DeferredReduction::in_buckets) : DeferredReduction::now;
    return linear_pass;
  };
  MatrixView g = output_grad;
  {
    TraceSpan span("top mlp", TraceKind::layer);
    span.detail("backward");
    for (size_t i = top_.size(); i-- > 0;) {
      if (i < top_act_.size()) g = top_act_[i].backward(g, true, pass);
      g = top_[i].backward(g, /*need_input_grad=*/true, linear(bottom_.size() + i));
    }
  }
  {
    TraceSpan span("interaction", TraceKind::layer);
    span.detail("backward");
    interact_backward(g);
  }
  {
    // The dy all-to-alls and the gradient scatter (or the touched rows' gradient).
    TraceSpan span("embeddings", TraceKind::layer);
    span.detail("backward");
    backward_tables(pass);
  }
  g = dz_;
  TraceSpan span("bottom mlp", TraceKind::layer);
  span.detail("backward");
  for (size_t i = bottom_.size(); i-- > 0;) {
    g = bottom_act_[i].backward(g, true, pass);
    g = bottom_[i].backward(g, /*need_input_grad=*/i > 0, linear(i));
  }
  if (buckets) dense_buckets_.wait_all();
}

void Dlrm::backward_tables(const LayerPass& pass) {
  // Every table's dy checked (its columns taken) and the dy of the parts the row-exchanging
  // tables sent into their exchange's message; one all-to-all-v per row group.
  for (size_t t = 0; t < tables_.size(); ++t) tables_[t].backward_begin(table_grads_[t]);
  for (RowGroup& g : row_groups_) g.exchange->exchange_dy();
  if (sparse_buckets_.empty()) {
    for (size_t t = 0; t < tables_.size(); ++t) tables_[t].backward_end(pass);
    return;
  }
  // The bucketed tables' touched rows, one all-gather per group (local work first) ...
  for (SparseBucket& b : sparse_buckets_) {
    for (size_t k = 0; k < b.tables.size(); ++k) {
      tables_[b.tables[k]].backward_sparse_touch(b.send_host, b.at[k]);
    }
    copy_view(b.send, b.send_host);
    b.comm->all_gather(b.send, b.recv, 0);
    copy_view(b.recv_host, b.recv);
    // ... and their union.
    for (size_t k = 0; k < b.tables.size(); ++k) {
      tables_[b.tables[k]].backward_sparse_union(b.recv_host, b.rank_rows, b.at[k]);
    }
  }
  // Every table in table order (the others' collectives come in the same order on every rank),
  // the bucketed ones' compact gradients side by side in their group's buffer ...
  for (SparseBucket& b : sparse_buckets_) b.used = 0;
  for (size_t t = 0; t < tables_.size(); ++t) {
    EmbeddingBag& table = tables_[t];
    if (!table.bucketed()) {
      table.backward_end(pass);
      continue;
    }
    SparseBucket& b = sparse_buckets_[static_cast<size_t>(table_bucket_[t])];
    const int64_t floats = table.touched_count() * table.local_dim();
    MESHTRAIN_REQUIRE(b.used + floats <= static_cast<int64_t>(b.grads.extent(0)), "dlrm: table '",
                      table.table(), "' touched more rows than its bucket holds");
    table.backward_sparse_finish(b.grads.data() + b.used);
    b.used += floats;
  }
  // ... then summed, one all-reduce per group.
  for (SparseBucket& b : sparse_buckets_) {
    if (b.used > 0) b.comm->all_reduce(VectorView(b.grads.data(), static_cast<size_t>(b.used)));
  }
}

int64_t Dlrm::reduction_buffer_bytes() const {
  int64_t bytes = static_cast<int64_t>(dense_buckets_.buffer_bytes());
  for (const SparseBucket& b : sparse_buckets_) {
    bytes += static_cast<int64_t>((b.send.size() + b.recv.size() + b.grads.size()) * sizeof(float));
  }
  return bytes;
}

std::vector<std::string> Dlrm::describe() const {
  std::vector<std::string> lines;
  for (const Linear& l : bottom_) lines.push_back(l.describe());
  for (const EmbeddingBag& t : tables_) lines.push_back(t.describe());
  lines.push_back(std::string("interaction ") + to_string(shape_.interaction) + ": " +
                  std::to_string(feature_width_) + " features -> " +
                  std::to_string(shape_.top.front()));
  for (const Linear& l : top_) lines.push_back(l.describe());
  return lines;
}

}  // namespace meshtrain
