#pragma once
// Host staging for an MPI that cannot take device pointers (Debian's Open MPI is not
// CUDA-aware), as Aluminum's HostTransfer backend does it, but synchronously: with device
// memory (a CUDA Kokkos) an operation copies its send data into a pinned host buffer, MPI
// works on host buffers, and the received data is copied back. With host memory (Serial,
// OpenMP) the caller's buffers go to MPI unchanged and nothing is copied.
//
// The two buffers grow on first use and are kept, so a training step's collectives stop
// allocating after the first step. One HostStaging serves one operation at a time.
//
//   const float* send_mpi = staging.send_buffer(send, count);
//   float* recv_mpi = staging.receive_buffer(recv, total, /*copy_in=*/false);
//   MPI_Allgather(send_mpi, ..., recv_mpi, ...);
//   staging.finish_receive(recv, total);

#include <Kokkos_Core.hpp>
#include <cstddef>

#include "framework/core/kernel_label.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/core/views.hpp"

namespace meshtrain {

class HostStaging {
 public:
  // Whether MPI needs host copies of Kokkos' default memory space (or, emulating device
  // memory, is given them as if it did).
  static bool stages() { return device_memory_is_separate(); }

  // What MPI sends from: `data` itself, or a host copy of its `count` elements.
  template <class T>
  const T* send_buffer(const T* data, std::size_t count) {
    if (!stages()) return data;
    T* host = reinterpret_cast<T*>(grow(send_, count * sizeof(T)));
    copy_to_host(host, data, count);
    return host;
  }

  // What MPI receives into: `data` itself, or a host buffer of `count` elements, filled
  // from `data` first when the operation works in place (copy_in).
  template <class T>
  T* receive_buffer(T* data, std::size_t count, bool copy_in) {
    if (!stages()) return data;
    T* host = reinterpret_cast<T*>(grow(receive_, count * sizeof(T)));
    if (copy_in) copy_to_host(host, data, count);
    return host;
  }

  // Bytes the buffers hold now (0 without staging).
  std::size_t send_capacity() const { return send_.extent(0); }
  std::size_t receive_capacity() const { return receive_.extent(0); }

  // Grows both buffers to at least these sizes now (no-op without staging).
  void reserve(std::size_t send_bytes, std::size_t receive_bytes) {
    if (!stages()) return;
    grow(send_, send_bytes);
    grow(receive_, receive_bytes);
  }

  // After MPI completed: the received elements back into `data` (no-op without staging).
  template <class T>
  void finish_receive(T* data, std::size_t count) {
    if (!stages()) return;
    copy_to_device(data, reinterpret_cast<const T*>(receive_.data()), count);
  }

 private:
  using Bytes = Kokkos::View<char*, HostStagingSpace>;

  static char* grow(Bytes& buffer, std::size_t bytes) {
    if (buffer.extent(0) < bytes) {
      buffer = Bytes();  // free the old one first
      buffer = Bytes(Kokkos::view_alloc(Kokkos::WithoutInitializing,
                                        MESHTRAIN_LABEL("meshtrain::mpi_host_staging")),
                     bytes);
    }
    return buffer.data();
  }

  using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;

  template <class T>
  static void copy_to_host(T* host, const T* device, std::size_t count) {
    Kokkos::View<T*, Kokkos::HostSpace, Unmanaged> to(host, count);
    Kokkos::View<const T*, Kokkos::DefaultExecutionSpace::memory_space, Unmanaged> from(device,
                                                                                        count);
    copy_view(to, from);
  }
  template <class T>
  static void copy_to_device(T* device, const T* host, std::size_t count) {
    Kokkos::View<T*, Kokkos::DefaultExecutionSpace::memory_space, Unmanaged> to(device, count);
    Kokkos::View<const T*, Kokkos::HostSpace, Unmanaged> from(host, count);
    copy_view(to, from);
  }

  Bytes send_;
  Bytes receive_;
};

}  // namespace meshtrain
