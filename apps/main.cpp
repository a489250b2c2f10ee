// Placeholder until the command lands: prints the version.
#include <cstdio>

#include "framework/version.hpp"

int main() {
  std::printf("meshtrain %s\n", meshtrain::framework_version());
  return 0;
}
