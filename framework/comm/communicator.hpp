#pragma once
// A communicator over one group of ranks (a mesh axis or a tuple of axes), in the spirit
// of Aluminum: a small, move-only object whose operations take Kokkos Views of float.
//
// Two halves:
// - The public operations (all_gather, reduce_scatter, all_reduce, broadcast, shift,
//   all_to_all, all_to_all_v, barrier) are written once, here and in communicator.cpp:
//   they check the shapes, pack and unpack dim-1 blocks through the communicator's scratch
//   buffer, and call the backend on contiguous buffers.
// - A backend (backends/mpi_communicator.hpp, backends/nccl_communicator.hpp) implements the
//   protected `raw_*` functions on contiguous buffers in the default memory space. It
//   never sees a View, a dimension or a layout.
//
// Every blocking operation fails with a runtime Error naming the operation and the group
// ("all_reduce on axis (tp) did not complete within 5 s: a rank did not join") when it
// waits longer than timeout_seconds() (env MESHTRAIN_COLLECTIVE_TIMEOUT, default 300 s).
// Every public operation is recorded by the flight recorder (flight_recorder.hpp) when it is
// on; a timeout's error then also names the ranks that never entered the collective.
//
// Semantics of the tiled operations (as jax.lax.all_gather(tiled=True) and
// psum_scatter(scatter_dimension=dim, tiled=True)), for a group of size n, this rank i:
//   all_gather(send [r, c], recv, 0): recv [n*r, c], rows [j*r, (j+1)*r) come from rank j.
//   all_gather(send [r, c], recv, 1): recv [r, n*c], cols [j*c, (j+1)*c) come from rank j.
//   reduce_scatter(send [n*r, c], recv [r, c], 0): recv = sum over ranks of send rows
//     [i*r, (i+1)*r); with dim 1, send [r, n*c] and the column block i.
//   all_to_all_v(send, send_rows, recv, recv_rows): send_rows[j] rows packed in rank order go
//     to rank j; recv_rows[j] rows from rank j land packed in rank order (MPI_Alltoallv).
// Dim-1 operations stage through the scratch buffer (n*r*c floats, grown on first use and
// kept; reserve_scratch() preallocates it so later calls do not allocate).
//
// Wire type (mixed precision, docs/mixed_precision.md): all_gather, reduce_scatter,
// all_reduce, shift, all_to_all_v, start_all_gather and start_all_reduce take `wire`
// (default fp32). With bf16 or fp16 the floats are rounded to 16 bits (nearest even) as they
// are packed, 16-bit elements travel, and what arrives is widened back into the float views:
// half the bytes.
// A 16-bit sum adds in fp32 and rounds to 16 bits at every hop (each partial sum a rank
// passes on), as NCCL does. Data already holding 16-bit values gathers exactly. The 16-bit
// buffers are kept per communicator (and per operation in flight), grown on first use;
// reserve_wire() preallocates the blocking operations' ones.

#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "base/error.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/views.hpp"
#include "framework/observe/trace.hpp"

namespace meshtrain {

enum class ReduceOp { sum, mean };

// Which algorithm the blocking sums (reduce_scatter, all_reduce of floats) of a communicator
// use, by the bytes this rank contributes (its send buffer): from `*_ring_from` bytes on the
// MPI backend's own pipelined ring (backends/mpi_ring.hpp), below that the MPI library's
// collective. Every rank of the group must hold the same choice (the two do not match each
// other's messages). The default is the library everywhere; other backends (NCCL) ignore it.
// Started all-reduces (start_all_reduce) follow all_reduce_ring_from too (the MPI backend's
// started ring, advanced when tested, waited for, or by the communication thread).
struct ReductionChoice {
  static constexpr std::size_t kNever = SIZE_MAX;
  std::size_t reduce_scatter_ring_from = kNever;
  std::size_t all_reduce_ring_from = kNever;

