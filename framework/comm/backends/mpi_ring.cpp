#include "framework/comm/backends/mpi_ring.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "framework/comm/communicator.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {

namespace {

// Tags of the ring's messages, apart from the shifts' (1000 + offset) that may be in flight
// on the same communicator.
constexpr int kReduceScatterTag = 31001;
constexpr int kAllGatherTag = 31002;

std::size_t segments_of(std::size_t bytes) {
  return (bytes + kRingSegmentBytes - 1) / kRingSegmentBytes;
}

int ring_index(int value, int n) {
  return ((value % n) + n) % n;
}

// n blocks of `count` elements: block b has `base` elements, one more when b < extra.
struct Blocks {
  std::size_t base = 0;
  std::size_t extra = 0;
  std::size_t offset(int b) const {
    const std::size_t u = static_cast<std::size_t>(b);
    return u * base + std::min(u, extra);
  }
  std::size_t length(int b) const { return base + (static_cast<std::size_t>(b) < extra ? 1 : 0); }
};

// out[k] = mine[k] + arrived[k] (out may be mine or arrived: element by element in place).
// Host loops (MPI's buffers), compiled per instruction set without FMA contraction
// (framework/core/host_clones.hpp): each sum is the same IEEE addition (and, for 16 bits, the
// same integer rounding) in every clone, 16 lanes at a time on AVX-512 where the baseline runs 4.
// The 16-bit sums are precision.hpp's add_16bit (cloned there).
MESHTRAIN_HOST_CLONES_EXACT
void add_fp32(float* out, const float* mine, const float* arrived, std::size_t count) {
  for (std::size_t k = 0; k < count; ++k) out[k] = mine[k] + arrived[k];
}

void add(char* out, const char* mine, const char* arrived, std::size_t bytes, Dtype dtype) {
  if (dtype == Dtype::fp32) {
    add_fp32(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(mine),
             reinterpret_cast<const float*>(arrived), bytes / sizeof(float));
    return;
  }
  add_16bit(reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(mine),
            reinterpret_cast<const uint16_t*>(arrived), bytes / sizeof(uint16_t), dtype);
}

// Waits for requests [first, first + count) of the `total` a step posted; on a timeout or an
// MPI failure the backend abandons all live ones and throws.
void wait_for(const RingLink& link, MPI_Request* requests, int total, int first, int count) {
  const bool done = wait_all_until(requests + first, count, link.timeout_seconds, [&](int code) {
    link.failure.failed(code, "MPI_Testall", requests, total);
  });
  if (!done) link.failure.timed_out(requests, total);
}

// One step's messages, segment by segment: receives of `recv_bytes` into `recv_into` from
// the previous rank into requests [0, receives), sends of `send_bytes` from `send_from` to
// the next rank into [receives, receives + sends). Returns the total posted.
int post_step(const RingLink& link, MPI_Request* requests, char* recv_into, std::size_t recv_bytes,
              const char* send_from, std::size_t send_bytes, int tag) {
  const int receives = static_cast<int>(segments_of(recv_bytes));
  const int sends = static_cast<int>(segments_of(send_bytes));
  const int total = receives + sends;
  std::fill(requests, requests + total, MPI_REQUEST_NULL);
  const int next = (link.rank + 1) % link.size;
  const int previous = (link.rank + link.size - 1) % link.size;
  for (int k = 0; k < receives; ++k) {
    const std::size_t at = static_cast<std::size_t>(k) * kRingSegmentBytes;
    const int bytes = checked_int(std::min(kRingSegmentBytes, recv_bytes - at), "ring segment");
    const int code =
        MPI_Irecv(recv_into + at, bytes, MPI_BYTE, previous, tag, link.comm, &requests[k]);
    if (code != MPI_SUCCESS) {
      requests[k] = MPI_REQUEST_NULL;
      link.failure.failed(code, "MPI_Irecv", requests, total);
    }
  }
  for (int k = 0; k < sends; ++k) {
    const std::size_t at = static_cast<std::size_t>(k) * kRingSegmentBytes;
    const int bytes = checked_int(std::min(kRingSegmentBytes, send_bytes - at), "ring segment");
    MPI_Request& request = requests[receives + k];
    const int code = MPI_Isend(send_from + at, bytes, MPI_BYTE, next, tag, link.comm, &request);
    if (code != MPI_SUCCESS) {
      request = MPI_REQUEST_NULL;
      link.failure.failed(code, "MPI_Isend", requests, total);
    }
  }
  return total;
}

// The reduce-scatter over `blocks` (elements of `dtype`): `own` holds this rank's n blocks,
// `out` gets the sum of block `rank` (out may be own's block `rank` itself: in place).
void reduce_scatter_blocks(const RingLink& link, const char* own, char* out, const Blocks& blocks,
                           Dtype dtype) {
  const int n = link.size, r = link.rank;
  const std::size_t element = bytes_of(dtype);
  if (n == 1) {
    const std::size_t bytes = blocks.length(0) * element;
    if (out != own && bytes > 0) std::memcpy(out, own, bytes);
    return;
  }
  link.scratch.reserve(blocks.length(0) * element, n == 2 ? 1 : 2);  // block 0 is the longest
  MPI_Request* requests = link.scratch.requests();
  for (int s = 0; s + 1 < n; ++s) {
    const int sent = ring_index(r - 1 - s, n);
    const int received = ring_index(r - 2 - s, n);
    const char* send_from =
        s == 0 ? own + blocks.offset(sent) * element : link.scratch.partial((s - 1) % 2);
    char* recv_into = link.scratch.partial(s % 2);
    // The partial sum is formed where it arrived (and sent from there at the next step); the
    // last step writes the full sum to `out`.
    char* sum = s + 2 == n ? out : recv_into;
    const char* mine = own + blocks.offset(received) * element;
    const std::size_t recv_bytes = blocks.length(received) * element;
    const int total = post_step(link, requests, recv_into, recv_bytes, send_from,
                                blocks.length(sent) * element, kReduceScatterTag);
    const int receives = static_cast<int>(segments_of(recv_bytes));
    for (int k = 0; k < receives; ++k) {
      wait_for(link, requests, total, k, 1);  // later segments keep moving meanwhile
      const std::size_t at = static_cast<std::size_t>(k) * kRingSegmentBytes;
      add(sum + at, mine + at, recv_into + at, std::min(kRingSegmentBytes, recv_bytes - at), dtype);
    }
    wait_for(link, requests, total, receives, total - receives);
  }
}

// In place: block `rank` of `data` (already summed) to every rank.
void all_gather_blocks(const RingLink& link, char* data, const Blocks& blocks, Dtype dtype) {
  const int n = link.size, r = link.rank;
  const std::size_t element = bytes_of(dtype);
  MPI_Request* requests = link.scratch.requests();
  for (int s = 0; s + 1 < n; ++s) {
    const int sent = ring_index(r - s, n);
    const int received = ring_index(r - s - 1, n);
    const int total = post_step(
        link, requests, data + blocks.offset(received) * element, blocks.length(received) * element,
        data + blocks.offset(sent) * element, blocks.length(sent) * element, kAllGatherTag);
    wait_for(link, requests, total, 0, total);
  }
}

// In place through the library's MPI_Iallgatherv (one call, counts and displacements in
// bytes), when every byte offset fits an int; false (nothing done) otherwise.
bool all_gather_by_library(const RingLink& link, char* data, const Blocks& blocks, Dtype dtype) {
  const std::size_t element = bytes_of(dtype);
  const std::size_t n = static_cast<std::size_t>(link.size);
  const std::size_t total = blocks.offset(link.size - 1) + blocks.length(link.size - 1);
  if (total * element > static_cast<std::size_t>(INT_MAX)) return false;
  std::vector<int>& layout = link.scratch.gather_layout();
  if (layout.size() < 2 * n) layout.resize(2 * n);  // on the first call only
  for (int b = 0; b < link.size; ++b) {
    layout[b] = static_cast<int>(blocks.length(b) * element);
    layout[n + b] = static_cast<int>(blocks.offset(b) * element);
  }
  MPI_Request* request = link.scratch.requests();
  *request = MPI_REQUEST_NULL;
  const int code = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, layout.data(),
                                   layout.data() + n, MPI_BYTE, link.comm, request);
  if (code != MPI_SUCCESS) {
    *request = MPI_REQUEST_NULL;
    link.failure.failed(code, "MPI_Iallgatherv", request, 1);
  }
  wait_for(link, request, 1, 0, 1);
  return true;
}

}  // namespace

