"""Federated averaging (FedAvg) over simulated clients, with files as the only channel.

    python examples/fedavg.py [out_dir]

An MLP on scikit-learn's handwritten digits is converted once; each of three clients holds its own share
of the training set (its own mix of classes) and a ``bridge.Trainer`` of the same training graph. Each
round, every client trains one local epoch from the global weights and writes its update as a delta file
(``Trainer.export_delta``: only the trained weights, minus where the round started). The server averages
the deltas weighted by each client's sample count (``average_deltas``) and writes the average; every
client loads it (``Trainer.load_delta``) and so starts the next round from the same global weights.
Prints the global model's test accuracy per round. Exits non-zero unless the clients agree after every
round with the sample-weighted mean of their local weights, and the final accuracy is >= 90%.
Needs scikit-learn (the test extra), only for the data.
"""
import io
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from sklearn.datasets import load_digits

import bridge
from bridge.training.delta import average_deltas, write_delta

CLIENTS, ROUNDS, BATCH, LR, SEED = 3, 6, 32, 0.05, 0


def digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Train and test splits: flattened images [N, 64] scaled to [0, 1], labels [N]."""
    data = load_digits()
    images = (data.data / 16.0).astype(np.float32)
    order = np.random.default_rng(SEED).permutation(len(images))
    images, labels = images[order], data.target.astype(np.int64)[order]
    return (images[:1400], labels[:1400]), (images[1400:], labels[1400:])


def client_shares(labels: np.ndarray) -> list[np.ndarray]:
    """Row indices of each client: client k gets most of the classes k, k+3, k+6 (and k+9) and a few others."""
    rng = np.random.default_rng(SEED)
    owner = np.where(rng.random(len(labels)) < 0.8, labels % CLIENTS, rng.integers(0, CLIENTS, len(labels)))
    return [np.flatnonzero(owner == k) for k in range(CLIENTS)]


def mlp_onnx() -> onnx.ModelProto:
    torch.manual_seed(SEED)
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(BATCH, 64),), buffer, dynamo=False, input_names=["x"],
                          output_names=["logits"], dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


def main(out_dir: Path) -> int:
    (train_x, train_y), (test_x, test_y) = digits()
    tm = bridge.to_training_onnx(mlp_onnx(), "ce", "sgd", optim_options={"lr": LR, "momentum": 0.9})
    shares = client_shares(train_y)
    clients = [bridge.Trainer(tm, seed=k) for k in range(CLIENTS)]
    agreed, accuracy = True, 0.0
    for round_index in range(ROUNDS):
        folder = out_dir / f"round{round_index}"
        folder.mkdir(parents=True, exist_ok=True)
        paths, local = [], []
        for k, (client, rows) in enumerate(zip(clients, shares, strict=True)):
            client.fit(({"x": train_x[rows]}, train_y[rows]), epochs=1, batch_size=BATCH)
            paths.append(client.export_delta(folder / f"client{k}.npz", samples=len(rows)))
            local.append({name: client.state()[name].astype(np.float64) for name in tm.weights})
        mean, total = average_deltas(paths)
        write_delta(folder / "average.npz", mean, total)
        for client in clients:
            client.load_delta(folder / "average.npz")
        counts = np.array([len(rows) for rows in shares], np.float64)
        for name in tm.weights:  # FedAvg: the global weights are the sample-weighted mean of the local ones
            want = sum(c * w[name] for c, w in zip(counts, local, strict=True)) / counts.sum()
            held = [client.state()[name] for client in clients]
            agreed &= all(np.array_equal(held[0], h) for h in held)
            agreed &= bool(np.allclose(held[0], want, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(want).max()))
        accuracy = clients[0].evaluate(({"x": test_x}, test_y))["accuracy"]
        print(f"round {round_index}: global test accuracy {accuracy:.3f}")
    print(f"clients agree with the weighted mean of their local weights: {agreed}")
    return 0 if agreed and accuracy >= 0.9 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory() as folder:
        sys.exit(main(Path(folder)))