  static ReductionChoice library() { return {}; }
  static ReductionChoice ring() { return {0, 0}; }
  bool operator==(const ReductionChoice& o) const {
    return reduce_scatter_ring_from == o.reduce_scatter_ring_from &&
           all_reduce_ring_from == o.all_reduce_ring_from;
  }
};

// blocks: the n [r, c] blocks of an all-gather along dim 1 in rank order (n * r * c
// floats); writes recv [r, n*c] with block j at columns [j*c, (j+1)*c).
void place_gathered_columns(ConstVectorView blocks, MatrixView recv, int n);

// `value` as an int for an MPI/NCCL count; throws a runtime Error naming `what` when it
// does not fit.
int checked_int(std::size_t value, const char* what);

// Seconds a blocking collective may wait: env MESHTRAIN_COLLECTIVE_TIMEOUT (a positive
// number), default 300. Throws bad_input when the variable is set but not a positive number.
double collective_timeout_from_env();

// A pending non-blocking operation (shift, start_all_gather, start_all_reduce). Move-only; wait()
// completes it (throws a runtime Error on timeout or backend failure). The destructor of a pending
// request waits for it (errors swallowed) so buffers are never released under a running transfer.
//
// Ownership: a Request borrows its Impl from the backend, which keeps a pool of them so
// that shifts allocate nothing once the pool has grown to the number of shifts in flight.
// The Request hands the Impl back with Impl::release() exactly once: when it completes
// (wait() or a true test()), when wait() throws, or when the Request is destroyed or
// assigned over. The backend keeps whatever the Impl needs (its communicator's state)
// alive until then.
class Request {
 public:
  class Impl {
   public:
    virtual bool test() = 0;  // true once complete
    virtual void wait() = 0;  // blocks until complete or throws
    // Gives the Impl back to the backend; the Request never touches it again.
    virtual void release() noexcept = 0;

   protected:
    virtual ~Impl() = default;  // only the backend's pool destroys an Impl
  };

  // A non-blocking 16-bit operation's buffers and what it unpacks when it completes, and
  // the communicator's pool of them (communicator.cpp).
  struct WireSlot;
  struct WirePool;

  Request() = default;
  explicit Request(Impl* impl) noexcept : impl_(impl) {}
  Request(Request&& other) noexcept
      : impl_(other.impl_),
        wire_(other.wire_),
        trace_flow_(other.trace_flow_),
        flight_serial_(other.flight_serial_),
        flight_timeout_(other.flight_timeout_) {
    other.impl_ = nullptr;
    other.wire_ = nullptr;
    other.trace_flow_ = 0;
    other.flight_serial_ = 0;
  }
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();

  void wait();  // no-op for an empty or completed request
  bool test();  // true when empty or complete
  bool pending() const { return impl_ != nullptr; }

 private:
  friend class Communicator;
  friend struct RequestFlight;  // communicator.cpp: attaches the flight recorder's entry
  void finish() noexcept;       // waits (errors swallowed) and releases a pending Impl
  // After a completion: the 16-bit data received unpacked into the caller's floats.
  void complete_wire();
  // The wire slot back to its pool without unpacking (a failed or abandoned operation).
  void drop_wire() noexcept;

  Impl* impl_ = nullptr;      // borrowed from the backend's pool, see above
  WireSlot* wire_ = nullptr;  // borrowed from the communicator's wire pool
  int64_t trace_flow_ = 0;    // while tracing: the start's id, which wait() links to
  // The flight recorder's entry of the started operation (flight_recorder.hpp; 0: none),
  // marked completed or failed when it completes, and its communicator's timeout.
  uint64_t flight_serial_ = 0;
  double flight_timeout_ = 0.0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int size() const { return size_; }
  int rank() const { return rank_; }
  // How errors name this group: "axis (tp)", "axes (fsdp, dp)", "world".
  const std::string& description() const { return description_; }
  double timeout_seconds() const { return timeout_seconds_; }
  void set_timeout_seconds(double seconds);
  // The algorithm of the blocking sums (see ReductionChoice); the same on every rank.
  const ReductionChoice& reduction_choice() const { return reduction_choice_; }
  void set_reduction_choice(const ReductionChoice& choice) { reduction_choice_ = choice; }

