#include "framework/io/checkpoint_checksums.hpp"

#include <zlib.h>
#if MESHTRAIN_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#include <algorithm>
#include <map>

#include "framework/comm/mpi_util.hpp"
#include "base/error.hpp"

namespace meshtrain::checkpoint_format {

uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
#if MESHTRAIN_HAVE_ISAL
  return crc32_gzip_refl(crc, p, bytes);
#else
  // zlib takes a uInt length: feed it in pieces below 4 GiB.
  while (bytes > 0) {
    const uInt n = static_cast<uInt>(std::min<size_t>(bytes, size_t{1} << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, n));
    p += n;
    bytes -= n;
  }
  return crc;
#endif
}

void append_piece(std::vector<Piece>& pieces, const Piece& piece) {
  if (!pieces.empty()) {
    Piece& last = pieces.back();
    if (last.dataset == piece.dataset && last.offset + last.length == piece.offset) {
      last.crc = static_cast<uint32_t>(crc32_combine(last.crc, piece.crc, piece.length));
      last.length += piece.length;
      return;
    }
  }
  pieces.push_back(piece);
}

std::vector<Piece> gather_pieces(const PrivateComm& comm, const std::vector<Piece>& mine) {
  static_assert(sizeof(Piece) == 32, "Piece is sent as bytes");
  // MPI reads and writes these until each gather completes (given up if it never does).
  std::vector<int> bytes{static_cast<int>(mine.size() * sizeof(Piece))};  // checked by the caller
  std::vector<int> counts(comm.rank() == 0 ? static_cast<size_t>(comm.size()) : 0);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Igather(bytes.data(), 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm.get(),
                        &request),
            "MPI_Igather (checkpoint checksums)");
  wait_collective_or_give_up(&request, 1, "MPI_Igather (checkpoint checksums)", bytes, counts);
  std::vector<int> displs(counts.size(), 0);
  int64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    displs[r] = static_cast<int>(total);
    total += counts[r];
  }
  // Rank 0 receives at most INT_MAX bytes: a million pieces per rank is far beyond any model.
  std::vector<Piece> all(static_cast<size_t>(total) / sizeof(Piece));
  std::vector<Piece> sent = mine;
  check_mpi(MPI_Igatherv(sent.data(), bytes[0], MPI_BYTE, all.data(), counts.data(),
                         displs.data(), MPI_BYTE, 0, comm.get(), &request),
            "MPI_Igatherv (checkpoint checksums)");
  wait_collective_or_give_up(&request, 1, "MPI_Igatherv (checkpoint checksums)", sent, all, counts,
                             displs);
  return all;
}

std::vector<uint32_t> combine_pieces(std::vector<Piece> pieces,
                                     const std::vector<int64_t>& dataset_bytes,
                                     const std::vector<DatasetEntry>& entries) {
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.dataset != b.dataset ? a.dataset < b.dataset : a.offset < b.offset;
  });
  std::vector<uint32_t> crcs(dataset_bytes.size(), 0);
  std::vector<int64_t> covered(dataset_bytes.size(), 0);
  // Most pieces have one of a few lengths: build zlib's combine operator once per length.
  std::map<int64_t, uLong> operators;
  for (const Piece& p : pieces) {
    MESHTRAIN_REQUIRE(p.dataset >= 0 && p.dataset < static_cast<int64_t>(crcs.size()),
                      "checkpoint: a checksum names dataset ", p.dataset, " of ", crcs.size());
    const size_t i = static_cast<size_t>(p.dataset);
    MESHTRAIN_REQUIRE(p.offset == covered[i], "checkpoint: the blocks of ", entries[i].label,
                      " do not tile it (a block starts at byte ", p.offset, ", expected ",
                      covered[i], ")");
    if (covered[i] == 0) {
      crcs[i] = p.crc;
    } else {
#if ZLIB_VERNUM >= 0x12c0
      auto op = operators.find(p.length);
      if (op == operators.end())
        op = operators.emplace(p.length, crc32_combine_gen(p.length)).first;
      crcs[i] = static_cast<uint32_t>(crc32_combine_op(crcs[i], p.crc, op->second));
#else
      crcs[i] = static_cast<uint32_t>(crc32_combine(crcs[i], p.crc, p.length));
#endif
    }
    covered[i] += p.length;
  }
  for (size_t i = 0; i < crcs.size(); ++i) {
    MESHTRAIN_REQUIRE(covered[i] == dataset_bytes[i], "checkpoint: the blocks of ",
                      entries[i].label, " cover ", covered[i], " of its ", dataset_bytes[i],
                      " bytes");
  }
  return crcs;
}

}  // namespace meshtrain::checkpoint_format