bool ring_all_gather_from_env() {
  const char* text = std::getenv("MESHTRAIN_RING_ALL_GATHER");
  if (text == nullptr || *text == '\0' || std::strcmp(text, "library") == 0) return false;
  if (std::strcmp(text, "ring") == 0) return true;
  MESHTRAIN_BAD_INPUT("environment variable MESHTRAIN_RING_ALL_GATHER='", text,
                      "' is neither library nor ring");
}

void RingScratch::reserve(std::size_t block_bytes, int buffers) {
  const std::size_t requests = 2 * segments_of(block_bytes);
  if (requests_.size() < requests) requests_.resize(requests, MPI_REQUEST_NULL);
  for (int b = 0; b < std::min(buffers, 2); ++b) {
    auto& buffer = partial_[b];
    if (buffer.extent(0) >= block_bytes) continue;
    buffer = Kokkos::View<char*, Kokkos::HostSpace>();  // free the old one first
    buffer = Kokkos::View<char*, Kokkos::HostSpace>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::ring_partial_sums"),
        block_bytes);
  }
}

void ring_reduce_scatter(const RingLink& link, const void* send, void* recv,
                         std::size_t count_per_rank, Dtype dtype) {
  if (count_per_rank == 0) return;  // every rank sees the same count: nobody sends
  reduce_scatter_blocks(link, static_cast<const char*>(send), static_cast<char*>(recv),
                        Blocks{count_per_rank, 0}, dtype);
}

