// `meshtrain export` (apps/export.hpp).

#include "apps/export.hpp"

#include <iomanip>
#include <ostream>

#include "base/error.hpp"
#include "framework/export/onnx_export.hpp"

namespace meshtrain {

int export_command(const ExportArgs& args, std::ostream& out) {
  if (args.format != "onnx") {
    MESHTRAIN_BAD_INPUT("unknown export format '", args.format,
                        "' (--format): the formats are onnx");
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
  const OnnxExportResult r = export_onnx(args.checkpoint, args.output, dtype, args.overwrite);
  std::string outputs;
  for (const auto& o : r.model.graph.outputs) outputs += (outputs.empty() ? "" : ", ") + o.name;
  out << "exported " << r.checkpoint << " (step " << r.step << ") to " << args.output
      << ": ONNX opset " << kOnnxOpset << ", " << args.dtype << " weights, " << std::fixed
      << std::setprecision(2) << static_cast<double>(r.bytes) / (1024.0 * 1024.0) << " MiB; input '"
      << onnx_input_name() << "', outputs " << outputs << "\n";
  out.flush();
  return out ? 0 : 1;
}

}  // namespace meshtrain