  // Tiled all-gather (see the header comment). send and recv must not overlap.
  void all_gather(ConstVectorView send, VectorView recv, Dtype wire = Dtype::fp32);
  void all_gather(ConstMatrixView send, MatrixView recv, int dim, Dtype wire = Dtype::fp32);
  // Tiled reduce-scatter with sum.
  void reduce_scatter(ConstVectorView send, VectorView recv, Dtype wire = Dtype::fp32);
  void reduce_scatter(ConstMatrixView send, MatrixView recv, int dim, Dtype wire = Dtype::fp32);
  // The same of a matrix given as 16-bit elements of `dtype` (bf16 or fp16; a weight gradient
  // written as 16 bits, layers/sharded_parameter.hpp): the 16-bit sum reduce_scatter(send, recv,
  // dim, dtype) runs on its packed copy, on `send` as it is (no packing pass), widened into recv.
  // dim 1 puts the column blocks in rank order on the blocking 16-bit send buffer first (16-bit
  // elements; no fp32 staging). send contiguous.
  void reduce_scatter_16bit(ConstHalfMatrixView send, MatrixView recv, int dim, Dtype dtype);
  // In place; mean divides the sum by size(). data must be contiguous.
  void all_reduce(VectorView data, ReduceOp op = ReduceOp::sum, Dtype wire = Dtype::fp32);
  void all_reduce(MatrixView data, ReduceOp op = ReduceOp::sum, Dtype wire = Dtype::fp32);
  // all_reduce(data, sum, dtype) of values a producer has written as 16 bits of `dtype` (bf16 or
  // fp16) into `written`, the buffer all_reduce_wire(data.span()) returned: that buffer summed as
  // the blocking all-reduce sums its packed copy, without the packing pass, and the sum widened
  // into `data` (contiguous, the shape of `written`).
  // all_reduce_wire(count) is the blocking 16-bit buffer (grown to `count` elements, kept), where
  // a weight-gradient GEMM writes its 16-bit C (layers/sharded_parameter.hpp). It is valid until
  // the next blocking 16-bit operation on this communicator: all_reduce_from_wire requires that
  // `written` is that buffer and that no blocking 16-bit operation (another all_reduce_wire
  // included) ran since it was handed out (a count of them, recorded then), and is itself one.
  uint16_t* all_reduce_wire(std::size_t count);
  void all_reduce_from_wire(ConstHalfMatrixView written, MatrixView data, Dtype dtype);
  // The same in double precision (sums of many scalars stay exact to 2^53).
  void all_reduce(DoubleVectorView data, ReduceOp op = ReduceOp::sum);
  void broadcast(VectorView data, int root);
  void broadcast(MatrixView data, int root);
  // Non-blocking ppermute: sends `send` to rank (i + offset) mod n and receives into
  // `recv` from rank (i - offset) mod n; both buffers must stay alive and untouched until
  // the Request completes. Shapes must be equal on sender and receiver. Several shifts may
  // be in flight at once (bidirectional rings) if every rank starts them in the same order.
  Request shift(ConstVectorView send, VectorView recv, int offset, Dtype wire = Dtype::fp32);
  Request shift(ConstMatrixView send, MatrixView recv, int offset, Dtype wire = Dtype::fp32);
  // The same for `count` 16-bit elements of `dtype` (bf16 or fp16) as they are: nothing packed
  // or widened, so no wire slot (the collective matmuls' 16-bit blocks).
  Request shift_16bit(const uint16_t* send, uint16_t* recv, std::size_t count, int offset,
                      Dtype dtype);
  // Non-blocking tiled all-gather of contiguous blocks: recv [n * send.extent(0)] gets
  // rank j's send at offset j * send.extent(0). send must stay untouched and recv unread
  // until the Request completes. Other operations on this communicator may run meanwhile
  // (every rank must start them in the same order). A matrix gathered along dim 1 arrives
  // as n [r, c] blocks in rank order: place_gathered_columns() puts them in place.
  Request start_all_gather(ConstVectorView send, VectorView recv, Dtype wire = Dtype::fp32);
  // Flat all-gathers of 16-bit elements as they are (a parameter's 16-bit compute copy,
  // docs/mixed_precision.md): `count` elements of `dtype` (bf16 or fp16) per rank from `send`
  // into `recv` [n * count], rank j's at j * count; nothing packed or widened, so no wire
  // staging. Blocking, and started as start_all_gather (same rules).
  void all_gather_16bit(const uint16_t* send, uint16_t* recv, std::size_t count, Dtype dtype);
  Request start_all_gather_16bit(const uint16_t* send, uint16_t* recv, std::size_t count,
                                 Dtype dtype);
  // Non-blocking in-place sum (DP gradient buckets): `data` must stay untouched (neither
  // read nor written) until the Request completes; then it holds the sum over the group,
  // as all_reduce(data) gives. Every rank must start the same operations on this
  // communicator in the same order; others may run meanwhile. One MPI/NCCL call: the
  // count must fit an int (split larger buffers).
  Request start_all_reduce(VectorView data, Dtype wire = Dtype::fp32);
  // The same sum on `count` 16-bit elements of `dtype` (bf16 or fp16) as they are, in place: the
  // 16-bit sum start_all_reduce(data, dtype) runs on its packed copy, without the packing, the
  // wire slot and the widening (DP gradient buckets whose gradients are written as 16 bits,
  // layers/gradient_buckets.hpp). `data` in the default memory space, untouched until complete.
  Request start_all_reduce_16bit(uint16_t* data, std::size_t count, Dtype dtype);
  // Equal blocks along dim 0: send [n*b, c] block j goes to rank j; recv [n*b, c] block j
  // comes from rank j.
  void all_to_all(ConstMatrixView send, MatrixView recv);
  // Variable all-to-all along dim 0 (MPI_Alltoallv): the rows of `send` are packed in rank
  // order, send_rows[j] of them for rank j (from row sum_{i<j} send_rows[i]); the rows from
  // rank j land packed in rank order in `recv`, recv_rows[j] of them. Both vectors have size()
  // entries (every rank must know what it will receive: exchange the counts first); send and
  // recv have the same columns; rows beyond the packed totals are left alone. `wire` as for
  // the other operations (16-bit rows travel rounded, widened on arrival).
  // send_rows[j] here must equal recv_rows[i] on rank j (this rank i): the counts are checked
  // locally only, and a disagreement is a backend error (or a timeout), not a bad_input.
  // send and recv must be contiguous and must not overlap.
  void all_to_all_v(ConstMatrixView send, const std::vector<int64_t>& send_rows, MatrixView recv,
                    const std::vector<int64_t>& recv_rows, Dtype wire = Dtype::fp32);
  void barrier();

