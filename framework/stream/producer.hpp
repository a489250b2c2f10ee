#pragma once
// The producer side of a stream (docs/online.md): a simulation's rank sends rows of
// (inputs, targets) to the trainer and goes on. Installed as <meshtrain/stream.hpp>.
//
//   meshtrain::StreamProducer producer;
//   producer.connect(sim_comm, "heat", 5, 1, meshtrain::StreamDtype::float64);  // collective
//   producer.send(x, y, rows);  // copies into the ring and returns
//   producer.send(x_view, y_view);  // Kokkos views [rows, 5] and [rows, 1], any layout/space
//   producer.close();
//
// connect is collective over the parent communicator (MPI_COMM_WORLD unless options say):
// every process of the job takes part in the rendezvous once (the trainer's ranks as their
// run is built). A shape, dtype or name the trainer does not share throws a bad_input Error,
// the same sentence the trainer reports. send copies the rows into a ring of message slots
// reserved at connect and starts their sends; it never waits for the trainer unless
// backpressure is block: with drop (the default) a message that finds no free slot after the
// sends in flight are tested is dropped and its rows counted in rows_dropped(). Nothing is
// allocated after connect.
//
// Kokkos views (send(x, y) and send(x, y, rows)): rank 2, float or double, any layout and
// memory space. Views the host can read are packed straight into the ring (row by row, or
// element by element when their columns are strided: LayoutLeft, LayoutStride). Views in
// memory the host cannot read (CUDA's) are copied a message at a time into a host staging
// buffer (pinned with CUDA) that connect made, sized by message_rows, then packed; those
// whose rows are not contiguous are first gathered by a kernel into a device buffer connect
// made too. With device memory emulated (MESHTRAIN_EMULATE_DEVICE_MEMORY=1) views in the
// default memory space take that path on a CPU. The staging exists only where device memory
// is separate and Kokkos was initialized before connect; close() (or the destructor) frees it,
// so it must come before Kokkos::finalize, as for any view.

#include <mpi.h>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/views.hpp"
#include "framework/stream/stream_protocol.hpp"

namespace meshtrain {

enum class StreamDtype { float32, float64 };
enum class StreamBackpressure { drop, block };

struct StreamProducerOptions {
  int64_t ring_rows = 4096;    // rows the ring holds (rounded up to whole messages)
  int64_t message_rows = 256;  // rows of one message at most
  StreamBackpressure backpressure = StreamBackpressure::drop;
  // Consecutive sends share a message until it holds message_rows rows (false: each send's rows
  // start their own message, however few): many small sends then fill the ring's slots, and
  // the trainer's receives, with whole messages. The last message's rows wait in the ring
  // until it fills, flush() or close(); rows_sent() counts them once their message started.
  bool share_messages = false;
  // A message whose rows take at least this many bytes goes as its header, then its x rows and
  // its y rows as two messages of their own (stream_protocol::kPayloadTag), which the trainer
  // receives straight into its buffer's slots (no copy from a staging message there, and MPI's
  // single copy between processes applies to each); smaller ones go whole, one message (three
  // small messages would cost more than the copy they save). 0: every message splits.
  int64_t split_bytes = 64 * 1024;
  // With backpressure block (connect refuses it with drop): a pointer send's messages that
  // split (split_bytes) are sent straight from the caller's x and y, with no copy into the
  // ring, and send() returns once they completed: the caller may then reuse its arrays. Above
  // MPI's eager limit (4 KiB a payload with Open MPI's shared memory) that is once the trainer
  // took them (its next pull, which copies them into its buffer); under it MPI copies the bytes
  // at once and send() may return before. A direct send after the trainer's run finished (its
  // last step) waits until the trainer drops it: in an evaluation or save it still runs, else
  // when its StreamSource is destroyed. A large
  // message's bytes are then copied once in all, by MPI, instead of three times; the price is
  // that every such send waits for the trainer (no sending ahead into the ring). Not with
  // share_messages (whose messages gather several sends) nor for Kokkos views (always packed).
  bool direct_sends = false;
  MPI_Comm parent = MPI_COMM_WORLD;  // where the trainer is found
  // Seconds close() waits for the trainer's last word (its stop or its done, docs/online.md)
  // after this rank's sends completed; 0 (or infinity): for ever; negative or NaN: connect
  // refuses it (bad_input). On timeout close() reports one warning (on_warning) and returns,
  // the last word left unreceived.
  double close_timeout = 120.0;
  // What the simulation should be told, one sentence each (no "warning: " prefix): the trainer's
  // stop (on producer rank 0 only: every rank takes it) and a close the trainer did not answer
  // in close_timeout (on that rank). The library prints nothing itself: empty, nothing is
  // reported but stopped() and stop_reason(). The C API (stream.h) passes them to its
  // mt_stream_options.on_warning, else prints them to stderr.
  std::function<void(const std::string&)> on_warning;
};

namespace stream_detail {

template <class T>
using UnmanagedRows =
    Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::DefaultExecutionSpace::memory_space,
                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// Whether send stages `View` through the host staging buffer: memory the host cannot read,
// or the default memory space where device memory is emulated on a CPU.
template <class View>
bool staged_view() {
  using Space = typename View::memory_space;
  if constexpr (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible) {
    return true;
  } else if constexpr (std::is_same<Space, Kokkos::DefaultExecutionSpace::memory_space>::value) {
    return device_memory_is_separate();
  } else {
    return false;
  }
}

// Gathers rows [first, first + rows of dst) of `src` (any layout) into the contiguous dst.
template <class View, class T>
struct GatherRows {
  View src;
  UnmanagedRows<T> dst;
  int64_t first = 0, width = 1;
  KOKKOS_INLINE_FUNCTION void operator()(const int64_t i) const {
    dst(i / width, i % width) = src(first + i / width, i % width);
  }
};

}  // namespace stream_detail

class StreamProducer {
 public:
  StreamProducer() = default;
  ~StreamProducer();  // closes when connected (errors are swallowed: call close())
  StreamProducer(const StreamProducer&) = delete;
  StreamProducer& operator=(const StreamProducer&) = delete;

