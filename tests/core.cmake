# framework/core/ pieces with no communication: the bf16 and fp16 conversions of
# precision.hpp against a reference in double (exhaustive over the 16-bit patterns, ties,
# subnormals, overflow, NaN, random floats) and the kernels built on them.
meshtrain_add_test(NAME core_precision_test SOURCES core/precision_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# Philox-4x32-10 (framework/core/philox.hpp) against Random123's known-answer vectors.
meshtrain_add_test(NAME core_philox_test SOURCES core/philox_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
