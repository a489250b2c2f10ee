#pragma once
// Text helpers shared by messages and printouts (partition has no other dependency).

#include <cstddef>
#include <string>
#include <vector>

namespace meshtrain {

// The items with `separator` between them: join({"dp", "tp"}) == "dp, tp"; "" for none.
inline std::string join(const std::vector<std::string>& items,
                        const std::string& separator = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += separator;
    out += items[i];
  }
  return out;
}

}  // namespace meshtrain
