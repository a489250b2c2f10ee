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

// `text` without the spaces and tabs at either end.
inline std::string trim(std::string text) {
  const char* space = " \t";
  text.erase(0, text.find_first_not_of(space));
  const size_t last = text.find_last_not_of(space);
  text.erase(last == std::string::npos ? 0 : last + 1);
  return text;
}

// A tuple of mesh axes as plans and messages write it: "(fsdp, dp)".
inline std::string tuple_text(const std::vector<std::string>& axes) {
  return "(" + join(axes) + ")";
}

}  // namespace meshtrain
