// Times the exported MHA models with onnxruntime-node on one thread.
//
//   node bench/ort/run_ort.js MODELS_DIR [runs] [warmup]
// Needs onnxruntime-node resolvable (NODE_PATH=<scratch>/node_modules). Reads MODELS_DIR/models.json
// (bench/ort/export_mha.py), checks each model's output against torch's reference output, then
// prints one JSON object per model: wall and process-CPU milliseconds of `runs` runs (samples and
// medians).
'use strict';
const fs = require('fs');
const path = require('path');
const ort = require('onnxruntime-node');

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

function readFloats(file) {
  const buf = fs.readFileSync(file);
  return new Float32Array(buf.buffer, buf.byteOffset, buf.byteLength / 4);
}

async function main() {
  const dir = process.argv[2];
  const runs = Number(process.argv[3] || 20);
  const warmup = Number(process.argv[4] || 3);
  const models = JSON.parse(fs.readFileSync(path.join(dir, 'models.json'), 'utf8'));
  for (const m of models) {
    const session = await ort.InferenceSession.create(path.join(dir, m.onnx), {
      intraOpNumThreads: 1,
      interOpNumThreads: 1,
      executionMode: 'sequential',
      graphOptimizationLevel: 'all',
    });
    const x = new ort.Tensor('float32', readFloats(path.join(dir, m.input)),
                             [m.batch, m.tokens, m.d_model]);
    const want = readFloats(path.join(dir, m.output));
    let out = await session.run({ x });
    const got = out.y.data;
    let maxErr = 0;
    for (let i = 0; i < want.length; ++i) maxErr = Math.max(maxErr, Math.abs(got[i] - want[i]));
    if (!(maxErr < 1e-3)) throw new Error(`${m.name}: ORT output differs from torch by ${maxErr}`);
    for (let i = 1; i < warmup; ++i) out = await session.run({ x });
    const wall = [], cpu = [];
    for (let i = 0; i < runs; ++i) {
      const c0 = process.cpuUsage();
      const t0 = process.hrtime.bigint();
      out = await session.run({ x });
      const t1 = process.hrtime.bigint();
      const c1 = process.cpuUsage(c0);
      wall.push(Number(t1 - t0) / 1e6);
      cpu.push((c1.user + c1.system) / 1e3);
    }
    console.log(JSON.stringify({
      name: m.name, batch: m.batch, tokens: m.tokens, d_model: m.d_model, heads: m.heads,
      runs, warmup, wall_ms: median(wall), cpu_ms: median(cpu), wall_samples: wall,
      cpu_samples: cpu, max_abs_err: maxErr,
      ort_version: require('onnxruntime-node/package.json').version,
    }));
    if (typeof session.release === 'function') await session.release();
  }
}

main().catch((e) => {
  console.error(`run_ort: ${e.stack || e}`);
  process.exit(1);
});
