// The NCCL backend's error state (abort, timeouts, polling under the deadline) and its
// ordering rules (nccl_state.hpp): Kokkos' stream against the NCCL stream, and the one
// NCCL stream per device.

#include "framework/comm/backends/nccl_state.hpp"

#include <sched.h>

#include <ctime>
#include <map>
#include <mutex>
#include <sstream>

#include <Kokkos_Core.hpp>

#include "framework/core/exec_space.hpp"
#include "framework/observe/flight_recorder.hpp"

namespace meshtrain {
namespace nccl_detail {

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void pause_poll(long polls) {
  if (polls > 2000) {
    const timespec pause{0, 20000};  // 20 us
    nanosleep(&pause, nullptr);
  } else {
    sched_yield();
  }
}

std::string seconds_text(double seconds) {
  std::ostringstream out;
  out << seconds;
  return out.str();
}

std::string cuda_text(cudaError_t code) {
  return std::string(cudaGetErrorString(code)) + " (" + cudaGetErrorName(code) + ")";
}

std::string nccl_text(ncclResult_t code, ncclComm_t comm) {
  std::string text = ncclGetErrorString(code);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && *detail != '\0') text += std::string(" (") + detail + ")";
  return text;
}

void check_cuda(cudaError_t code, const std::string& what) {
  if (code == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
  MESHTRAIN_FAIL(what, " failed: ", cuda_text(code));
}

namespace {
[[noreturn]] void fail_cuda(cudaError_t code, const char* op, const std::string& group,
                            const char* call) {
  cudaGetLastError();
  MESHTRAIN_FAIL(op, " on ", group, ": ", call, " failed: ", cuda_text(code));
}
}  // namespace

void check_cuda(cudaError_t code, const char* op, const std::string& group, const char* call) {
  if (code != cudaSuccess) fail_cuda(code, op, group, call);
}

bool kokkos_stream_on(int device, cudaStream_t* stream) {
#if defined(KOKKOS_ENABLE_DEFAULT_DEVICE_TYPE_CUDA)
  if (!Kokkos::is_initialized()) return false;
  const Kokkos::DefaultExecutionSpace& kokkos = device_space();  // made once (exec_space.hpp)
  if (kokkos.cuda_device() != device) return false;
  *stream = kokkos.cuda_stream();
  return true;
#else
  (void)device;
  (void)stream;
  return false;
#endif
}

// Ordering rule 7: one stream per device for every NCCL communicator of the process. The
// registry holds weak references, so the stream goes with the last communicator (and its
// last pending Request). Used at set-up only; the lock keeps two threads building
// communicators from making two streams for one device.
std::shared_ptr<CUstream_st> shared_nccl_stream(int device, const std::string& description) {
  static std::mutex lock;
  static auto* const streams = new std::map<int, std::weak_ptr<CUstream_st>>();  // never freed
  const std::lock_guard<std::mutex> hold(lock);
  std::weak_ptr<CUstream_st>& entry = (*streams)[device];
  if (std::shared_ptr<CUstream_st> existing = entry.lock()) return existing;
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamDefault),
             "cudaStreamCreateWithFlags (the NCCL stream of CUDA device " + std::to_string(device) +
                 ") for " + description);
  std::shared_ptr<CUstream_st> shared(stream, [device](cudaStream_t s) {
    int current = -1;
    const bool restore = cudaGetDevice(&current) == cudaSuccess && current != device;
    cudaSetDevice(device);
    cudaStreamDestroy(s);
    if (restore) cudaSetDevice(current);
    cudaGetLastError();  // a destructor cannot report
  });
  entry = shared;
  return shared;
}

}  // namespace nccl_detail

using nccl_detail::Clock;
using nccl_detail::cuda_text;
using nccl_detail::nccl_text;

NcclCommunicator::State::State() = default;

void NcclCommunicator::State::require_usable(const char* op) const {
  if (!broken.empty()) {
    MESHTRAIN_FAIL(op, " on ", description, " refused: the NCCL communicator is unusable after ",
                   broken);
  }
}