  // Collective over `options.parent` (and so over `comm`): finds the trainer of stream
  // `name`, checks the shapes and reserves the ring.
  void connect(MPI_Comm comm, const std::string& name, int64_t inputs, int64_t outputs,
               StreamDtype dtype, const StreamProducerOptions& options = {});
  // `rows` rows of x [rows, inputs] and y [rows, outputs], row-major host memory of the
  // connected dtype (another dtype is a bad_input Error).
  void send(const float* x, const float* y, int64_t rows);
  void send(const double* x, const double* y, int64_t rows);
  // The first `rows` rows of Kokkos views x [>= rows, inputs] and y [>= rows, outputs] (rank
  // 2, float or double, one type for both, any layout and memory space; see above); shapes
  // that disagree with the connected stream, or another dtype, are a bad_input Error naming the
  // stream and both shapes. Nothing allocated; a staged view waits for its copy to the host.
  template <
      class XView, class YView,
      std::enable_if_t<Kokkos::is_view<XView>::value && Kokkos::is_view<YView>::value, int> = 0>
  void send(const XView& x, const YView& y, int64_t rows) {
    send_view(x, y, rows, false);
  }
  // Every row of x and y (their extents 0 must agree).
  template <
      class XView, class YView,
      std::enable_if_t<Kokkos::is_view<XView>::value && Kokkos::is_view<YView>::value, int> = 0>
  void send(const XView& x, const YView& y) {
    send_view(x, y, static_cast<int64_t>(std::min(x.extent(0), y.extent(0))), true);
  }
  // With options.share_messages: starts the message being filled, if any (close() does it
  // too). Looks for the trainer's stop once a millisecond at most, as send does.
  void flush();
  // Sends the close after every row, waits for this rank's sends to complete, then for the
  // trainer's last word (its stop, or done once it took this close; options.close_timeout),
  // and on rank 0 with publishes for the publishes' end.
  void close();

  bool connected() const { return stream_comm_ != MPI_COMM_NULL; }
  MPI_Comm comm() const { return comm_; }  // the producers' communicator given to connect

