#pragma once
// Writing an export's files so that a failed export leaves no file that looks whole: each file
// is written to "<file>.tmp" as its bytes come (nothing is encoded whole in memory first),
// synced, and renamed onto its name only once every file of the export is written. Shared by
// the ONNX export (one file) and the PyTorch export (model.py and model.safetensors).

#include <cstddef>
#include <functional>
#include <string>

namespace meshtrain {

// Where a file's bytes go as they are written: called with consecutive pieces.
using ExportByteSink = std::function<void(const char* data, size_t size)>;
// Hands a file's bytes, in order, to the sink it is given.
using ExportByteWriter = std::function<void(const ExportByteSink&)>;

// Refuses `output` when it is a directory, or an existing file and not `overwrite`
// (bad_input: "output 'X' exists; pass --overwrite to replace it").
void refuse_existing_output(const std::string& output, bool overwrite);

// "<output>.tmp", written by `write` and synced when constructed; renamed onto `output` by
// commit(); removed by the destructor when not committed (a later file of the same export
// failed, or an exception unwinds). Cannot open it: bad_input naming it (a missing folder);
// a failed write, sync or close: runtime error, the .tmp removed.
class TemporaryOutput {
 public:
  TemporaryOutput(std::string output, const ExportByteWriter& write);
  ~TemporaryOutput();
  TemporaryOutput(const TemporaryOutput&) = delete;
  TemporaryOutput& operator=(const TemporaryOutput&) = delete;

  void commit();
  size_t bytes() const { return bytes_; }

 private:
  std::string output_;
  std::string tmp_;
  size_t bytes_ = 0;
  bool committed_ = false;
};

// One file: refuse_existing_output, then a TemporaryOutput committed at once. Returns the
// bytes written.
size_t write_atomically(const std::string& output, const ExportByteWriter& write, bool overwrite);

}  // namespace meshtrain
