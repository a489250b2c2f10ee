#pragma once
// Text helpers shared by messages and printouts (partition has no other dependency).

#include <algorithm>
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

// Whether `items` holds `item`.
inline bool contains(const std::vector<std::string>& items, const std::string& item) {
  return std::find(items.begin(), items.end(), item) != items.end();
}

// A tuple of mesh axes as plans and messages write it: "(fsdp, dp)".
inline std::string tuple_text(const std::vector<std::string>& axes) {
  return "(" + join(axes) + ")";
}

}  // namespace meshtrain