  // The trainer's publishes (stream.publish_every > 0; docs/online.md), which a LiveModel
  // (<meshtrain/stream.hpp>) reads. Only producer rank 0 receives them: take_publishes()
  // receives every publish that has come without waiting, keeping the newest (buffers
  // reserved at connect: nothing allocated); close() takes them until the trainer's end.
  int64_t publish_every() const { return publish_every_; }       // 0: the trainer publishes nothing
  const std::string& model_text() const { return model_text_; }  // the run's config text
  int64_t publish_floats() const { return publish_floats_; }
  bool publish_input_stats() const { return input_stats_; }
  bool publish_target_stats() const { return target_stats_; }
  int64_t publish_bytes() const { return static_cast<int64_t>(latest_.size()); }
  // Rank 0: receives what has come; returns the newest version held (0: none yet).
  int64_t take_publishes();
  int64_t latest_version() const { return latest_version_; }  // rank 0's
  // The newest publish's message (stream_protocol::PublishHeader, then its contents), on every
  // rank publish_bytes() long; only rank 0's is filled by take_publishes.
  unsigned char* latest_publish() { return latest_.data(); }
  int64_t rows_sent() const { return rows_sent_; }        // handed to MPI
  int64_t messages_sent() const { return messages_; }     // rows messages handed to MPI
  int64_t rows_dropped() const { return rows_dropped_; }  // ring full (drop), or after a stop
  // Seconds this rank spent copying rows into the ring (the pack: every copy from the
  // caller's arrays, staged views' copies from the device included), over every send so far;
  // bench/online_ingest.sh's accounting of the copies per byte. Two clock reads per message.
  double pack_seconds() const { return pack_seconds_; }
  // The trainer failed after the rendezvous and told the producers to stop (docs/online.md):
  // every send since it came dropped its rows (rows_dropped), the simulation goes on. Producer
  // rank 0 reports one warning naming the stream and the trainer's sentence (stop_reason())
  // through options.on_warning. A stop that comes while close() waits counts too.
  bool stopped() const { return stopped_; }
  const char* stop_reason() const { return last_word_.note; }
  const std::string& name() const { return name_; }

 private:
  void send_bytes(const void* x, const void* y, int64_t rows, int64_t element_bytes);
  // options.direct_sends: the messages that split sent from x and y themselves, the others
  // packed into the ring; returns once the direct ones completed.
  void send_direct(const unsigned char* x, const unsigned char* y, int64_t rows);
  // Packs rows [first, first + count) of the send's x and y into `x_out` [count, inputs] and
  // `y_out` [count, outputs], row-major, of the connected dtype.
  using PackRows = void (*)(void* context, int64_t first, int64_t count, unsigned char* x_out,
                            unsigned char* y_out);
  // The ring's work for every send: `rows` rows, a message at a time, each packed by `pack`.
  void send_packed(int64_t rows, PackRows pack, void* context);
  // The view sends: `all`, every row of x and y (their rows must agree), else the first `rows`.
  template <class XView, class YView>
  void send_view(const XView& x, const YView& y, int64_t rows, bool all);
  // A view send's checks: the element type against the dtype, the extents against the stream
  // and the rows sent (one sentence, bad_input).
  void check_view_send(int64_t element_bytes, int64_t x_rows, int64_t x_columns, int64_t y_rows,
                       int64_t y_columns, int64_t rows, bool all) const;
  // Host-readable rows: element (r, c) at base + (r * row_stride + c * column_stride) elements.
  struct HostRows {
    const unsigned char* base = nullptr;
    int64_t row_stride = 0, column_stride = 1;
  };
  static void pack_host_rows(const HostRows& from, int64_t first, int64_t count, int64_t width,
                             int64_t element_bytes, unsigned char* out);
  // Rows [first, first + count) of a staged view into `out` [count, width], through the host
  // staging buffer (and the device one when its rows are not contiguous).
  template <class View>
  void pack_staged_rows(const View& view, int64_t first, int64_t count, unsigned char* out);
  template <class View>
  void pack_view_rows(const View& view, bool staged, int64_t first, int64_t count,
                      unsigned char* out);
  void release_staging();
  // The labels of the staging's kernel and fence: one string each for every view type (made by
  // connect: a label made at a template's first send would allocate there).
  static const std::string& gather_label();
  static const std::string& staged_fence_label();
  static const std::string& written_fence_label();
  // Refuses a staged send when connect made no staging buffer (before anything is sent).
  void check_staging(bool staged) const;
  // Waits for the kernels of device_space() when `View` is memory the host reads but a device
  // may write (CUDA UVM or host-pinned): the host packs it, so a kernel still writing it would
  // race the pack. HostSpace, and every space of a build without a device, need no wait.
  template <class View>
  static void fence_device_written() {
    using Space = typename View::memory_space;
    if constexpr (Kokkos::SpaceAccessibility<Kokkos::DefaultExecutionSpace, Space>::accessible &&
                  !std::is_same<Space, Kokkos::HostSpace>::value) {
      fence_device(written_fence_label());
    }
  }
  // A send's first steps, shared by send_packed and send_direct: checks the call, drops the rows
  // (false) when the trainer has stopped, otherwise completes what it can of the sends in flight.
  bool begin_send(int64_t rows);
  void test_ring();      // one MPI_Testsome over every send in flight (none: returns)
  int take_free_slot();  // -1: none (drop)
  // The message in open_slot_: its header, then its sends. With caller_x and caller_y, its rows
  // are sent split from those arrays (send_direct) rather than from the slot.
  void start_open(const unsigned char* caller_x = nullptr, const unsigned char* caller_y = nullptr);
  bool slot_free(size_t slot) const;
  void wait_slot(size_t slot, const char* what);  // completes the slot's sends in flight

