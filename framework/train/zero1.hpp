#pragma once
// ZeRO-1 (optimizer.zero_stage = 1): parameters stay replicated over dp; the optimizer
// state and the update are split over dp (the rule of partition/zero1_layout.hpp: chunks of rows
// of each block, the last ones shorter or empty when the rows do not divide by dp).
//
// One step, between backward and the next forward:
//   zero1.reduce(grads)            gradient -> this rank's chunk, summed over dp: a
//                                  reduce-scatter where the layer left a partial sum over
//                                  dp, else the chunk of the gradient its layer reduced
//   clip / optimizer.step(zero1.param_chunks(), zero1.grad_chunks(), lr)
//                                  the update of this rank's rows only, in place in the
//                                  parameter's memory
//   zero1.gather(params)           all-gather over dp: every replica gets every chunk
//
// Chunks are ShardedTensors with the parameter's name and global shape, their box in the
// global tensor and the parameter's spec with dp added (minor) to dim 0, so an Optimizer
// built on param_chunks() allocates exactly the split state, and checkpoints store it as the
// same global arrays as plain DP (either loads the other's checkpoints). Tensors that are not
// split (scalars, specs naming dp, table-wise tables) pass through: their chunk is the whole
// block.
// Everything is allocated at construction; reduce() and gather() allocate nothing.

#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

class Zero1 {
 public:
  // `params` and `grads` as the model holds them; partial[i] is the group over which the
  // layer left gradient i a partial sum (nullptr: the layer reduced it). `dp` is the
  // communicator of the dp axis (its rank is this rank's dp coordinate). Gradients are
  // summed in `reduce_dtype` (mixed precision); parameters are gathered in fp32 (masters).
  Zero1(const std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads,
        std::vector<Communicator*> partial, Communicator& dp, Dtype reduce_dtype = Dtype::fp32);

  void reduce(const std::vector<ShardedTensor>& grads);
  void gather(const std::vector<ShardedTensor>& params);

  // This rank's rows of each parameter (views of the parameters' memory) and of its summed
  // gradient (own buffers, or the gradient itself where nothing is split).
  std::vector<ShardedTensor>& param_chunks() { return param_chunks_; }
  std::vector<ShardedTensor>& grad_chunks() { return grad_chunks_; }

 private:
  struct Split {
    bool split = false;
    int64_t row_elements = 0;  // elements per row of the block
    int64_t chunk = 0;         // padded chunk, elements (rows per chunk x row_elements)
    int64_t first = 0;         // first element of this rank's chunk in the block
    int64_t count = 0;         // elements of this rank's chunk (chunk or fewer)
    bool divides = false;      // the block is exactly dp chunks: no padding
  };
  Communicator& dp_;
  Dtype reduce_dtype_ = Dtype::fp32;
  std::vector<Communicator*> partial_;
  std::vector<Split> splits_;
  std::vector<ShardedTensor> param_chunks_;
  std::vector<ShardedTensor> grad_chunks_;
  std::vector<Vector> grad_chunk_storage_;  // per split tensor: the padded chunk
  Vector padded_;      // dp x chunk: a block padded for the reduce-scatter and all-gather
  Vector send_chunk_;  // one padded chunk of parameters for the all-gather
};

}  // namespace meshtrain
