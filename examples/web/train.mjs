// One training loop for the page and for node: `ort` is onnxruntime-web or onnxruntime-node.
// Batch i is rows [i*B, (i+1)*B) of the (pre-shuffled) train split, wrapping around.
export async function load(ort, read, options = {}) {
  const manifest = JSON.parse(new TextDecoder().decode(await read('manifest.json')));
  const stateBuf = new Float32Array(await read('state.bin'));
  const data = await read('digits.bin');
  const px = manifest.image_shape.reduce((a, b) => a * b, 1);
  const n = manifest.train + manifest.test;
  const images = new Float32Array(data, 0, n * px);
  const labels = new Int32Array(data, n * px * 4, n);
  const state = {};
  for (const e of manifest.state) {
    const size = e.shape.reduce((a, b) => a * b, 1);
    state[e.name] = new ort.Tensor('float32', stateBuf.slice(e.offset, e.offset + size), e.shape);
  }
  const train = await ort.InferenceSession.create(new Uint8Array(await read('train.onnx')), options);
  const evalSession = await ort.InferenceSession.create(new Uint8Array(await read('train.eval.onnx')), options);
  return { ort, manifest, images, labels, px, state, train, evalSession };
}

function batch(m, start, count) {
  const x = m.images.slice(start * m.px, (start + count) * m.px);
  const y = BigInt64Array.from(m.labels.subarray(start, start + count), (v) => BigInt(v));
  return { x: new m.ort.Tensor('float32', x, [count, ...m.manifest.image_shape]),
           y: new m.ort.Tensor('int64', y, [count]) };
}

// One step: feeds the state and batch `index`, keeps every updated_<x> as the next <x>; returns the loss.
export async function step(m, index) {
  const B = m.manifest.batch;
  const start = (index * B) % (m.manifest.train - B + 1);
  const { x, y } = batch(m, start, B);
  const feeds = { ...m.state, [m.manifest.input]: x, target: y };
  const out = await m.train.run(feeds);
  for (const [name, value] of Object.entries(out)) {
    if (name.startsWith('updated_')) m.state[name.slice('updated_'.length)] = value;
  }
  return out.loss.data[0];
}

// The eval graph on the test split: loss and accuracy.
export async function evaluate(m) {
  const { x, y } = batch(m, m.manifest.train, m.manifest.test);
  const feeds = { [m.manifest.input]: x, target: y };
  for (const name of m.manifest.weights) feeds[name] = m.state[name];
  const out = await m.evalSession.run(feeds);
  const logits = out.output_logits.data, k = logits.length / m.manifest.test;
  let correct = 0;
  for (let i = 0; i < m.manifest.test; i++) {
    let best = 0;
    for (let j = 1; j < k; j++) if (logits[i * k + j] > logits[i * k + best]) best = j;
    if (best === Number(y.data[i])) correct++;
  }
  return { loss: out.loss.data[0], accuracy: correct / m.manifest.test };
}

// The trained weights and buffers as JSON ({name: {shape, data}}), what prepare.py --evaluate reads.
export function weightsJson(m) {
  const result = {};
  for (const name of m.manifest.weights) result[name] = { shape: m.state[name].dims, data: Array.from(m.state[name].data) };
  return JSON.stringify(result);
}