  void receive_publish();  // one message into incoming_, the newest kept
  // Takes the trainer's last word when it has come (never waits); true once stopped.
  bool check_stop();
  // check_stop once a millisecond at most (send and flush); true once stopped.
  bool check_stop_now_and_then();
  // flush(), looking for the stop every call (close) or once a millisecond (flush).
  void flush_open(bool check_stop_always);
  // close(): waits for the last word (and rank 0's publishes' end) up to close_timeout_.
  void wait_for_last_word();
  void warn(const std::string& sentence) const;

  MPI_Comm stream_comm_ = MPI_COMM_NULL;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  std::string name_;
  int64_t producer_index_ = 0, producers_ = 1, groups_ = 1;
  std::vector<std::vector<int>> group_ranks_;  // stream-communicator ranks of each group
  std::vector<int> trainers_;
  int64_t inputs_ = 0, outputs_ = 0, element_bytes_ = 4, message_rows_ = 0;
  StreamBackpressure backpressure_ = StreamBackpressure::drop;
  // The ring: slots of one message each, every slot's sends (one per rank of its group).
  std::vector<std::vector<unsigned char>> slots_;
  // slot s's sends: requests_[s * slot_width_ ...], MPI_REQUEST_NULL once complete (or unused);
  // completed_: MPI_Testsome's indices.
  std::vector<MPI_Request> requests_;
  std::vector<int> completed_;
  size_t slot_width_ = 1;
  int64_t in_flight_ = 0;  // requests_ not MPI_REQUEST_NULL (0: send tests nothing)
  std::chrono::steady_clock::time_point last_stop_check_;  // send's last look for a stop
  int64_t next_slot_ = 0;
  // The message being filled: its slot (-1: none), rows so far and first row number. With
  // share_messages_ its x rows are written from the payload's start and its y rows after
  // message_rows_ x rows, moved down to follow its x rows when it starts; without, a send's
  // rows start it at once, y straight after x.
  int open_slot_ = -1;
  int64_t open_rows_ = 0, open_first_row_ = 0;
  bool share_messages_ = false;
  int64_t split_bytes_ = 64 * 1024;
  bool direct_sends_ = false;
  std::vector<char> direct_slot_;  // [slot]: its sends read the caller's rows (send_direct)
  int64_t messages_ = 0;           // rows messages started (the group of the next is chosen by it)
  int64_t next_row_ = 0;           // the row number of the next row sent
  int64_t rows_sent_ = 0, rows_dropped_ = 0;
  double pack_seconds_ = 0.0;
  // Publishes: the trainer rank 0 that sends them (stream-communicator rank).
  int64_t publish_every_ = 0, publish_floats_ = 0;
  bool input_stats_ = false, target_stats_ = false;
  std::string model_text_;
  int publisher_ = 0;
  std::vector<unsigned char> incoming_, latest_;  // rank 0: incoming_; every rank: latest_
  int64_t latest_version_ = 0;
  bool publish_ended_ = false;  // the trainer's end came: nothing more will
  // The trainer's last word (stream_protocol::LastWord: its stop or done), received into memory
  // of the object.
  bool stopped_ = false;
  bool last_word_received_ = false;
  stream_protocol::LastWord last_word_;
  double close_timeout_ = 120.0;
  std::function<void(const std::string&)> on_warning_;
  // View sends' staging (only where device memory is separate; made at connect): one message's
  // rows of the wider of x and y, on the host (pinned with CUDA) and in the default memory
  // space (for views whose rows are not contiguous).
  Kokkos::View<unsigned char*, HostStagingSpace> host_staging_;
  Kokkos::View<unsigned char*, Kokkos::DefaultExecutionSpace::memory_space> device_staging_;
};

template <class View>
void StreamProducer::pack_staged_rows(const View& view, int64_t first, int64_t count,
                                      unsigned char* out) {
  using T = typename View::non_const_value_type;
  using Space = typename View::memory_space;
  const int64_t width = static_cast<int64_t>(view.extent(1));
  using HostRowsView = Kokkos::View<T**, Kokkos::LayoutRight, HostStagingSpace,
                                    Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  HostRowsView host(reinterpret_cast<T*>(host_staging_.data()), count, width);
  // One span when the columns are adjacent and the rows follow each other (a single column
  // or a single row: whatever the other stride).
  const bool dense = (width == 1 || view.stride(1) == 1) &&
                     (count == 1 || static_cast<int64_t>(view.stride(0)) == width);
  if (dense) {
    // The rows are one span: copied as they are.
    Kokkos::View<const T**, Kokkos::LayoutRight, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        rows(view.data() + first * static_cast<int64_t>(view.stride(0)), count, width);
    Kokkos::deep_copy(device_space(), host, rows);
  } else {
    stream_detail::UnmanagedRows<T> gathered(reinterpret_cast<T*>(device_staging_.data()), count,
                                             width);
    Kokkos::parallel_for(
        gather_label(),
        Kokkos::RangePolicy<Kokkos::DefaultExecutionSpace>(device_space(), 0, count * width),
        stream_detail::GatherRows<View, T>{view, gathered, first, width});
    Kokkos::deep_copy(device_space(), host, gathered);
  }
  fence_device(staged_fence_label());
  std::memcpy(out, host.data(), static_cast<size_t>(count * width) * sizeof(T));
}

template <class View>
void StreamProducer::pack_view_rows(const View& view, bool staged, int64_t first, int64_t count,
                                    unsigned char* out) {
  using T = typename View::non_const_value_type;
  using Space = typename View::memory_space;
  constexpr bool host_reads = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible;
  constexpr bool device_reads =
      Kokkos::SpaceAccessibility<Kokkos::DefaultExecutionSpace, Space>::accessible;
  static_assert(host_reads || device_reads,
                "StreamProducer::send: a view in memory neither the host nor the default "
                "execution space can read");
  if constexpr (device_reads) {
    if (staged) {  // always, where the host cannot read it
      pack_staged_rows(view, first, count, out);
      return;
    }
  }
  if constexpr (host_reads) {
    HostRows from;
    from.base = reinterpret_cast<const unsigned char*>(view.data());
    from.row_stride = static_cast<int64_t>(view.stride(0));
    from.column_stride = static_cast<int64_t>(view.stride(1));
    pack_host_rows(from, first, count, static_cast<int64_t>(view.extent(1)), sizeof(T), out);
  }
}

template <class XView, class YView>
void StreamProducer::send_view(const XView& x, const YView& y, int64_t rows, bool all) {
  using T = typename XView::non_const_value_type;
  static_assert(XView::rank == 2 && YView::rank == 2,
                "StreamProducer::send takes rank-2 views x [rows, inputs] and y [rows, outputs]");
  static_assert(std::is_same<T, typename YView::non_const_value_type>::value,
                "StreamProducer::send: x and y must hold the same type");
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "StreamProducer::send: views of float or double");
  check_view_send(sizeof(T), static_cast<int64_t>(x.extent(0)), static_cast<int64_t>(x.extent(1)),
                  static_cast<int64_t>(y.extent(0)), static_cast<int64_t>(y.extent(1)), rows, all);
  struct Context {
    StreamProducer* self;
    const XView* x;
    const YView* y;
    bool x_staged, y_staged;
  } context{this, &x, &y, stream_detail::staged_view<XView>(), stream_detail::staged_view<YView>()};
  check_staging(context.x_staged || context.y_staged);
  fence_device_written<XView>();
  fence_device_written<YView>();
  send_packed(
      rows,
      [](void* c, int64_t first, int64_t count, unsigned char* x_out, unsigned char* y_out) {
        auto* ctx = static_cast<Context*>(c);
        ctx->self->pack_view_rows(*ctx->x, ctx->x_staged, first, count, x_out);
        ctx->self->pack_view_rows(*ctx->y, ctx->y_staged, first, count, y_out);
      },
      &context);
}

}  // namespace meshtrain
