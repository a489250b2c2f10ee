// ONNX Runtime's side of bench/predictor_vs_onnxruntime.sh: one session.run on a fixed block of
// rows, timed, on the CPU execution provider with one intra-op and one inter-op thread
// (sequential execution), graph optimizations at their default (all), as a user gets them.
//
//   node predictor_vs_onnxruntime.js ORT_MODULE_DIR MODEL.onnx ROWS.f32 ROWS COLUMNS CALLS [OUT.f32]
//
// ROWS.f32 holds ROWS x COLUMNS float32 values (row-major) fed to "input". One warm-up run, then
// CALLS timed runs. One JSON line: the best and median milliseconds per run and the process CPU
// milliseconds per run. OUT.f32 receives the last run's "output" (float32, row-major).
'use strict';
const fs = require('fs');

async function main() {
  const [moduleDir, model, inputFile, rowsText, columnsText, callsText, outFile] =
      process.argv.slice(2);
  if (!callsText) {
    throw new Error('usage: predictor_vs_onnxruntime.js ORT_MODULE_DIR MODEL ROWS.f32 ROWS ' +
                    'COLUMNS CALLS [OUT.f32]');
  }
  const ort = require(moduleDir);
  const rows = Number(rowsText), columns = Number(columnsText), calls = Number(callsText);
  const bytes = fs.readFileSync(inputFile);
  if (bytes.length < rows * columns * 4) {
    throw new Error(`${inputFile} has ${bytes.length} bytes, fewer than ${rows} x ${columns} x 4`);
  }
  const data = new Float32Array(bytes.buffer.slice(bytes.byteOffset,
                                                   bytes.byteOffset + rows * columns * 4));
  const session = await ort.InferenceSession.create(model, {
    executionProviders: ['cpu'],
    intraOpNumThreads: 1,
    interOpNumThreads: 1,
    executionMode: 'sequential',
  });
  const feeds = {input: new ort.Tensor('float32', data, [rows, columns])};
  let result = await session.run(feeds);  // warm-up
  const ms = [];
  const cpuStart = process.cpuUsage();
  for (let c = 0; c < calls; ++c) {
    const start = process.hrtime.bigint();
    result = await session.run(feeds);
    ms.push(Number(process.hrtime.bigint() - start) / 1e6);
  }
  const cpu = process.cpuUsage(cpuStart);
  ms.sort((a, b) => a - b);
  if (outFile) {
    const t = result.output;
    fs.writeFileSync(outFile, Buffer.from(t.data.buffer, t.data.byteOffset, t.data.byteLength));
  }
  console.log(JSON.stringify({
    bench: 'predictor_call', runtime: 'onnxruntime', version: ort.env.versions.node, rows,
    calls, best_ms: ms[0], median_ms: ms[Math.floor(ms.length / 2)],
    cpu_ms_per_call: (cpu.user + cpu.system) / 1e3 / calls,
  }));
}

main().catch((e) => {
  console.error('predictor_vs_onnxruntime.js: ' + (e && e.message ? e.message : e));
  process.exit(1);
});
