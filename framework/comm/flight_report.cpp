#include "framework/comm/flight_report.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "base/error.hpp"

namespace meshtrain {

FlightRecordFile read_flight_record(const std::string& path) {
  std::ifstream in(path);
  if (!in) MESHTRAIN_BAD_INPUT("cannot read the flight record '", path, "'");
  FlightRecordFile file;
  file.path = path;
  try {
    const nlohmann::json doc = nlohmann::json::parse(in);
    file.rank = doc.at("rank").get<int>();
    file.world_size = doc.at("world_size").get<int>();
    file.reason = doc.at("reason").get<std::string>();
    file.written_ns = doc.at("written_unix_ns").get<int64_t>();
    for (const auto& g : doc.at("groups")) {
      FlightRecordFile::Group group;
      group.description = g.at("group").get<std::string>();
      group.size = g.at("size").get<int>();
      group.rank = g.at("rank").get<int>();
      group.entered = g.at("entered").get<uint64_t>();
      group.world_ranks = g.at("world_ranks").get<std::vector<int>>();
      file.groups.push_back(std::move(group));
    }
    for (const auto& e : doc.at("entries")) {
      FlightRecordFile::Entry entry;
      entry.sequence = e.at("sequence").get<uint64_t>();
      entry.op = e.at("op").get<std::string>();
      entry.group = e.at("group").get<std::string>();
      entry.group_id = e.at("group_id").get<int>();
      entry.wire = e.at("wire").get<std::string>();
      entry.state = e.at("state").get<std::string>();
      entry.bytes = e.at("bytes").get<int64_t>();
      entry.begin_ns = e.at("begin_unix_ns").get<int64_t>();
      entry.end_ns = e.at("end_unix_ns").get<int64_t>();
      file.entries.push_back(std::move(entry));
    }
  } catch (const nlohmann::json::exception& e) {
    MESHTRAIN_BAD_INPUT("'", path, "' is not a flight record: ", e.what());
  }
  return file;
}

std::vector<FlightRecordFile> read_flight_records(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    MESHTRAIN_BAD_INPUT("'", dir, "' is not a directory of flight records");
  }
  const std::regex name("rank-[0-9]+\\.json");
  std::vector<FlightRecordFile> records;
  for (const auto& item : fs::directory_iterator(dir)) {
    if (!std::regex_match(item.path().filename().string(), name)) continue;
    records.push_back(read_flight_record(item.path().string()));
  }
  std::sort(records.begin(), records.end(),
            [](const FlightRecordFile& a, const FlightRecordFile& b) { return a.rank < b.rank; });
  return records;
}

namespace {

// The group `description` with these members in `file` (members empty: by description only).
const FlightRecordFile::Group* find_group(const FlightRecordFile& file,
                                          const std::string& description,
                                          const std::vector<int>& members) {
  for (const auto& g : file.groups) {
    if (g.description != description) continue;
    if (members.empty() || g.world_ranks.empty() || g.world_ranks == members) return &g;
  }
  return nullptr;
}

// The operation of collective #sequence of `group` in `file`'s ring ("" when not there).
std::string op_of(const FlightRecordFile& file, const FlightRecordFile::Group& group,
                  uint64_t sequence) {
  const int id = static_cast<int>(&group - file.groups.data());
  for (const auto& e : file.entries) {
    if (e.group_id == id && e.sequence == sequence) return e.op;
  }
  return "";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (std::size_t k = 0; k < ranks.size(); ++k) out << (k == 0 ? "" : ", ") << ranks[k];
  return out.str();
}

}  // namespace

std::string FlightFinding::sentence() const {
  std::ostringstream out;
  out << (op.empty() ? "collective" : op) << " #" << sequence << " on " << group << ":";
  const char* separator = " ";
  for (const Behind& b : never_entered) {
    out << separator << "rank " << b.rank << " never entered it (its last on that group: ";
    if (b.last_sequence == 0) {
      out << "none";
    } else {
      out << (b.last_op.empty() ? "collective" : b.last_op) << " #" << b.last_sequence;
    }
    out << ")";
    separator = "; ";
  }
  if (!no_record.empty()) {
    out << separator << rank_list(no_record)
        << " wrote no flight record (stopped, killed, or busy outside a collective)";
    separator = "; ";
  }
  if (!entered.empty()) {
    out << separator << rank_list(entered) << " entered it";
  } else if (never_entered.empty() && no_record.empty()) {
    out << separator << "no record shows it";
  }
  return out.str();
}

FlightFinding compare_flight_records(const std::vector<FlightRecordFile>& records,
                                     const std::string& description,
                                     const std::vector<int>& members, uint64_t sequence) {
  FlightFinding finding;
  finding.group = description;
  finding.members = members;
  finding.sequence = sequence;
  std::map<int, const FlightRecordFile*> by_rank;
  for (const auto& r : records) by_rank[r.rank] = &r;
  std::vector<int> ranks = members;
  if (ranks.empty()) {
    for (const auto& r : records) {
      if (find_group(r, description, members) != nullptr) ranks.push_back(r.rank);
    }
  }
  for (const int rank : ranks) {
    const auto found = by_rank.find(rank);
    if (found == by_rank.end()) {
      finding.no_record.push_back(rank);
      continue;
    }
    const FlightRecordFile& file = *found->second;
    const FlightRecordFile::Group* group = find_group(file, description, members);
    const uint64_t entered = group != nullptr ? group->entered : 0;
    if (entered >= sequence) {
      finding.entered.push_back(rank);
      if (finding.op.empty() && group != nullptr) finding.op = op_of(file, *group, sequence);
    } else {
      FlightFinding::Behind behind;
      behind.rank = rank;
      behind.last_sequence = entered;
      if (group != nullptr && entered > 0) behind.last_op = op_of(file, *group, entered);
      finding.never_entered.push_back(std::move(behind));
    }
  }
  return finding;
}

std::vector<FlightFinding> find_stuck_collectives(const std::vector<FlightRecordFile>& records) {
  // Every group (description and members) some record holds, in the order first seen.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const auto& r : records) {
    for (const auto& g : r.groups) {
      std::pair<std::string, std::vector<int>> key{g.description, g.world_ranks};
      if (std::find(groups.begin(), groups.end(), key) == groups.end()) groups.push_back(key);
    }
  }
  std::vector<FlightFinding> findings;
  for (const auto& [description, members] : groups) {
    uint64_t low = UINT64_MAX, high = 0;
    bool incomplete = false;
    for (const auto& r : records) {
      const FlightRecordFile::Group* g = find_group(r, description, members);
      if (g == nullptr) continue;
      low = std::min(low, g->entered);
      high = std::max(high, g->entered);
      const int id = static_cast<int>(g - r.groups.data());
      for (const auto& e : r.entries) {
        if (e.group_id == id && e.sequence == g->entered && e.state != "completed") {
          incomplete = true;
        }
      }
    }
    if (high == 0) continue;
    bool missing_file = false;
    for (const int rank : members) {
      const bool has = std::any_of(records.begin(), records.end(),
                                   [&](const FlightRecordFile& r) { return r.rank == rank; });
      missing_file = missing_file || !has;
    }
    if (low < high) {
      findings.push_back(compare_flight_records(records, description, members, low + 1));
    } else if (missing_file || incomplete) {
      findings.push_back(compare_flight_records(records, description, members, high));
    }
  }
  return findings;
}

}  // namespace meshtrain
