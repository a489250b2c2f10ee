#include "framework/core/version.hpp"

namespace meshtrain {
const char* framework_version() {
  return MESHTRAIN_VERSION;
}
}  // namespace meshtrain