void ring_all_reduce(const RingLink& link, void* data, std::size_t count, Dtype dtype) {
  if (count == 0 || link.size == 1) return;
  const std::size_t n = static_cast<std::size_t>(link.size);
  const Blocks blocks{count / n, count % n};
  char* bytes = static_cast<char*>(data);
  reduce_scatter_blocks(link, bytes, bytes + blocks.offset(link.rank) * bytes_of(dtype), blocks,
                        dtype);
  if (!ring_all_gather_from_env() && all_gather_by_library(link, bytes, blocks, dtype)) return;
  all_gather_blocks(link, bytes, blocks, dtype);
}

void StartedRingAllReduce::reserve(std::size_t count, Dtype dtype, int size) {
  if (size <= 1) return;
  const std::size_t n = static_cast<std::size_t>(size);
  const std::size_t block_bytes = (count / n + (count % n != 0 ? 1 : 0)) * bytes_of(dtype);
  const std::size_t requests = 2 * segments_of(block_bytes);
  if (requests_.size() < requests) requests_.resize(requests, MPI_REQUEST_NULL);
  for (int b = 0; b < (size == 2 ? 1 : 2); ++b) {
    auto& buffer = partial_[b];
    if (buffer.extent(0) >= block_bytes) continue;
    buffer = Kokkos::View<char*, Kokkos::HostSpace>();  // free the old one first
    buffer = Kokkos::View<char*, Kokkos::HostSpace>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::started_ring_partial_sums"),
        block_bytes);
  }
}

void StartedRingAllReduce::start(MPI_Comm comm, int size, int rank, int tag, void* data,
                                 std::size_t count, Dtype dtype) {
  reserve(count, dtype, size);
  comm_ = comm;
  size_ = size;
  rank_ = rank;
  tag_ = tag;
  data_ = static_cast<char*>(data);
  const std::size_t n = static_cast<std::size_t>(size);
  base_ = count / n;
  extra_ = count % n;
  dtype_ = dtype;
  steps_ = count == 0 || size == 1 ? 0 : 2 * (size - 1);
  step_ = 0;
  posted_ = false;
  receives_ = total_ = next_add_ = 0;
  failed_call_ = "";
}

// This step's buffers (see reduce_scatter_blocks and all_gather_blocks, which it follows).
void StartedRingAllReduce::step_buffers(char*& recv_into, std::size_t& recv_bytes,
                                        const char*& send_from, std::size_t& send_bytes) const {
  const int n = size_, r = rank_;
  const Blocks blocks{base_, extra_};
  const std::size_t element = bytes_of(dtype_);
  if (step_ < n - 1) {  // reduce-scatter
    const int s = step_;
    const int sent = ring_index(r - 1 - s, n);
    const int received = ring_index(r - 2 - s, n);
    send_from = s == 0 ? data_ + blocks.offset(sent) * element : partial_[(s - 1) % 2].data();
    send_bytes = blocks.length(sent) * element;
    recv_into = partial_[s % 2].data();
    recv_bytes = blocks.length(received) * element;
  } else {  // all-gather
    const int s = step_ - (n - 1);
    const int sent = ring_index(r - s, n);
    const int received = ring_index(r - s - 1, n);
    send_from = data_ + blocks.offset(sent) * element;
    send_bytes = blocks.length(sent) * element;
    recv_into = data_ + blocks.offset(received) * element;
    recv_bytes = blocks.length(received) * element;
  }
}

