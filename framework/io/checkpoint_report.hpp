#pragma once
// `meshtrain inspect CHECKPOINT.h5 [--verify]`: prints what a checkpoint holds (step,
// mesh, train state, datasets with shapes, dtypes and specs, the run's config). Reads the
// file with the serial HDF5 driver, so it needs no mpirun.

#include <ostream>
#include <string>

namespace meshtrain {

// Prints the listing of `path` to `out`; with `verify`, also reads every dataset fully and
// checks its checksum (CRC-32, or Fletcher32 in format-1 files). Returns 0. Throws bad_input naming the file (or the
// dataset that fails its checksum).
int print_checkpoint(const std::string& path, bool verify, std::ostream& out);

}  // namespace meshtrain
