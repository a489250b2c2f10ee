// What the flight recorder ([runtime] flight_records) adds to a collective: the recording
// alone (enter + finish, nothing else) and a blocking barrier on a one-rank communicator (the
// cheapest collective there is, so the recorder's share is the largest it can be), each with
// the recorder off and on (64 entries), interleaved over rounds. JSON lines: one per variant
// and round (nanoseconds per operation over ITERATIONS), then one summary line per variant
// with the median over the rounds. Run with one rank: `bench_flight_record [ROUNDS]
// [ITERATIONS]`.

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/observe/flight_recorder.hpp"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class Body>
double ns_per_call(int iterations, Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  for (int k = 0; k < iterations; ++k) body();
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
  return took.count() / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
    const int iterations = argc > 2 ? std::atoi(argv[2]) : 200000;
    const std::string dir = std::filesystem::temp_directory_path().string() +
                            "/meshtrain_bench_flight_" + std::to_string(getpid());
    auto comm = meshtrain::MpiCommunicator::duplicate(MPI_COMM_SELF, "bench self");
    meshtrain::FlightRecorder& recorder = meshtrain::flight_recorder();
    const int group = recorder.register_group("bench recording", 1, 0);
    std::map<std::string, std::vector<double>> results;
    for (int round = 1; round <= rounds; ++round) {
      for (const bool on : {false, true}) {
        recorder.configure(on ? 64 : 0, dir, 0, 1);
        const char* variant = on ? "on" : "off";
        const double record = ns_per_call(iterations, [&] {
          recorder.finish(recorder.enter(group, "all_reduce", 4096, "fp32", false),
                          meshtrain::FlightState::completed);
        });
        const double barrier = ns_per_call(iterations, [&] { comm.barrier(); });
        results[std::string("record_") + variant].push_back(record);
        results[std::string("barrier_") + variant].push_back(barrier);
        std::printf(
            "{\"bench\": \"flight_record\", \"variant\": \"%s\", \"round\": %d, "
            "\"iterations\": %d, \"record_ns\": %.2f, \"barrier_ns\": %.2f}\n",
            variant, round, iterations, record, barrier);
      }
    }
    for (const auto& [name, values] : results) {
      std::printf(
          "{\"bench\": \"flight_record\", \"summary\": true, \"what\": \"%s\", "
          "\"median_ns\": %.2f}\n",
          name.c_str(), median(values));
    }
    recorder.configure(0, "", 0, 1);
    std::filesystem::remove_all(dir);
    return 0;
  });
}
