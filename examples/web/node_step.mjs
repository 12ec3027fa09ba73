// The same training graph stepped by onnxruntime-node: node node_step.mjs [build_dir] [steps]
// Prints JSON: the loss of each step, the test accuracy, and the trained weights' path.
import { readFile, writeFile } from 'node:fs/promises';
import * as ort from 'onnxruntime-node';
import { load, step, evaluate, weightsJson } from './train.mjs';

const dir = process.argv[2] ?? new URL('./build/', import.meta.url).pathname;
const steps = Number(process.argv[3] ?? 50);
const read = async (name) => { const b = await readFile(`${dir}/${name}`); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); };
const m = await load(ort, read);
const losses = [];
for (let i = 0; i < steps; i++) losses.push(await step(m, i));
const result = await evaluate(m);
await writeFile(`${dir}/node_weights.json`, weightsJson(m));
console.log(JSON.stringify({ losses, ...result, weights: `${dir}/node_weights.json` }));
