#pragma once
// Checkpoint checksums: the CRC-32 of a dataset's bytes (ISA-L's or zlib's), and the pieces
// each rank computes for the runs it writes or reads, gathered and combined at rank 0 into
// each dataset's CRC-32 (the crc32 attribute, see checkpoint_format.hpp). Internal to the
// checkpoint code (checkpoint_save.cpp, checkpoint_load.cpp; checkpoint_inspect.cpp uses
// crc32_update only); the public interface is framework/io/checkpoint.hpp.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "framework/io/checkpoint_comm.hpp"
#include "framework/io/checkpoint_format.hpp"

namespace meshtrain::checkpoint_format {

// CRC-32 of `bytes` continuing from `crc` (0 to start): ISA-L's when built with it, zlib's
// otherwise (the same value).
uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes);

// The CRC-32 of one contiguous byte range of a dataset, computed by one rank.
struct Piece {
  int64_t dataset = 0;  // index in dataset_entries order
  int64_t offset = 0;   // bytes from the dataset's start
  int64_t length = 0;   // bytes
  uint32_t crc = 0;
  uint32_t pad = 0;
};

// Appends a piece, merging it into the last one when it continues it.
void append_piece(std::vector<Piece>& pieces, const Piece& piece);

// Collective: gathers every rank's pieces at rank 0. `count` must have been checked by
// checked_int before (no local failure point may precede this call).
std::vector<Piece> gather_pieces(const PrivateComm& comm, const std::vector<Piece>& mine);

// Rank 0: each dataset's CRC-32 from the pieces of all ranks, which must tile every dataset
// (dataset_bytes[i] long) exactly; a runtime Error naming the dataset otherwise.
std::vector<uint32_t> combine_pieces(std::vector<Piece> pieces,
                                     const std::vector<int64_t>& dataset_bytes,
                                     const std::vector<DatasetEntry>& entries);

}  // namespace meshtrain::checkpoint_format
