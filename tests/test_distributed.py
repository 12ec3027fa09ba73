"""Data-parallel training (bridge.training.distributed): 2 ranks on loopback (gloo) vs one process.

One spawn of 2 ranks runs every case (the rank processes cost ~3 s each to start); the tests
compare what each rank wrote with single-process runs here. The reference of N ranks with shards
s_r is one process accumulating the micro-batches s_r (``Trainer.accumulate``: the gradient graph per
shard, the sample-weighted mean, the update graph once), itself checked against one step on the
concatenated batch and against torch (tests/test_accumulation.py). BatchNorm: each rank normalizes
its shard with its own batch statistics, as accumulation does per micro-batch, and keeps its own
running statistics (or their mean with ``average_buffers=True``).
"""
from __future__ import annotations

import io
import os
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from lifecycle_models import CLASSES, SIZE, batch, features, small_cnn, small_mlp

import bridge
from bridge.training.distributed import BUCKET_BYTES, DataParallelTrainer, DistributedError, _free_port, run_local
from bridge.training.runtime import OrtGraph

SHARDS = [3, 5]  # per-rank batch sizes of one step (unequal on purpose: the reduction is weighted)
STEPS = 5
OPTIONS = {"sgd": {"lr": 0.1, "momentum": 0.9}, "adam": {"lr": 0.01}}
CLIP = 0.5  # clipping by global norm happens on the reduced gradients (update graph)
TIMEOUT = 120.0  # generous: the ranks share 2 busy cores; the failure tests use their own short one
ULPS = 8 * np.finfo(np.float32).eps  # DP vs accumulation: the same float32 graphs, float64 sums in another order


def _plain_cnn() -> tuple[torch.nn.Module, onnx.ModelProto]:
    """Conv -> ReLU -> Linear (no BatchNorm, no Dropout), dynamic batch."""
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(3 * (SIZE - 2) ** 2, CLASSES))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 1, SIZE, SIZE),), buffer, dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return module, onnx.load_from_string(buffer.getvalue())


MODELS = {"mlp": small_mlp, "cnn": _plain_cnn, "bn": small_cnn, "sum": small_mlp}  # "bn": BatchNorm and Dropout
LOSS_OPTIONS = {"sum": {"reduction": "sum"}}  # a summed loss: the ranks' sums are added, not averaged
CASES = [f"{model}-{optim}" for model in ("mlp", "cnn", "bn") for optim in OPTIONS] + ["sum-sgd"]


def _shards(case: str, noise: list[str], step: int) -> list[tuple[dict, np.ndarray]]:
    """The per-rank ``(inputs, target)`` of one step; the Dropout noise inputs ``noise`` are given
    explicitly, so one process can use the very masks of each rank."""
    shards = []
    for rank, size in enumerate(SHARDS):
        seed = 100 * step + rank
        if case.startswith(("mlp", "sum")):
            x, target = features(size, seed)
            inputs = {"x": x}
        else:
            inputs, target = batch(size, seed)
        for name in noise:
            inputs[name] = np.random.default_rng(seed).random((size, 4 * (SIZE - 2) ** 2)).astype(np.float32)
        shards.append((inputs, target))
    return shards


# -- what each rank runs ---------------------------------------------------------------------------

def _rank_main(directory: str, noise: dict[str, list[str]]) -> None:
    """What each rank runs: every case, the Trainer's loop, ``bridge train``, then rank 1 dies."""
    _rank_cases(Path(directory), noise)
    _rank_lifecycle(Path(directory))
    _rank_cli(Path(directory))
    _rank_dies(Path(directory))


def _rank_cases(directory: Path, noise: dict[str, list[str]]) -> None:
    """Every case on this rank: 5 steps of its shards; results written to ``<case>.rank<r>.npz``."""
    directory = Path(directory)
    for case in CASES + ["bn-adam-average", "mlp-adam-buckets"]:
        model = case.removesuffix("-average").removesuffix("-buckets")
        trainer = DataParallelTrainer(directory / f"{model}.onnx", timeout=TIMEOUT,
                                      average_buffers=case.endswith("average"),
                                      bucket_bytes=256 if case.endswith("buckets") else BUCKET_BYTES)
        losses = [trainer.step(*_shards(case, noise[model], step)[trainer.rank])["loss"] for step in range(STEPS)]
        np.savez(directory / f"{case}.rank{trainer.rank}.npz", losses=np.array(losses), **trainer.state())


