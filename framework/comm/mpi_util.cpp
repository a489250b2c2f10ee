#include "framework/comm/mpi_util.hpp"

#include <sched.h>

#include <cstddef>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/communicator.hpp"  // collective_timeout_from_env, checked_int
#include "framework/observe/trace.hpp"

namespace meshtrain {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    MESHTRAIN_FAIL(what, " failed with MPI error code ", code);
  }
  MESHTRAIN_FAIL(what, " failed: ", std::string(text, static_cast<std::size_t>(length)));
}

NodePlace node_place(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type (the ranks of one node)");
  NodePlace place;
  const int rank_code = MPI_Comm_rank(node, &place.local_rank);
  const int size_code = MPI_Comm_size(node, &place.local_size);
  MPI_Comm_free(&node);
  check_mpi(rank_code, "MPI_Comm_rank of the node communicator");
  check_mpi(size_code, "MPI_Comm_size of the node communicator");
  return place;
}

std::vector<int> world_ranks_of(MPI_Comm comm) {
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  std::vector<int> group_ranks(static_cast<std::size_t>(size)), world_ranks(group_ranks.size());
  for (int k = 0; k < size; ++k) group_ranks[static_cast<std::size_t>(k)] = k;
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  check_mpi(MPI_Comm_group(comm, &group), "MPI_Comm_group");
  const int world_code = MPI_Comm_group(MPI_COMM_WORLD, &world);
  const int translated =
      world_code != MPI_SUCCESS
          ? world_code
          : MPI_Group_translate_ranks(group, size, group_ranks.data(), world, world_ranks.data());
  const int freed_group = MPI_Group_free(&group);
  const int freed_world = world_code == MPI_SUCCESS ? MPI_Group_free(&world) : MPI_SUCCESS;
  check_mpi(world_code, "MPI_Comm_group (world)");
  check_mpi(translated, "MPI_Group_translate_ranks");
  check_mpi(freed_group, "MPI_Group_free");
  check_mpi(freed_world, "MPI_Group_free (world)");
  return world_ranks;
}

int64_t clock_offset_to_rank0_ns(MPI_Comm comm) {
  check_mpi(MPI_Barrier(comm), "MPI_Barrier (trace clock)");
  const int64_t mine = Tracer::now_ns();
  int64_t rank0 = mine;
  check_mpi(MPI_Bcast(&rank0, 1, MPI_INT64_T, 0, comm), "MPI_Bcast (trace clock)");
  return rank0 - mine;
}

bool wait_all_until(MPI_Request* requests, int count, double timeout, const char* op) {
  return wait_all_until(requests, count, timeout, [op](int code) { check_mpi(code, op); });
}

void wait_collective(MPI_Request* requests, int count, const char* op) {
  const double timeout = collective_timeout_from_env();
  if (wait_all_until(requests, count, timeout, op)) return;
  MESHTRAIN_FAIL(op, " did not complete within ", timeout,
                 " s (MESHTRAIN_COLLECTIVE_TIMEOUT): a rank is dead or stalled");
}

namespace {
std::size_t bytes_of(int count, MPI_Datatype type, const char* op) {
  int size = 0;
  check_mpi(MPI_Type_size(type, &size), op);
  return static_cast<std::size_t>(count) * static_cast<std::size_t>(size);
}
}  // namespace

void broadcast_collective(void* data, int count, MPI_Datatype type, int root, MPI_Comm comm,
                          const char* op) {
  const std::size_t bytes = bytes_of(count, type, op);
  std::vector<char> buffer(bytes);
  if (bytes > 0) std::memcpy(buffer.data(), data, bytes);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(buffer.data(), count, type, root, comm, &request), op);
  wait_collective_or_give_up(&request, 1, op, buffer);
  if (bytes > 0) std::memcpy(data, buffer.data(), bytes);
}

void all_reduce_collective(void* data, int count, MPI_Datatype type, MPI_Op reduction,
                           MPI_Comm comm, const char* op) {
  std::vector<char> buffer;
  all_reduce_collective(data, count, type, reduction, comm, op, buffer);
}

void all_reduce_collective(void* data, int count, MPI_Datatype type, MPI_Op reduction,
                           MPI_Comm comm, const char* op, std::vector<char>& buffer) {
  const std::size_t bytes = bytes_of(count, type, op);
  if (buffer.size() < 2 * bytes) buffer.resize(2 * bytes);  // what this rank sends, the result
  if (bytes > 0) std::memcpy(buffer.data(), data, bytes);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(
      MPI_Iallreduce(buffer.data(), buffer.data() + bytes, count, type, reduction, comm, &request),
      op);
  wait_collective_or_give_up(&request, 1, op, buffer);
  if (bytes > 0) std::memcpy(data, buffer.data() + bytes, bytes);
}

void broadcast_string(std::string& text, int root, MPI_Comm comm, const char* op) {
  int length = checked_int(text.size(), op);
  broadcast_collective(&length, 1, MPI_INT, root, comm, op);
  text.resize(static_cast<size_t>(length));
  if (length > 0) broadcast_collective(text.data(), length, MPI_CHAR, root, comm, op);
}

void detail::pause_between_polls(double waited) {
  if (waited > 0.5) {
    const timespec pause{0, 200000};
    nanosleep(&pause, nullptr);
  } else {
    sched_yield();
  }
}

}  // namespace meshtrain