  // Grows the scratch buffer used by dim-1 operations to at least `floats`.
  void reserve_scratch(std::size_t floats);
  // Preallocates the buffers a 16-bit all_to_all_v / the other blocking 16-bit operations use, so
  // that later calls up to these sizes (elements) allocate nothing.
  void reserve_wire(std::size_t send_elements, std::size_t recv_elements);
  // Preallocates what a backend stages blocking operations through (the MPI backend's host
  // buffers when memory is on a device), so that later calls up to these sizes allocate
  // nothing. A no-op where nothing is staged.
  void reserve_staging(std::size_t send_bytes, std::size_t recv_bytes) {
    raw_reserve_staging(send_bytes, recv_bytes);
  }
  // Preallocates what a blocking reduce_scatter (sending `elements`) or all_reduce (of
  // `elements`) in `wire` needs beyond the scratch, wire and staging buffers above: the MPI
  // backend's ring partial sums (one buffer of a block of ceil(elements / size()) on 2 ranks,
  // two on more), where the reduction choice runs the ring for that size. Layers call it
  // when they are built, so that the first step does not grow it. A no-op elsewhere.
  void reserve_reductions(std::size_t elements, Dtype wire = Dtype::fp32) {
    raw_reserve_reductions(elements, wire);
  }
  // Reserves what `count` more non-blocking operations in flight at once need (the backend's
  // request slots with their host staging, and the 16-bit wire slots): each a start_all_reduce
  // of `elements`, or a start_all_gather of `send_elements` per rank, in `wire`. A layer
  // that keeps such operations in flight (DP gradient buckets, the FSDP prefetch) reserves
  // them when it is built; the pools then do not grow inside a step, whichever completes
  // first. Reservations add up.
  void reserve_started_all_reduces(std::size_t count, std::size_t elements,
                                   Dtype wire = Dtype::fp32);
  void reserve_started_all_gathers(std::size_t count, std::size_t send_elements,
                                   Dtype wire = Dtype::fp32);
  // The same for start_all_gather_16bit (the backend's request slots only: no wire slots).
  void reserve_started_16bit_all_gathers(std::size_t count, std::size_t send_elements, Dtype dtype);
  // The same for start_all_reduce_16bit (the backend's request slots, or its started ring's
  // buffers: no wire slots).
  void reserve_started_16bit_all_reduces(std::size_t count, std::size_t elements, Dtype dtype);

 protected:
  Communicator(int size, int rank, std::string description);
  // The start of a non-blocking operation while tracing: `request` gets the flow id that
  // `span` (the start) records, for its wait (communicator.cpp).
  static Request traced_start(TraceSpan& span, Request request);
  // The group's members as world ranks, for the flight recorder's reports (a backend that
  // knows them says so once it is made).
  void set_flight_world_ranks(const std::vector<int>& world_ranks);
  Communicator(Communicator&&) = default;
  Communicator& operator=(Communicator&&) = default;