def _rank_lifecycle(directory: Path) -> None:
    """fit + evaluate with sharding, a checkpoint mid-run and a resumed run, Dropout noise per rank."""
    path = directory / "mlp-sgd.onnx"
    trainer = DataParallelTrainer(path, timeout=TIMEOUT, seed=7)
    data = features(22, seed=5)  # global batches of 2 x 4: 8, 8, then 6 split 3 / 3
    trainer.fit(data, epochs=2, batch_size=4)
    metrics = trainer.evaluate(data, batch_size=4)
    history = {f"history_{k}": np.array(trainer.history[k]) for k in ("loss", "samples", "dropped")}
    fitted = {f"fitted_{k}": v for k, v in trainer.state().items()}
    checkpoint = trainer.save_checkpoint(directory / "fit.ckpt.npz")
    trainer.fit(data, epochs=1, batch_size=4)
    resumed = DataParallelTrainer(path, timeout=TIMEOUT, seed=7)
    resumed.load_checkpoint(checkpoint)
    resumed.fit(data, epochs=1, batch_size=4)
    with np.load(directory / "mlp-sgd.state.npz") as saved:  # each rank starts from another state
        shifted = {name: saved[name] + trainer.rank for name in saved.files}
    broadcast = DataParallelTrainer(path, timeout=TIMEOUT, state=shifted).state()
    bn = DataParallelTrainer(directory / "bn-sgd.onnx", timeout=TIMEOUT, seed=7)
    split = bn.session.split_step
    noise = bn.session._noise(split.random_inputs, split.checks, {}, np.zeros(2, np.int64))
    np.savez(directory / f"lifecycle.rank{trainer.rank}.npz", **{f"eval_{k}": v for k, v in metrics.items()},
             **history, **fitted, **{f"state_{k}": v for k, v in trainer.state().items()},
             **{f"resumed_{k}": v for k, v in resumed.state().items()}, **{f"noise_{k}": v for k, v in noise.items()},
             **{f"broadcast_{k}": v for k, v in broadcast.items()})


def _rank_cli(directory: Path) -> None:
    """``bridge train`` as torchrun runs it on each rank (inside the process group); stdout per rank."""
    from contextlib import redirect_stdout

    from bridge.cli import main

    np.savez(directory / "data.npz", **dict(zip(("x", "target"), features(20, seed=9), strict=True)))
    rank = torch.distributed.get_rank()
    with open(directory / f"cli.rank{rank}.txt", "w") as out, redirect_stdout(out):
        assert main(["train", str(directory / "mlp-adam.onnx"), "--data", str(directory / "data.npz"),
                     "--batch-size", "4", "--epochs", "2", "--timeout", "60",
                     "--checkpoint", str(directory / "cli.ckpt.npz")]) == 0


def _rank_dies(directory: Path) -> None:
    """Rank 1 stops answering, then is killed; rank 0 records how its steps fail and how long they took."""
    path = directory / "mlp-sgd.onnx"
    short = DataParallelTrainer(path, timeout=2.0)
    long = DataParallelTrainer(path, timeout=60.0)
    shard = features(4, seed=0)
    if short.rank == 1:
        time.sleep(5)  # alive but silent: rank 0's step on `short` times out
        os.kill(os.getpid(), signal.SIGKILL)  # dead: rank 0's step on `long` fails at once
    report = []
    for trainer in (short, long):
        start = time.perf_counter()
        try:
            trainer.step(*shard)
            report.append(["no error", time.perf_counter() - start])
        except DistributedError as exc:
            report.append([str(exc), time.perf_counter() - start])
    np.save(directory / "dies.npy", np.array(report, dtype=object), allow_pickle=True)


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, dict[str, bridge.TrainingModel]]:
    directory = tmp_path_factory.mktemp("distributed")
    converted = {}
    for case in CASES:
        name, optim = case.split("-")
        converted[case] = bridge.to_training_onnx(MODELS[name]()[1], loss="ce", loss_options=LOSS_OPTIONS.get(name),
                                                  optim=optim, optim_options=OPTIONS[optim], clip_grad_norm=CLIP)
        converted[case].save(directory / f"{case}.onnx")
        converted[case].save_state(directory / f"{case}.state.npz")
    return directory, converted


@pytest.fixture(scope="module")
def spawned(models) -> tuple[Path, list[int | None]]:
    """One spawn of 2 ranks running ``_rank_main``: the directory of what they wrote, their exit codes."""
    directory, converted = models
    noise = {case: list(tm.signature.random) for case, tm in converted.items()}
    context = run_local(_rank_main, 2, (str(directory), noise), timeout=TIMEOUT, join=False)
    for process in context.processes:
        process.join(600)
    return directory, [process.exitcode for process in context.processes]


