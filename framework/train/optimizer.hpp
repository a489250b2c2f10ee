#pragma once
// Optimizers over sharded parameters, and global-norm gradient clipping.
//
// Each state tensor is a ShardedTensor with exactly its parameter's name, spec and box, so
// it is stored, checkpointed and resharded like the parameter. All state is allocated at
// construction; step() allocates nothing.
//
//   sgd:   momentum buffer b (slot "momentum"); with weight_decay wd (coupled, L2 as in
//          torch.optim.SGD): g' = g + wd * p;  b = momentum * b + g' (b = g' on the first
//          step);  p -= lr * b.  momentum = 0 is plain SGD, p -= lr * g', with no slot (as
//          plan_options() counts it: the plan's memory is what training allocates).
//   adamw: slots "m" and "v" (torch.optim.AdamW): p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;
//          v = b2 v + (1 - b2) g^2;  p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// The step counter t (after step() it is the number of steps taken) is checkpointed too.
// A parameter with a 16-bit compute copy (ShardedTensor::copy_16bit, mixed precision's 16-bit
// storage) gets round_P(new p) written into it in the same pass, and the copy marked current.

#include <cstdint>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/core/choices.hpp"  // OptimizerKind, its names
#include "framework/core/sharded_tensor.hpp"
#include "framework/core/views.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

struct OptimizerSettings {
  OptimizerKind kind = OptimizerKind::adamw;
  float momentum = 0.9f;  // sgd
  float beta1 = 0.9f;     // adamw
  float beta2 = 0.999f;   // adamw
  float eps = 1e-8f;      // adamw
  float weight_decay = 0.0f;
};

// The state slots of an optimizer: {"m", "v"} for adamw, {"momentum"} for sgd with
// momentum, none for plain sgd.
std::vector<std::string> optimizer_slot_names(const OptimizerSettings& settings);

class Optimizer {
 public:
  // Allocates the state slots (zero) shaped like `params` (same names, specs, boxes).
  Optimizer(const OptimizerSettings& settings, const std::vector<ShardedTensor>& params);

  // One update of every parameter from its gradient (same order as at construction).
  // Throws a runtime Error if the lists do not match the construction's in size or shape.
  void step(std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads, float lr);

  const OptimizerSettings& settings() const { return settings_; }
  // The slot names: optimizer_slot_names(settings()).
  const std::vector<std::string>& slot_names() const { return slot_names_; }
  // The state tensors of a slot, one per parameter in construction order (checkpoints read
  // and overwrite them in place). Throws bad_input for an unknown slot name.
  std::vector<ShardedTensor>& slot(const std::string& name);
  const std::vector<ShardedTensor>& slot(const std::string& name) const;

  // The same update in two parts, for a step whose device work is captured as a CUDA graph
  // and replayed (framework/core/step_graph.hpp; run/training_run.cpp): prepare_step is the
  // host part (the step count; the rate, the bias corrections and SGD's first-step flag
  // written into pinned host memory), launch_prepared the kernels, which read those values
  // from that memory when they run, so that a replayed graph uses the current step's (one
  // kernel copies the 16 bytes to device memory first, and the update kernels read that copy).
  // The results equal step()'s bit for bit (the same floats, the same arithmetic). Call
  // enable_prepared_steps() once, outside the steps (it allocates the 16 bytes, twice).
  void enable_prepared_steps();
  void prepare_step(float lr);
  void launch_prepared(std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads);

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t steps) { step_count_ = steps; }  // when loading a checkpoint

 private:
  OptimizerSettings settings_;
  std::vector<std::string> slot_names_;
  std::vector<std::vector<ShardedTensor>> slots_;  // [slot][parameter]
  std::vector<ShardedTensor> layout_;              // per parameter: name, shape, spec (no data)
  std::vector<int64_t> local_sizes_;               // per parameter: local elements
  void check_same_layout(size_t i, const ShardedTensor& b, const char* what) const;
  int64_t step_count_ = 0;
  // prepare_step's values: adamw [step size, 1 / correction2, decay, -]; sgd [lr, -, -, first].
  Kokkos::View<float*, HostStagingSpace> prepared_;
  // prepared_ copied into the default memory space at each launch_prepared (one 4-thread
  // kernel, inside a captured region): the update kernels read the scalars there, not from
  // pinned host memory (on a GPU, every thread's read of pinned memory crosses PCIe).
  Kokkos::View<float*> prepared_device_;
  void check_step_arguments(const std::vector<ShardedTensor>& params,
                            const std::vector<ShardedTensor>& grads) const;
  // step()'s and launch_prepared's kernels: the scalars by value or read from prepared_.
  template <class Scalars>
  void launch(std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads,
              const Scalars& scalars);
};

// Global-norm gradient clipping (torch.nn.utils.clip_grad_norm_). The norm counts every
// global element once: a rank adds the squares of a gradient's block only if it is the
// replica with coordinate 0 on every mesh axis the gradient's spec does not name, so a
// block replicated over some axes is counted once. Then ONE all-reduce over the world of
// one double per gradient (in double: the sum of squares is not rounded to float), so
// every rank also knows which gradient made a norm NaN or infinite.
class GradientClipper {
 public:
  // `grads` fixes which blocks this rank counts; mesh and rank are this run's.
  GradientClipper(const Mesh& mesh, int rank, const std::vector<ShardedTensor>& grads);

  // The global L2 norm of all gradients, NaN or infinite when a gradient element is.
  // `world` is the communicator of all ranks.
  double global_norm(const std::vector<ShardedTensor>& grads, Communicator& world);
  // Computes the global norm and, when it exceeds max_norm > 0, scales every gradient by
  // max_norm / (norm + 1e-6). Returns the norm before clipping. A NaN or infinite norm is
  // returned as it is and nothing is scaled: the caller must stop (non_finite_gradient()
  // names the gradient).
  double clip(std::vector<ShardedTensor>& grads, double max_norm, Communicator& world);

  // After a global_norm() that was not finite: the name of the first gradient (in the
  // order of `grads`) whose sum of squares was NaN or infinite; the same on every rank.
  // Empty after a finite norm.
  const std::string& non_finite_gradient() const { return non_finite_; }

 private:
  std::string first_non_finite_gradient() const;  // from the reduced sums in host_

  std::vector<bool> counted_;       // per gradient: does this rank hold the counted replica
  std::vector<std::string> names_;  // per gradient
  Kokkos::View<double*, Kokkos::LayoutRight> buffer_;  // per gradient: its sum of squares
  Kokkos::View<double*, Kokkos::LayoutRight>::HostMirror host_;
  std::string non_finite_;
};

}  // namespace meshtrain
