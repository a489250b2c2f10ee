#include "layers/gradient_buckets.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <string>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "partition/gradient_bucket_cap.hpp"

namespace meshtrain {

GradientBuckets::GradientBuckets(const std::vector<LayerGradients>& layers, double bucket_mb,
                                 Dtype wire)
    : wire_(wire) {
  const auto cap = static_cast<std::size_t>(gradient_bucket_cap_elements(bucket_mb));
  buckets_of_layer_.resize(layers.size());
  homes_of_layer_.resize(layers.size());
  const bool sixteen_bit = wire_ != Dtype::fp32;
  std::size_t total = 0;  // every bucket's floats so far: where the next piece begins in wire16_

  // Walk the gradients in the order backward finishes them; open a new bucket when the
  // current one is full or belongs to another communicator.
  for (std::size_t k = layers.size(); k-- > 0;) {
    const LayerGradients& layer = layers[k];
    if (layer.group == nullptr) continue;
    for (VectorView grad : layer.gradients) {
      homes_of_layer_[k].push_back({grad, total});
      total += grad.extent(0);
      for (std::size_t offset = 0; offset < grad.extent(0);) {
        if (buckets_.empty() || buckets_.back().group != layer.group ||
            buckets_.back().floats == cap) {
          const std::size_t start =
              buckets_.empty() ? 0 : buckets_.back().start + buckets_.back().floats;
          buckets_.emplace_back();
          buckets_.back().group = layer.group;
          buckets_.back().start = start;
        }
        Bucket& b = buckets_.back();
        const std::size_t n = std::min(cap - b.floats, grad.extent(0) - offset);
        // A gradient without data (stored as 16 bits in wire16_ itself): pieces without data.
        b.pieces.push_back(
            {VectorView(grad.data() == nullptr ? nullptr : grad.data() + offset, n), b.floats});
        b.floats += n;
        offset += n;
        std::vector<std::size_t>& mine = buckets_of_layer_[k];
        const std::size_t index = buckets_.size() - 1;
        if (mine.empty() || mine.back() != index) {
          mine.push_back(index);
          ++b.layers;
        }
      }
    }
  }
  if (sixteen_bit && total > 0) {
    wire16_ = HalfBits(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::grad_bucket_16bit"), total);
  }
  for (Bucket& b : buckets_) {
    // Every bucket may be in flight at once (started as backward completes it, waited for
    // at the end): its request slot (and fp32 wire: buffer) made now, not in a step.
    b.remaining = b.layers;
    if (sixteen_bit) {
      b.group->reserve_started_16bit_all_reduces(1, b.floats, wire_);
      continue;
    }
    b.group->reserve_started_all_reduces(1, b.floats, wire_);
    if (b.pieces.size() > 1) {
      b.buffer = Vector(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::grad_bucket"),
                        b.floats);
    }
  }
}

std::vector<std::size_t> GradientBuckets::bucket_floats() const {
  std::vector<std::size_t> out;
  for (const Bucket& b : buckets_) out.push_back(b.floats);
  return out;
}

std::size_t GradientBuckets::buffer_bytes() const {
  std::size_t bytes = 0;
  for (const Bucket& b : buckets_) bytes += b.buffer.extent(0) * sizeof(float);
  return bytes + wire16_.extent(0) * sizeof(uint16_t);
}

uint16_t* GradientBuckets::wire_home(std::size_t layer, std::size_t index, const float* gradient,
                                     std::size_t elements) const {
  if (wire16_.data() == nullptr || layer >= homes_of_layer_.size() ||
      index >= homes_of_layer_[layer].size()) {
    return nullptr;
  }
  const Home& home = homes_of_layer_[layer][index];
  if (home.grad.data() != gradient || home.grad.extent(0) != elements) return nullptr;
  return wire16_.data() + home.at;
}

uint16_t* GradientBuckets::keep_in_wire(std::size_t layer, std::size_t index) {
  MESHTRAIN_REQUIRE(wire16_.data() != nullptr && layer < homes_of_layer_.size() &&
                        index < homes_of_layer_[layer].size(),
                    "gradient buckets: no gradient ", index, " of layer ", layer,
                    " in a 16-bit buffer");
  Home& home = homes_of_layer_[layer][index];
  const float* begin = home.grad.data();
  const std::size_t elements = home.grad.extent(0);
  // Its pieces (a gradient larger than a bucket has several) become views without data.
  for (Bucket& b : buckets_) {
    for (Piece& p : b.pieces) {
      if (begin != nullptr && p.grad.data() >= begin && p.grad.data() < begin + elements) {
        p.grad = VectorView(nullptr, p.grad.extent(0));
      }
    }
  }
  home.grad = VectorView(nullptr, elements);
  return wire16_.data() + home.at;
}

void GradientBuckets::layer_ready(std::size_t layer, unsigned written_16bit) {
  MESHTRAIN_REQUIRE(layer < buckets_of_layer_.size(), "gradient buckets: no layer ", layer);
  MESHTRAIN_REQUIRE(written_16bit == 0 || wire16_.data() != nullptr, "gradient buckets: layer ",
                    layer, " wrote 16-bit gradients, but the wire is fp32");
  if (wire16_.data() != nullptr) {
    // The gradients the layer left in fp32, rounded into their 16-bit places.
    const std::vector<Home>& homes = homes_of_layer_[layer];
    for (std::size_t i = 0; i < homes.size(); ++i) {
      if (i < 32 && (written_16bit >> i & 1u) != 0) {
        ++gradients_written_16bit_;
        continue;
      }
      MESHTRAIN_REQUIRE(homes[i].grad.data() != nullptr, "gradient buckets: layer ", layer,
                        " did not write its gradient ", i, ", which is stored as 16 bits here");
      pack_16bit(homes[i].grad.data(), wire16_.data() + homes[i].at, homes[i].grad.extent(0),
                 wire_);
    }
  }
  for (std::size_t index : buckets_of_layer_[layer]) {
    Bucket& b = buckets_[index];
    MESHTRAIN_REQUIRE(b.remaining > 0, "gradient buckets: layer ", layer,
                      " reported ready twice in one backward");
    --b.remaining;
  }
  // Start the completed buckets in order (backward completes them in order).
  while (next_start_ < buckets_.size() && buckets_[next_start_].remaining == 0) {
    Bucket& b = buckets_[next_start_++];
    if (wire16_.data() != nullptr) {  // fences the GEMMs and the packing first
      b.request = b.group->start_all_reduce_16bit(wire16_.data() + b.start, b.floats, wire_);
    } else if (b.pieces.size() == 1) {
      b.request = b.group->start_all_reduce(b.pieces.front().grad, wire_);
    } else {
      const VectorView buffer = b.buffer;
      for (const Piece& p : b.pieces) {
        const VectorView grad = p.grad;
        const std::size_t at = p.at;
        Kokkos::parallel_for(
            MESHTRAIN_LABEL("meshtrain::grad_bucket_pack"), device_range(0, grad.extent(0)),
            KOKKOS_LAMBDA(const std::size_t i) { buffer(at + i) = grad(i); });
      }
      b.request = b.group->start_all_reduce(buffer, wire_);  // fences the packing first
    }
  }
}

void GradientBuckets::poll() {
  for (std::size_t i = 0; i < next_start_; ++i) buckets_[i].request.test();
}

void GradientBuckets::wait_all() {
  MESHTRAIN_REQUIRE(next_start_ == buckets_.size(),
                    "gradient buckets: ", buckets_.size() - next_start_, " of ", buckets_.size(),
                    " buckets were never started (a layer did not report ready)");
  for (Bucket& b : buckets_) {
    b.request.wait();
    if (wire16_.data() != nullptr) {  // the 16-bit sums widened into the gradients
      for (const Piece& p : b.pieces) {
        if (p.grad.data() == nullptr) continue;  // stored as 16 bits here: the sum is the gradient
        unpack_16bit(wire16_.data() + b.start + p.at, p.grad.data(), p.grad.extent(0), wire_);
      }
    } else if (b.pieces.size() > 1) {
      const VectorView buffer = b.buffer;
      for (const Piece& p : b.pieces) {
        const VectorView grad = p.grad;
        const std::size_t at = p.at;
        Kokkos::parallel_for(
            MESHTRAIN_LABEL("meshtrain::grad_bucket_unpack"), device_range(0, grad.extent(0)),
            KOKKOS_LAMBDA(const std::size_t i) { grad(i) = buffer(at + i); });
      }
    }
    b.remaining = b.layers;
  }
  fence_all(MESHTRAIN_LABEL("meshtrain::GradientBuckets::wait_all"));
  next_start_ = 0;
}

}  // namespace meshtrain
