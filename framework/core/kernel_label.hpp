#pragma once
// Kernel labels that cost nothing per launch. Kokkos 3.4 takes a kernel's label as
// `const std::string&`, so a string literal longer than the small-string buffer (15
// characters) becomes a heap allocation at every launch, inside the training step.
// MESHTRAIN_LABEL builds the string once per call site (a function-local static) and
// hands Kokkos a reference to it:
//
//   Kokkos::parallel_for(MESHTRAIN_LABEL("meshtrain::relu_forward"), policy, functor);

#include <string>

#define MESHTRAIN_LABEL(text)                        \
  ([]() -> const std::string& {                      \
    static const std::string meshtrain_label_(text); \
    return meshtrain_label_;                         \
  }())
