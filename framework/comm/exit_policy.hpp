#pragma once
// How a meshtrain program ends when something fails. The library never exits: a program's
// main applies this policy (the meshtrain command, the benchmarks and the test tools do; a
// program of your own may choose another). Exit status 2 for bad input, 1 for anything
// else; an error that struck only some ranks ends every rank (MPI_Abort), so no rank waits
// forever on one that failed.

#include <exception>
#include <functional>
#include <memory>
#include <string>

#include "framework/comm/runtime.hpp"

namespace meshtrain {

// Exit status for an error: 2 for bad_input, 1 for anything else.
int exit_status_for(const std::exception& error);

// Prints "meshtrain: error on rank R: <message>" to stderr and ends every rank of the job
// with MPI_Abort(MPI_COMM_WORLD, exit_status). Without MPI initialized it calls
// std::exit. Never returns.
[[noreturn]] void abort_all_ranks(const std::string& message, int exit_status);

// Runs `body`; an exception escaping it on any rank goes to abort_all_ranks with
// exit_status_for(it). Returns body's value otherwise. For the main of an MPI program.
int run_or_abort(const std::function<int()>& body);

// The Runtime of an MPI program's main. When starting it fails on some rank (no usable GPU,
// an MPI without thread support), that rank ends the job at once with its message
// (abort_all_ranks) while the other ranks may be waiting for it in their first collective.
std::unique_ptr<Runtime> start_runtime_or_abort(int& argc, char**& argv,
                                                const StartupCheck& check = require_usable_device);

}  // namespace meshtrain