int StartedRingAllReduce::post() noexcept {
  char* recv_into = nullptr;
  const char* send_from = nullptr;
  std::size_t recv_bytes = 0, send_bytes = 0;
  step_buffers(recv_into, recv_bytes, send_from, send_bytes);
  receives_ = static_cast<int>(segments_of(recv_bytes));
  const int sends = static_cast<int>(segments_of(send_bytes));
  total_ = receives_ + sends;
  next_add_ = 0;
  std::fill(requests_.begin(), requests_.begin() + total_, MPI_REQUEST_NULL);
  posted_ = true;  // from here the requests are live (abandoned on a failure)
  const int next = (rank_ + 1) % size_;
  const int previous = (rank_ + size_ - 1) % size_;
  // Segments are at most kRingSegmentBytes (1 MiB): their byte counts fit an int.
  for (int k = 0; k < receives_; ++k) {
    const std::size_t at = static_cast<std::size_t>(k) * kRingSegmentBytes;
    const int bytes = static_cast<int>(std::min(kRingSegmentBytes, recv_bytes - at));
    const int code =
        MPI_Irecv(recv_into + at, bytes, MPI_BYTE, previous, tag_, comm_, &requests_[k]);
    if (code != MPI_SUCCESS) {
      requests_[k] = MPI_REQUEST_NULL;
      failed_call_ = "MPI_Irecv";
      return code;
    }
  }
  for (int k = 0; k < sends; ++k) {
    const std::size_t at = static_cast<std::size_t>(k) * kRingSegmentBytes;
    const int bytes = static_cast<int>(std::min(kRingSegmentBytes, send_bytes - at));
    MPI_Request& request = requests_[receives_ + k];
    const int code = MPI_Isend(send_from + at, bytes, MPI_BYTE, next, tag_, comm_, &request);
    if (code != MPI_SUCCESS) {
      request = MPI_REQUEST_NULL;
      failed_call_ = "MPI_Isend";
      return code;
    }
  }
  return MPI_SUCCESS;
}

int StartedRingAllReduce::progress() noexcept {
  const std::size_t element = bytes_of(dtype_);
  while (step_ < steps_) {
    if (!posted_) {
      const int code = post();
      if (code != MPI_SUCCESS) return code;
    }
    const bool reducing = step_ < size_ - 1;
    if (reducing) {
      // Add the arrived segments in order; the later ones keep moving meanwhile.
      char* recv_into = nullptr;
      const char* send_from = nullptr;
      std::size_t recv_bytes = 0, send_bytes = 0;
      step_buffers(recv_into, recv_bytes, send_from, send_bytes);
      const Blocks blocks{base_, extra_};
      const int received = ring_index(rank_ - 2 - step_, size_);
      char* sum = step_ + 2 == size_ ? data_ + blocks.offset(rank_) * element : recv_into;
      const char* mine = data_ + blocks.offset(received) * element;
      while (next_add_ < receives_) {
        int arrived = 0;
        const int code = MPI_Test(&requests_[next_add_], &arrived, MPI_STATUS_IGNORE);
        if (code != MPI_SUCCESS) {
          failed_call_ = "MPI_Test";
          return code;
        }
        if (!arrived) return MPI_SUCCESS;
        const std::size_t at = static_cast<std::size_t>(next_add_) * kRingSegmentBytes;
        add(sum + at, mine + at, recv_into + at, std::min(kRingSegmentBytes, recv_bytes - at),
            dtype_);
        ++next_add_;
      }
    }
    int done = 0;
    const int code = MPI_Testall(total_, requests_.data(), &done, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      failed_call_ = "MPI_Testall";
      return code;
    }
    if (!done) return MPI_SUCCESS;
    posted_ = false;
    ++step_;
  }
  return MPI_SUCCESS;
}

}  // namespace meshtrain
