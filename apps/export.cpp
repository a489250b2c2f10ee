// `meshtrain export` (apps/export.hpp).

#include "apps/export.hpp"

#include <cstdlib>
#include <initializer_list>
#include <iomanip>
#include <ostream>

#include "base/error.hpp"
#include "framework/export/onnx_export.hpp"
#include "framework/export/pytorch_export.hpp"

namespace meshtrain {

namespace {

// What an MPI launcher told this process (Open MPI, MPICH/Hydra and PMIx name it in the
// environment): a number at least `minimum`, or `fallback`. Export does not initialize MPI,
// so under `mpirun -np N` N processes would each write the same output.
long launcher_value(std::initializer_list<const char*> names, long minimum, long fallback) {
  for (const char* name : names) {
    if (const char* value = std::getenv(name)) {
      const long number = std::strtol(value, nullptr, 10);
      if (number >= minimum) return number;
    }
  }
  return fallback;
}
long launched_world_size() {
  return launcher_value({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}, 2, 1);
}
long launched_rank() {
  return launcher_value({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}, 0, 0);
}

}  // namespace

int export_command(const ExportArgs& args, std::ostream& out) {
  if (const long world = launched_world_size(); world > 1) {
    // Rank 0 says why, once, and exits non-zero. The other ranks exit 0: had they exited
    // non-zero first, the launcher could kill rank 0 before its sentence reached stderr
    // (Open MPI did, about one run in fifteen). The job's status is still non-zero.
    if (launched_rank() > 0) return 0;
    MESHTRAIN_BAD_INPUT("meshtrain export runs as one process, without mpirun (it was launched as ",
                        world, " ranks, each of which would write ", args.output, ")");
  }
  if (args.format != "onnx" && args.format != "pytorch") {
    MESHTRAIN_BAD_INPUT("unknown export format '", args.format,
                        "' (--format): the formats are onnx and pytorch");
  }
  Dtype dtype = Dtype::fp32;
  if (args.dtype == "fp16") {
    dtype = Dtype::fp16;
  } else if (args.dtype == "bf16") {
    dtype = Dtype::bf16;
  } else if (args.dtype != "fp32") {
    MESHTRAIN_BAD_INPUT("unknown weight dtype '", args.dtype,
                        "' (--dtype): the dtypes are fp32, fp16 and bf16");
  }
  if (args.format == "pytorch") {
    // The checkpoint's master weights are float32; a PyTorch user converts a module in one
    // call, so the export keeps them as they are.
    if (dtype != Dtype::fp32) {
      MESHTRAIN_BAD_INPUT("--dtype ", args.dtype, " applies to --format onnx; --format pytorch ",
                          "stores the checkpoint's float32 weights (m.half() or "
                          "m.to(torch.bfloat16) converts the loaded module)");
    }
    const PytorchExportResult r = export_pytorch(args.checkpoint, args.output, args.overwrite);
    out << "exported " << r.checkpoint << " (step " << r.step << ") to " << r.code << " and "
        << r.weights << ": " << r.tensors << " tensors, fp32 weights, " << std::fixed
        << std::setprecision(2) << static_cast<double>(r.weight_bytes) / (1024.0 * 1024.0)
        << " MiB; in Python: import model; m = model.load()\n";
    out.flush();
    return out ? 0 : 1;
  }
  const OnnxExportResult r = export_onnx(args.checkpoint, args.output, dtype, args.overwrite);
  std::string inputs, outputs;
  for (const auto& i : r.inputs) inputs += (inputs.empty() ? "'" : "', '") + i;
  for (const auto& o : r.outputs) outputs += (outputs.empty() ? "" : ", ") + o;
  out << "exported " << r.checkpoint << " (step " << r.step << ") to " << args.output
      << ": ONNX opset " << kOnnxOpset << ", " << args.dtype << " weights, " << std::fixed
      << std::setprecision(2) << static_cast<double>(r.bytes) / (1024.0 * 1024.0) << " MiB; "
      << (r.inputs.size() == 1 ? "input " : "inputs ") << inputs << "', outputs " << outputs
      << "\n";
  out.flush();
  return out ? 0 : 1;
}

}  // namespace meshtrain
