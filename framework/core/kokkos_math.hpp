#pragma once
// Kokkos math functions usable inside kernels (sqrt, exp, log, tanh, ...), under one name
// across Kokkos versions: they moved out of Kokkos::Experimental in 3.7.

#include <Kokkos_Core.hpp>

namespace meshtrain {
#if KOKKOS_VERSION >= 30700
namespace kmath = ::Kokkos;
#else
namespace kmath = ::Kokkos::Experimental;
#endif
}  // namespace meshtrain