void NcclCommunicator::State::abort(const std::string& why) {
  if (broken.empty()) broken = why;
  if (comm != nullptr) {
    (void)ncclCommAbort(comm);
    comm = nullptr;
  }
}

void NcclCommunicator::State::fail_abort(const std::string& message) {
  abort("an earlier error (" + message + ")");
  MESHTRAIN_FAIL(message);
}

void NcclCommunicator::State::fail_timeout(const char* op, double timeout) {
  FlightRecorder::mark_timeout();  // the Communicator adds what the flight records say
  fail_abort(std::string(op) + " on " + description + " did not complete within " +
             nccl_detail::seconds_text(timeout) + " s: a rank did not join");
}

bool NcclCommunicator::State::nccl_in_progress(const char* op) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t code = ncclCommGetAsyncError(comm, &state);
  if (code != ncclSuccess) {
    fail_abort(std::string(op) + " on " + description +
               ": ncclCommGetAsyncError failed: " + nccl_text(code, comm));
  }
  if (state == ncclSuccess) return false;
  if (state == ncclInProgress) return true;
  fail_abort(std::string(op) + " on " + description + " failed: NCCL reported " +
             nccl_text(state, comm));
}

void NcclCommunicator::State::check_call(ncclResult_t code, const char* op, const char* call) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  fail_abort(std::string(op) + " on " + description + ": " + call +
             " failed: " + nccl_text(code, comm));
}

void NcclCommunicator::State::enqueued(ncclResult_t code, const char* op, const char* call,
                                       Clock::time_point deadline, double timeout) {
  if (code != ncclSuccess && code != ncclInProgress) {
    fail_abort(std::string(op) + " on " + description + ": " + call +
               " failed: " + nccl_text(code, comm));
  }
  for (long polls = 0; nccl_in_progress(op); ++polls) {
    if (Clock::now() > deadline) fail_timeout(op, timeout);
    nccl_detail::pause_poll(polls);
  }
}

void NcclCommunicator::State::wait_for(cudaEvent_t event, const char* op,
                                       Clock::time_point deadline, double timeout) {
  for (long polls = 0;; ++polls) {
    const cudaError_t done = event != nullptr ? cudaEventQuery(event) : cudaStreamQuery(stream);
    if (done != cudaSuccess && done != cudaErrorNotReady) {
      cudaGetLastError();
      fail_abort(std::string(op) + " on " + description +
                 ": the CUDA stream failed: " + cuda_text(done));
    }
    nccl_in_progress(op);  // throws on an asynchronous NCCL error
    if (done == cudaSuccess) return;
    if (Clock::now() > deadline) fail_timeout(op, timeout);
    nccl_detail::pause_poll(polls);
  }
}

void NcclCommunicator::State::order_after_kokkos(const char* op) {
  cudaStream_t kokkos = nullptr;
  if (!nccl_detail::kokkos_stream_on(device, &kokkos)) {
    // Rules 5 and 6: host kernels, or Kokkos on another device (its instance only).
    if (Kokkos::is_initialized()) {
      fence_device(MESHTRAIN_LABEL("meshtrain::NcclCommunicator::order_after_kokkos"));
    }
    return;
  }
  nccl_detail::check_cuda(cudaEventRecord(kokkos_ready, kokkos), op, description,
                          "cudaEventRecord on Kokkos' stream");
  nccl_detail::check_cuda(cudaStreamWaitEvent(stream, kokkos_ready, 0), op, description,
                          "cudaStreamWaitEvent of the NCCL stream");
}

void NcclCommunicator::State::order_kokkos_after(cudaEvent_t event, const char* op) {
  cudaStream_t kokkos = nullptr;
  if (!nccl_detail::kokkos_stream_on(device, &kokkos)) return;  // the host saw `event` complete
  nccl_detail::check_cuda(cudaStreamWaitEvent(kokkos, event, 0), op, description,
                          "cudaStreamWaitEvent of Kokkos' stream");
}

}  // namespace meshtrain
