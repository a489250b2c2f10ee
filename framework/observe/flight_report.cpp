#include "framework/observe/flight_report.hpp"

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

// The entries `file`'s rank is waiting in: those entered or failed (a blocking collective
// running, or one that threw: a timeout); when there are none, the started ones (a rank in
// the wait for one of them).
std::vector<const FlightRecordFile::Entry*> waiting_entries(const FlightRecordFile& file) {
  std::vector<const FlightRecordFile::Entry*> blocking, started;
  for (const auto& e : file.entries) {
    if (e.state == "entered" || e.state == "failed") blocking.push_back(&e);
    if (e.state == "started") started.push_back(&e);
  }
  return blocking.empty() ? started : blocking;
}

// The ranks of `nodes` on a cycle of `edges` (in a strongly connected component of more than
// one rank; there are no edges from a rank to itself): Tarjan's algorithm, iterative.
std::set<int> ranks_on_cycles(const std::vector<int>& nodes,
                              const std::map<int, std::vector<int>>& edges) {
  std::map<int, int> index, low;
  std::set<int> on_stack, cyclic;
  std::vector<int> stack;
  int next = 0;
  const auto successors = [&](int node) -> const std::vector<int>& {
    static const std::vector<int> none;
    const auto found = edges.find(node);
    return found == edges.end() ? none : found->second;
  };
  for (const int start : nodes) {
    if (index.count(start) != 0) continue;
    std::vector<std::pair<int, std::size_t>> work = {{start, 0}};  // node, next edge
    index[start] = low[start] = next++;
    stack.push_back(start);
    on_stack.insert(start);
    while (!work.empty()) {
      auto& [node, edge] = work.back();
      const std::vector<int>& out = successors(node);
      if (edge < out.size()) {
        const int to = out[edge++];
        if (index.count(to) == 0) {
          index[to] = low[to] = next++;
          stack.push_back(to);
          on_stack.insert(to);
          work.push_back({to, 0});
        } else if (on_stack.count(to) != 0) {
          low[node] = std::min(low[node], index[to]);
        }
        continue;
      }
      if (low[node] == index[node]) {  // the root of a component: pop it
        std::vector<int> component;
        int member = 0;
        do {
          member = stack.back();
          stack.pop_back();
          on_stack.erase(member);
          component.push_back(member);
        } while (member != node);
        if (component.size() > 1) cyclic.insert(component.begin(), component.end());
      }
      const int done = node;
      work.pop_back();
      if (!work.empty()) low[work.back().first] = std::min(low[work.back().first], low[done]);
    }
  }
  return cyclic;
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

HangRoots find_hang_roots(const std::vector<FlightRecordFile>& records) {
  HangRoots result;
  std::map<int, const FlightRecordFile*> by_rank;
  for (const auto& r : records) by_rank[r.rank] = &r;
  // The edges: who waits on whom, directly.
  for (const auto& file : records) {
    std::set<int> targets;
    for (const FlightRecordFile::Entry* e : waiting_entries(file)) {
      if (e->group_id < 0 || static_cast<std::size_t>(e->group_id) >= file.groups.size()) continue;
      const FlightRecordFile::Group& group = file.groups[static_cast<std::size_t>(e->group_id)];
      for (const int member : group.world_ranks) {
        if (member == file.rank) continue;
        const auto other = by_rank.find(member);
        if (other == by_rank.end()) {  // no record: it may be the one everybody waits on
          targets.insert(member);
          continue;
        }
        const FlightRecordFile::Group* theirs =
            find_group(*other->second, group.description, group.world_ranks);
        if ((theirs != nullptr ? theirs->entered : 0) < e->sequence) targets.insert(member);
      }
    }
    if (!targets.empty()) result.waits_on[file.rank].assign(targets.begin(), targets.end());
  }
  if (result.waits_on.empty()) return result;

  // The roots: ranks waited on that wait on nobody; each with every rank that reaches it.
  std::map<int, std::vector<int>> waited_on_by;
  std::set<int> sinks;
  for (const auto& [rank, targets] : result.waits_on) {
    for (const int target : targets) {
      waited_on_by[target].push_back(rank);
      if (result.waits_on.count(target) == 0) sinks.insert(target);
    }
  }
  std::set<int> rooted;
  for (const int sink : sinks) {
    HangRoots::Root root;
    root.rank = sink;
    const auto record = by_rank.find(sink);
    root.has_record = record != by_rank.end();
    root.in_collective = root.has_record && !waiting_entries(*record->second).empty();
    std::set<int> reached;
    std::vector<int> frontier = {sink};
    while (!frontier.empty()) {
      const int node = frontier.back();
      frontier.pop_back();
      for (const int waiter : waited_on_by[node]) {
        if (reached.insert(waiter).second) frontier.push_back(waiter);
      }
    }
    root.waiting.assign(reached.begin(), reached.end());
    rooted.insert(reached.begin(), reached.end());
    result.roots.push_back(std::move(root));
  }
  // The waiting ranks that reach no root: every path from them ends in a cycle.
  std::vector<int> unrooted;
  for (const auto& [rank, targets] : result.waits_on) {
    if (rooted.count(rank) == 0) unrooted.push_back(rank);
  }
  const std::set<int> cyclic = ranks_on_cycles(unrooted, result.waits_on);
  for (const int rank : unrooted) {
    (cyclic.count(rank) != 0 ? result.cycle : result.behind_cycle).push_back(rank);
  }
  return result;
}

std::string HangRoots::sentence() const {
  std::ostringstream out;
  const char* separator = "";
  for (const Root& root : roots) {
    out << separator << "rank " << root.rank
        << (roots.size() == 1 ? " is the root: " : " is a root: ") << rank_list(root.waiting)
        << (root.waiting.size() == 1 ? " waits" : " wait")
        << " on it directly or through another rank ("
        << (!root.has_record     ? "it wrote no flight record"
            : root.in_collective ? "its record shows it in a collective every member entered"
                                 : "its record shows it in no collective")
        << ")";
    separator = "; ";
  }
  if (!cycle.empty()) {
    std::vector<int> all = cycle;
    all.insert(all.end(), behind_cycle.begin(), behind_cycle.end());
    std::sort(all.begin(), all.end());
    out << separator << "no rank is at the root of the wait of " << rank_list(all) << ": "
        << rank_list(cycle)
        << " wait on each other in a cycle (each is in a collective another has not entered: "
           "collectives in different orders on different ranks)";
    if (!behind_cycle.empty()) {
      out << ", and " << rank_list(behind_cycle) << (behind_cycle.size() == 1 ? " waits" : " wait")
          << " on them";
    }
  }
  return out.str();
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
