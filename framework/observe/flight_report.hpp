#pragma once
// Reading the flight recorder's files (flight_recorder.hpp) and naming, from them, the first
// collective some rank of a group never entered and which ranks those are, and the rank at
// the root of the wait (find_hang_roots): used by a rank whose collective timed out (for its
// error message) and by `meshtrain flight-report RUN_DIR` after the fact.
//
// A rank entered collective #S of a group when its record's count for that group is at
// least S; a rank whose count is lower skipped it or never got there (its last on the group
// is named); a member rank without a file was stopped, killed, or busy outside any
// collective when the others wrote theirs. Ranks are world ranks.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace meshtrain {

struct FlightRecordFile {
  struct Group {
    std::string description;
    int size = 0;
    int rank = 0;                  // this rank's place in the group
    std::vector<int> world_ranks;  // empty when the backend did not say
    uint64_t entered = 0;          // collectives this rank entered on the group
  };
  struct Entry {
    uint64_t sequence = 0;
    std::string op, group, wire, state;
    int group_id = -1;  // index into groups
    int64_t bytes = 0;
    int64_t begin_ns = 0, end_ns = 0;
  };
  std::string path;
  int rank = 0;
  int world_size = 0;
  std::string reason;
  int64_t written_ns = 0;
  std::vector<Group> groups;
  std::vector<Entry> entries;  // oldest first
};

// One file; throws bad_input naming the file when it is not a flight record.
FlightRecordFile read_flight_record(const std::string& path);
// Every rank-<k>.json in `dir`, by rank; throws bad_input when `dir` does not exist.
std::vector<FlightRecordFile> read_flight_records(const std::string& dir);

struct FlightFinding {
  struct Behind {
    int rank = 0;
    uint64_t last_sequence = 0;  // 0: none on that group
    std::string last_op;         // "" when out of its ring
  };
  std::string group;
  std::vector<int> members;  // world ranks; empty when unknown
  uint64_t sequence = 0;
  std::string op;  // "" when no record holds it any more
  std::vector<int> entered;
  std::vector<Behind> never_entered;
  std::vector<int> no_record;  // members without a file
  // "all_reduce #57 on axis (dp): rank 1 never entered it (its last on that group: all_gather
  // #56); rank 3 wrote no flight record (stopped, killed, or busy outside a collective); rank 0
  // entered it"
  std::string sentence() const;
};

// Collective #sequence of the group `description` with members `members` (world ranks):
// which ranks' records show they entered it, which show they did not, and which members
// wrote none. With no members, only the ranks that have the group in their records count.
FlightFinding compare_flight_records(const std::vector<FlightRecordFile>& records,
                                     const std::string& description,
                                     const std::vector<int>& members, uint64_t sequence);

// After the fact: for every group in the records where a member's count is behind the
// others', a member wrote no file, or the last collective did not complete everywhere, the
// first collective not entered by all (or the one they stopped in). Empty when every group's
// last collective completed on every member.
std::vector<FlightFinding> find_stuck_collectives(const std::vector<FlightRecordFile>& records);

// The wait chain of a hang, followed as PyTorch's flight-recorder analyzer does. A rank waits
// on another when it is in a collective (its record's entries in state entered or failed; a
// rank in none of those: its started ones) that the other, a member of the same group, never
// entered (its count on the group is lower) or when the other wrote no record. Following
// these edges from every waiting rank ends either at a root (a rank that waits on nobody: it
// wrote no record, or its record shows it outside any collective, or in one every member
// entered) or in a cycle (ranks each in a collective another has not entered: collectives in
// different orders on different ranks), which has no root and is said so. A rank stopped
// (SIGSTOP) in a 2-D mesh is the root of its direct partners on both axes and, through them,
// of the ranks that wait on those: "rank 3 is the root: ranks 0, 1, 2 wait on it directly or
// through another rank".
struct HangRoots {
  struct Root {
    int rank = 0;
    bool has_record = false;     // false: it wrote no record (stopped, killed, or busy)
    bool in_collective = false;  // its record shows it in a collective every member entered
    std::vector<int> waiting;    // the ranks that wait on it, directly or through another rank
  };
  std::map<int, std::vector<int>> waits_on;  // rank -> the ranks it waits on directly
  std::vector<Root> roots;                   // by rank
  std::vector<int> cycle;                    // ranks waiting on each other in a cycle (no root)
  std::vector<int> behind_cycle;             // ranks that wait on the cycle (and reach no root)
  // "" when no rank waits on another; else one clause per root and one for a cycle:
  // "rank 3 is the root: ranks 0, 1, 2 wait on it directly or through another rank (it
  // wrote no flight record)".
  std::string sentence() const;
};

// Ranks are those of `records` and the members of their groups (world ranks); a group whose
// members the backend did not say is not followed.
HangRoots find_hang_roots(const std::vector<FlightRecordFile>& records);

}  // namespace meshtrain
