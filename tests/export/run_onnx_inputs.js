// Runs an ONNX model of several inputs in ONNX Runtime (the npm package onnxruntime-node,
// CPU), for tests/export/dlrm_export_test.py (run_onnx.js feeds the one input "input"):
//
//   node run_onnx_inputs.js ORT_MODULE_DIR MODEL.onnx INPUTS.json OUT_DIR
//
// INPUTS.json lists [{name, type: "float32" | "int64", dims, file}], each file the input's raw
// little-endian values, row-major. Every output of the model is written to OUT_DIR/<name>.bin
// (its raw little-endian values; a "/" in a name becomes "_"), and OUT_DIR/outputs.json lists
// {name: {type, dims, file}} and the ONNX Runtime version.
'use strict';
const fs = require('fs');
const path = require('path');

function tensor(ort, input) {
  const bytes = fs.readFileSync(input.file);
  const count = input.dims.reduce((a, b) => a * b, 1);
  const width = input.type === 'int64' ? 8 : 4;
  if (bytes.length !== count * width) {
    throw new Error(`${input.file} has ${bytes.length} bytes, expected ${count} x ${width}`);
  }
  // A copy: the typed array needs an aligned buffer of its own.
  const buffer = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length);
  const data = input.type === 'int64' ? new BigInt64Array(buffer) : new Float32Array(buffer);
  return new ort.Tensor(input.type, data, input.dims);
}

async function main() {
  const [moduleDir, model, inputsFile, outDir] = process.argv.slice(2);
  if (!outDir) throw new Error('usage: run_onnx_inputs.js ORT_MODULE_DIR MODEL INPUTS.json OUT_DIR');
  const ort = require(moduleDir);
  const feeds = {};
  for (const input of JSON.parse(fs.readFileSync(inputsFile, 'utf8'))) {
    feeds[input.name] = tensor(ort, input);
  }
  // Graph optimizations stay at ONNX Runtime's default (all): what a user gets.
  const session = await ort.InferenceSession.create(model);
  const result = await session.run(feeds);
  const listing = {onnxruntime_version: ort.env.versions.node, inputs: session.inputNames,
                   outputs: {}};
  for (const name of session.outputNames) {
    const t = result[name];
    const file = name.replace(/\//g, '_') + '.bin';
    fs.writeFileSync(path.join(outDir, file),
                     Buffer.from(t.data.buffer, t.data.byteOffset, t.data.byteLength));
    listing.outputs[name] = {type: t.type, dims: t.dims.map(Number), file: file};
  }
  fs.writeFileSync(path.join(outDir, 'outputs.json'), JSON.stringify(listing));
}

main().catch((e) => {
  console.error('run_onnx_inputs.js: ' + (e && e.message ? e.message : e));
  process.exit(1);
});