  // --- backend: contiguous buffers in the default memory space; `op` names the public
  // operation for error messages. Counts are elements: of `dtype` where one is given
  // (fp32: float; bf16, fp16: uint16_t bits, summed as the backend's 16-bit sum), floats
  // otherwise. They return when the data is ready to read (a stream-based backend
  // synchronizes before returning).
  virtual void raw_all_gather(const void* send, void* recv, std::size_t count_per_rank, Dtype dtype,
                              const char* op) = 0;
  virtual void raw_reduce_scatter_sum(const void* send, void* recv, std::size_t count_per_rank,
                                      Dtype dtype, const char* op) = 0;
  virtual void raw_all_reduce_sum(void* data, std::size_t count, Dtype dtype, const char* op) = 0;
  virtual void raw_all_reduce_sum_f64(double* data, std::size_t count, const char* op) = 0;
  virtual void raw_broadcast(float* data, std::size_t count, int root, const char* op) = 0;
  virtual Request raw_shift(const void* send, void* recv, std::size_t count, Dtype dtype,
                            int offset, const char* op) = 0;
  virtual Request raw_start_all_gather(const void* send, void* recv, std::size_t count_per_rank,
                                       Dtype dtype, const char* op) = 0;
  virtual Request raw_start_all_reduce_sum(void* data, std::size_t count, Dtype dtype,
                                           const char* op) = 0;
  virtual void raw_all_to_all(const float* send, float* recv, std::size_t count_per_rank,
                              const char* op) = 0;
  // size() entries each: send_counts[j] elements from send + send_offsets[j] go to rank j;
  // recv_counts[j] elements from rank j land at recv + recv_offsets[j]. Counts may be zero.
  virtual void raw_all_to_all_v(const void* send, const std::size_t* send_counts,
                                const std::size_t* send_offsets, void* recv,
                                const std::size_t* recv_counts, const std::size_t* recv_offsets,
                                Dtype dtype, const char* op) = 0;
  virtual void raw_barrier(const char* op) = 0;
  virtual void raw_reserve_staging(std::size_t /*send_bytes*/, std::size_t /*recv_bytes*/) {}
  // `count` more request slots, each with what an operation sending `send_bytes` and
  // receiving `recv_bytes` stages (slot_pool.hpp's reserve). A no-op for a backend whose
  // requests hold nothing that must be made ahead.
  virtual void raw_reserve_requests(std::size_t /*count*/, std::size_t /*send_bytes*/,
                                    std::size_t /*recv_bytes*/) {}
  virtual void raw_reserve_reductions(std::size_t /*elements*/, Dtype /*dtype*/) {}
  // `count` more started all-reduces of `elements` of `dtype` in flight at once: by default
  // request slots as raw_reserve_requests makes them (in place: nothing sent from a buffer of
  // its own); the MPI backend reserves its started ring's buffers where the ring runs.
  virtual void raw_reserve_started_all_reduces(std::size_t count, std::size_t elements,
                                               Dtype dtype) {
    raw_reserve_requests(count, 0, elements * bytes_of(dtype));
  }

 private:
  float* scratch(std::size_t floats);
  // The blocking 16-bit operations' buffers: `send` and `recv` elements (grown, kept).
  uint16_t* wire_send(std::size_t count);
  uint16_t* wire_recv(std::size_t count);
  // A pooled slot for a non-blocking 16-bit operation (its two buffers grown to the counts).
  Request::WireSlot& acquire_wire_slot(std::size_t send_count, std::size_t recv_count);
  template <class Start>
  Request start_on_wire(Request::WireSlot& slot, float* unpack_to, std::size_t count, Dtype wire,
                        Start&& start);
  template <class Move>
  void through_wire(const float* send, std::size_t send_count, float* recv, std::size_t recv_count,
                    Dtype wire, bool in_place, Move&& move);
  void gather_flat(const float* send, float* recv, std::size_t count, Dtype wire, const char* op);
  void reduce_scatter_flat(const float* send, float* recv, std::size_t count, Dtype wire,
                           const char* op);

  int size_ = 1;
  int rank_ = 0;
  std::string description_;
  double timeout_seconds_ = 300.0;
  int flight_group_ = -1;  // the flight recorder's group of this description (-1: unrecorded)
  ReductionChoice reduction_choice_;
  Kokkos::View<float*, Kokkos::LayoutRight> scratch_;  // dim-1 staging, grown on demand
  HalfBits wire_send_, wire_recv_;                     // blocking 16-bit operations
  // How many blocking 16-bit operations have used (or grown) wire_send_/wire_recv_, and that
  // count when all_reduce_wire last handed out wire_recv_ (all_reduce_from_wire checks it).
  std::uint64_t wire_uses_ = 0, wire_handed_out_at_ = ~std::uint64_t{0};
  // all_to_all_v's element counts and offsets: send counts, send offsets, recv counts, recv
  // offsets, size_ entries each (sized at construction: calls allocate nothing).
  std::vector<std::size_t> v_layout_;
  std::shared_ptr<Request::WirePool> wire_pool_;  // shared with pending Requests
};

}  // namespace meshtrain
