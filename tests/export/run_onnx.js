// Runs an ONNX model in ONNX Runtime (the npm package onnxruntime-node, CPU) on float32 rows,
// for tests/export/export_test.py:
//
//   node run_onnx.js ORT_MODULE_DIR MODEL.onnx INPUT.f32 ROWS COLUMNS OUT_DIR
//
// INPUT.f32 holds ROWS x COLUMNS float32 values (row-major, little-endian) fed to "input".
// Every output of the model is written to OUT_DIR/<name>.bin (its raw little-endian values),
// and OUT_DIR/outputs.json lists {name: {type, dims}} and the ONNX Runtime version.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [moduleDir, model, inputFile, rowsText, columnsText, outDir] = process.argv.slice(2);
  if (!outDir) throw new Error('usage: run_onnx.js ORT_MODULE_DIR MODEL INPUT ROWS COLUMNS OUT_DIR');
  const ort = require(moduleDir);
  const rows = Number(rowsText), columns = Number(columnsText);
  const bytes = fs.readFileSync(inputFile);
  if (bytes.length !== rows * columns * 4) {
    throw new Error(`${inputFile} has ${bytes.length} bytes, expected ${rows} x ${columns} x 4`);
  }
  const data = new Float32Array(bytes.buffer, bytes.byteOffset, rows * columns);
  // Graph optimizations stay at ONNX Runtime's default (all): what a user gets.
  const session = await ort.InferenceSession.create(model);
  const result = await session.run({input: new ort.Tensor('float32', data, [rows, columns])});
  const listing = {onnxruntime_version: ort.env.versions.node, inputs: session.inputNames,
                   outputs: {}};
  for (const name of session.outputNames) {
    const t = result[name];
    const raw = Buffer.from(t.data.buffer, t.data.byteOffset, t.data.byteLength);
    fs.writeFileSync(path.join(outDir, name + '.bin'), raw);
    listing.outputs[name] = {type: t.type, dims: t.dims.map(Number)};
  }
  fs.writeFileSync(path.join(outDir, 'outputs.json'), JSON.stringify(listing));
}

main().catch((e) => {
  console.error('run_onnx.js: ' + (e && e.message ? e.message : e));
  process.exit(1);
});