@pytest.fixture(scope="module")
def ranks(spawned) -> Path:
    directory, exitcodes = spawned
    assert exitcodes == [0, -signal.SIGKILL], "a rank failed: see its traceback above"
    return directory


def _load(directory: Path, name: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(directory / f"{name}.rank{rank}.npz") as saved:
        return {key: saved[key] for key in saved.files}


def _reference(case: str, tm: bridge.TrainingModel, average: bool = False) -> tuple[list[float], dict, list[dict]]:
    """One process, 5 steps accumulating the ranks' shards: the losses, the final state, and each
    rank's running statistics (its own shards only, or their mean when ``average``). Checks that
    clipping is active (a global gradient norm above ``CLIP``), so it must act on reduced gradients."""
    session = tm.session()
    session.enable_accumulation(tm.gradient_model, tm.update_model)
    gradient = OrtGraph(tm.gradient_model)
    buffers = [{}, {}]
    losses = []
    for step in range(STEPS):
        shards = _shards(case, list(tm.signature.random), step)
        state = dict(session.state)
        for rank, (inputs, target) in enumerate(shards):
            results = gradient({**state, **buffers[rank], **inputs, "target": target})
            buffers[rank] = {k[len("updated_"):]: v for k, v in results.items() if k.startswith("updated_")}
        if average:
            buffers = [{k: np.mean([b[k] for b in buffers], axis=0) for k in buffers[0]}] * 2
        results = session.accumulate(shards)
        losses.append(results["loss"])
        if step == 0:
            grads = [v.astype(np.float64) for k, v in results.items() if k.startswith("grad_")]
            norm = np.sqrt(sum(np.sum(g * g) for g in grads))
            assert norm > CLIP, norm
    return losses, dict(session.state), buffers


# -- equivalence -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_on_the_concatenated_batch(models, ranks, case):
    _, converted = models
    tm = converted[case]
    rank0, rank1 = _load(ranks, case, 0), _load(ranks, case, 1)
    losses, state, statistics = _reference(case, tm)
    np.testing.assert_allclose(rank0["losses"], losses, rtol=ULPS)
    for name in tm.weights:  # the update graph ran on the same reduced gradients on both ranks
        np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=name)
        np.testing.assert_allclose(rank0[name], state[name], rtol=ULPS, atol=ULPS, err_msg=name)
    assert rank0["step"] == rank1["step"] == STEPS
    for rank, saved in enumerate((rank0, rank1)):  # BatchNorm: each rank's running statistics, its shards'
        for name, value in statistics[rank].items():
            np.testing.assert_allclose(saved[name], value, rtol=ULPS, atol=ULPS, err_msg=f"rank {rank} {name}")
    if not case.startswith("bn"):  # without BatchNorm: the step on the concatenated batch
        big = bridge.Trainer(tm)
        for step in range(STEPS):
            shards = _shards(case, [], step)
            big.step({"x": np.concatenate([s[0]["x"] for s in shards])}, np.concatenate([s[1] for s in shards]))
        for name in tm.weights:
            np.testing.assert_allclose(rank0[name], big.state()[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_batchnorm_statistics_averaged_over_the_ranks(models, ranks):
    _, converted = models
    rank0, rank1 = _load(ranks, "bn-adam-average", 0), _load(ranks, "bn-adam-average", 1)
    losses, state, statistics = _reference("bn-adam", converted["bn-adam"], average=True)
    np.testing.assert_allclose(rank0["losses"], losses, rtol=ULPS)
    assert statistics[0]
    for name, value in statistics[0].items():
        np.testing.assert_array_equal(rank0[name], rank1[name])
        np.testing.assert_allclose(rank0[name], value, rtol=ULPS, atol=ULPS, err_msg=name)
    per_rank = _load(ranks, "bn-adam", 0)
    assert not np.allclose(per_rank["bn.running_mean"], rank0["bn.running_mean"])  # the option changes them


def test_small_buckets_reduce_the_same_values(ranks):
    one, many = _load(ranks, "mlp-adam", 0), _load(ranks, "mlp-adam-buckets", 0)  # 1 bucket vs 256-byte ones
    assert set(one) == set(many)
    for name in one:
        np.testing.assert_array_equal(many[name], one[name], err_msg=name)


# -- the Trainer's loop, checkpoints, noise -----------------------------------------------------------

def test_fit_and_evaluate_shard_the_data_and_report_the_whole_batch(models, ranks):
    _, converted = models
    rank0, rank1 = _load(ranks, "lifecycle", 0), _load(ranks, "lifecycle", 1)
    single = bridge.Trainer(converted["mlp-sgd"], seed=7)  # same shuffling seed: the same global batches
    data = features(22, seed=5)
    single.fit(data, epochs=2, batch_size=8)
    assert list(rank0["history_samples"]) == list(rank1["history_samples"]) == [22, 22]
    assert list(rank0["history_dropped"]) == [0, 0]
    np.testing.assert_allclose(rank0["history_loss"], single.history["loss"], rtol=1e-5)
    np.testing.assert_array_equal(rank0["history_loss"], rank1["history_loss"])
    metrics = single.evaluate(data, batch_size=8)
    assert set(metrics) == {"loss", "accuracy", "samples"}
    for key, value in metrics.items():  # the eval graph on each rank's shards, the metrics summed
        np.testing.assert_allclose(rank0[f"eval_{key}"], value, rtol=1e-5)
        np.testing.assert_array_equal(rank0[f"eval_{key}"], rank1[f"eval_{key}"])
    for name in converted["mlp-sgd"].weights:
        np.testing.assert_allclose(rank0[f"fitted_{name}"], single.state()[name], rtol=1e-5, atol=1e-6)


def test_resumed_run_continues_bit_for_bit_and_on_one_process(models, ranks):
    _, converted = models
    rank0 = _load(ranks, "lifecycle", 0)
    for name in converted["mlp-sgd"].weights:
        np.testing.assert_array_equal(rank0[f"resumed_{name}"], rank0[f"state_{name}"], err_msg=name)
    assert not list(ranks.glob("*.npz.tmp"))  # written atomically, by rank 0 only
    single = bridge.Trainer(converted["mlp-sgd"], seed=7)  # another world size: 1
    single.load_checkpoint(ranks / "fit.ckpt.npz")
    assert single.epoch == 2
    single.fit(features(22, seed=5), epochs=1, batch_size=8)
    for name in converted["mlp-sgd"].weights:
        np.testing.assert_allclose(single.state()[name], rank0[f"state_{name}"], rtol=1e-5, atol=1e-6)


def test_rank_0s_state_is_broadcast_at_the_start(models, ranks):
    _, converted = models
    rank0, rank1 = _load(ranks, "lifecycle", 0), _load(ranks, "lifecycle", 1)
    for name, value in converted["mlp-sgd"].initial_state().items():  # rank 1 started from value + 1
        np.testing.assert_array_equal(rank0[f"broadcast_{name}"], value, err_msg=name)
        np.testing.assert_array_equal(rank1[f"broadcast_{name}"], value, err_msg=name)


def test_dropout_noise_is_seeded_per_rank(ranks):
    rank0, rank1 = _load(ranks, "lifecycle", 0), _load(ranks, "lifecycle", 1)
    (name,) = [key for key in rank0 if key.startswith("noise_")]
    assert rank0[name].shape == (2, 4 * (SIZE - 2) ** 2)
    for rank, saved in enumerate((rank0, rank1)):
        want = np.random.default_rng([7, rank]).random(saved[name].shape).astype(np.float32)
        np.testing.assert_array_equal(saved[name], want)
    assert not np.array_equal(rank0[name], rank1[name])


# -- failures --------------------------------------------------------------------------------------

def test_cli_train_in_a_process_group_is_data_parallel_and_only_rank_0_writes(models, ranks):
    _, converted = models
    printed = [(ranks / f"cli.rank{rank}.txt").read_text() for rank in (0, 1)]
    assert printed[0].startswith(f"wrote {ranks / 'cli.ckpt.npz'} (epoch 2") and printed[1] == ""
    single = bridge.Trainer(converted["mlp-adam"])  # bridge train's seed 0, the batch of both ranks
    single.fit(features(20, seed=9), epochs=2, batch_size=8)
    resumed = bridge.Trainer(ranks / "mlp-adam.onnx")
    resumed.load_checkpoint(ranks / "cli.ckpt.npz")
    assert len(resumed.history.steps) == 6  # 20 samples in global batches of 8, 8, 4
    for name in converted["mlp-adam"].weights:
        np.testing.assert_allclose(resumed.state()[name], single.state()[name], rtol=1e-5, atol=1e-6)


def test_a_dead_or_silent_rank_fails_the_others_within_the_timeout(ranks):
    (silent, silent_seconds), (dead, dead_seconds) = np.load(ranks / "dies.npy", allow_pickle=True)
    assert "rank 0 of 2: the gradient all-reduce failed" in silent and "within 2 s" in silent
    assert 1.5 < silent_seconds < 15
    assert "rank 0 of 2: the gradient all-reduce failed" in dead and dead_seconds < 30


def test_outside_a_process_group_is_a_clear_error(tmp_path):
    # a model of its own, not the module's ``models``: this test may run on the other pytest-xdist
    # worker, which would then convert all of them again
    bridge.to_training_onnx(small_mlp()[1], loss="ce", optim="sgd").save(tmp_path / "mlp-sgd.onnx")
    with pytest.raises(DistributedError, match="init_process_group"):
        DataParallelTrainer(tmp_path / "mlp-sgd.onnx")


# -- launchers and IREE (their own processes) ----------------------------------------------------------

def _assert_checkpoint_is_one_process_run(tm: bridge.TrainingModel, path: Path, checkpoint: Path) -> None:
    """The 2-rank run's checkpoint (batch 4 per rank) holds the weights of one process at batch 8."""
    single = bridge.Trainer(tm)
    single.fit(features(16, seed=11), epochs=1, batch_size=8)
    resumed = bridge.Trainer(path)
    resumed.load_checkpoint(checkpoint)
    for name in tm.weights:
        np.testing.assert_allclose(resumed.state()[name], single.state()[name], rtol=1e-5, atol=1e-6)


@pytest.mark.exhaustive  # run_local and bridge train inside a group are in the default tier (the spawn above)
def test_cli_train_nproc_spawns_local_ranks(models, tmp_path):
    from bridge.cli import main

    directory, converted = models
    np.savez(tmp_path / "data.npz", **dict(zip(("x", "target"), features(16, seed=11), strict=True)))
    assert main(["train", str(directory / "mlp-sgd.onnx"), "--data", str(tmp_path / "data.npz"), "--nproc", "2",
                 "--batch-size", "4", "--checkpoint", str(tmp_path / "run.npz")]) == 0
    _assert_checkpoint_is_one_process_run(converted["mlp-sgd"], directory / "mlp-sgd.onnx", tmp_path / "run.npz")


@pytest.mark.exhaustive
def test_cli_train_nproc_reports_the_rank_that_failed(models, tmp_path, capsys):
    from bridge.cli import main

    directory, _ = models
    np.savez(tmp_path / "bad.npz", x=features(16, seed=11)[0])
    assert main(["train", str(directory / "mlp-sgd.onnx"), "--data", str(tmp_path / "bad.npz"), "--nproc", "2",
                 "--checkpoint", str(tmp_path / "run.npz")]) == 2
    error = capsys.readouterr().err
    assert "of 2 failed: bridge.errors.InvalidOptionError:" in error and "has no 'target' array" in error


@pytest.mark.exhaustive
def test_torchrun_launches_bridge_train(models, tmp_path):
    import subprocess
    import sys

    directory, converted = models
    np.savez(tmp_path / "data.npz", **dict(zip(("x", "target"), features(16, seed=11), strict=True)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "bridge", "train", str(directory / "mlp-sgd.onnx"), "--data",
               str(tmp_path / "data.npz"), "--batch-size", "4", "--checkpoint", str(tmp_path / "run.npz")]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 only
    _assert_checkpoint_is_one_process_run(converted["mlp-sgd"], directory / "mlp-sgd.onnx", tmp_path / "run.npz")


def _rank_iree(directory: str) -> None:
    """3 steps of the mlp-sgd shards with the gradient and update graphs compiled by IREE (on rank 0)."""
    trainer = DataParallelTrainer(Path(directory) / "mlp-sgd.onnx", backend="iree", timeout=TIMEOUT)
    losses = [trainer.step(*_shards("mlp-sgd", [], step)[trainer.rank])["loss"] for step in range(3)]
    np.savez(Path(directory) / f"iree.rank{trainer.rank}.npz", losses=np.array(losses), **trainer.state())


@pytest.mark.exhaustive
@pytest.mark.iree
def test_two_ranks_on_iree_equal_one_process(models, tmp_path):
    directory, converted = models
    run_local(_rank_iree, 2, (str(directory),), timeout=TIMEOUT)
    rank0, rank1 = _load(directory, "iree", 0), _load(directory, "iree", 1)
    reference = bridge.Trainer(converted["mlp-sgd"])
    losses = [reference.accumulate(_shards("mlp-sgd", [], step))["loss"] for step in range(3)]
    np.testing.assert_allclose(rank0["losses"], losses, rtol=1e-5)
    for name in converted["mlp-sgd"].weights:  # IREE vs onnxruntime: float32 kernels of their own
        np.testing.assert_array_equal(rank0[name], rank1[name])
        np.testing.assert_allclose(rank0[name], reference.state()[name], rtol=1e-5, atol=1e-6, err_msg=name)
