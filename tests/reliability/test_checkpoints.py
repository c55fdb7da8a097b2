"""Corrupt, incomplete and torn checkpoints fail loudly, naming the file; NaN never becomes the
latest checkpoint; a non-finite loss skips its step or stops the run, by config (issue 11)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import algorithms
from tandem.batch.jagged import padded_field, trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.config.load import ConfigError, load_config
from tandem.config.schema import KLControlConfig, OptimConfig, TandemConfig
from tandem.fleet.fleet import Fleet
from tandem.fleet.startup import StartupClock
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.trainer.rl_trainer import RLTrainer
from tandem.training import checkpoint
from tandem.training.checkpoint import CheckpointError
from tandem.training.engine import NonFiniteLossError, TrainingEngine


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


def new_engine(path, on_nonfinite_loss="skip") -> TrainingEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=1e-2), total_steps=10,
                          on_nonfinite_loss=on_nonfinite_loss)


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return trajectories_to_batch([
        Trajectory(prompts=torch.randint(10, 500, (4,), generator=generator),
                   responses=torch.randint(10, 500, (6,), generator=generator),
                   response_mask=torch.ones(6, dtype=torch.long), rollout_log_probs=torch.zeros(6),
                   min_global_steps=0, max_global_steps=0) for _ in range(2)])


def loss_fn(offset: float = 0.0):
    """Mean response log-prob plus a constant: offset=inf makes the loss inf but every gradient
    finite, so only a check of the loss itself (not of the grad norm) catches it."""
    def compute(micro_batch, outputs):
        mask = padded_field(micro_batch["loss_mask"])
        loss = -(outputs.padded("log_probs") * mask).sum() / outputs.mini_batch.global_tokens
        return loss + offset, {}
    return compute


def weights_of(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def assert_unchanged(engine: TrainingEngine, before: dict[str, torch.Tensor]) -> None:
    for name, parameter in engine.model.named_parameters():
        assert torch.equal(parameter, before[name]), name


@pytest.fixture(scope="module")
def saved(tiny_path, tmp_path_factory):
    """A checkpoint after one real step; each test corrupts a copy of it."""
    engine = new_engine(tiny_path)
    engine.train_mini_batch(batch(), loss_fn())
    directory = tmp_path_factory.mktemp("ckpt") / "step_1"
    engine.save_checkpoint(directory, extra={"cursor": 1})
    return directory


@pytest.fixture
def copy(saved, tmp_path):
    import shutil

    return shutil.copytree(saved, tmp_path / "step_1")


def load_fails(tiny_path, directory, match: str) -> None:
    engine = new_engine(tiny_path)
    before = weights_of(engine)
    with pytest.raises(CheckpointError, match=match):
        engine.load_checkpoint(directory)
    assert_unchanged(engine, before)  # nothing half-loaded
    assert engine.global_step == 0


# -- corrupt and incomplete checkpoints ----------------------------------------------------------

def test_a_saved_checkpoint_lists_every_file_with_its_checksum(saved, tiny_path) -> None:
    files = json.loads((saved / "manifest.json").read_text())["files"]
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "rng_rank0.pt",
            "config.json"} <= set(files)
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in files.values())
    assert new_engine(tiny_path).load_checkpoint(saved) == {"cursor": 1}


def test_overwritten_tensor_data_fails_naming_the_file(copy, tiny_path) -> None:
    path = copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:header + 4096] = b"\xff\xff\xc0\x7f" * 1024  # float32 NaNs; same size, valid header
    path.write_bytes(bytes(data))
    load_fails(tiny_path, copy, r"step_1/model\.safetensors is corrupt")


def test_truncated_optimizer_state_fails_naming_the_file(copy, tiny_path) -> None:
    path = copy / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:1000])
    load_fails(tiny_path, copy, r"optimizer\.pt is corrupt")


def test_a_missing_rng_file_is_an_error_not_an_inexact_resume(copy, tiny_path) -> None:
    (copy / "rng_rank0.pt").unlink()
    load_fails(tiny_path, copy, r"rng_rank0\.pt is missing")


def test_an_unreadable_manifest_is_named(copy, tiny_path) -> None:
    (copy / "manifest.json").write_text("{not json")
    load_fails(tiny_path, copy, r"manifest\.json cannot be read: JSONDecodeError")


def test_a_save_killed_before_its_end_is_refused(tiny_path, tmp_path, monkeypatch) -> None:
    engine = new_engine(tiny_path)
    real_save = torch.save

    def dies_at_the_rng_file(obj, path, *args, **kwargs):
        if str(path).endswith("rng_rank0.pt"):
            raise KeyboardInterrupt  # the process stops here: no RNG file, no manifest
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_at_the_rng_file)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path / "step_2")
    monkeypatch.undo()
    load_fails(tiny_path, tmp_path / "step_2", r"step_2/manifest\.json is missing: the save of .* "
                                                 "did not finish")


def test_resaving_into_a_directory_invalidates_its_old_manifest(saved, tiny_path, tmp_path,
                                                                monkeypatch) -> None:
    import shutil

    directory = shutil.copytree(saved, tmp_path / "step_1")
    engine = new_engine(tiny_path)

    def killed(directory):
        raise KeyboardInterrupt  # the process stops after the new files, before their manifest

    monkeypatch.setattr(checkpoint, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(directory)
    monkeypatch.undo()
    load_fails(tiny_path, directory, r"manifest\.json is missing")


def test_non_finite_weights_are_refused_on_load_too(copy, tiny_path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name][0] = float("inf")
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    checkpoint.write_manifest(copy)  # checksums agree: the data itself is the problem
    load_fails(tiny_path, copy, rf"model\.safetensors: non-finite values in \['{name}'\]")


# -- NaN never becomes `latest` ----------------------------------------------------------------

def test_nan_weights_are_not_saved(tiny_path, tmp_path) -> None:
    engine = new_engine(tiny_path)
    with torch.no_grad():
        engine.model.get_parameter("model.norm.weight")[3] = float("nan")
    with pytest.raises(CheckpointError, match=r"not saved, the weights hold non-finite values "
                                              r"\(\['model\.norm\.weight'\]\)"):
        engine.save_checkpoint(tmp_path / "step_3")
    assert not (tmp_path / "step_3").exists()


class InProcessWorker:
    """Stands in for a hybrid worker actor: save/load_checkpoint on a local engine."""

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine = engine

    def save_checkpoint(self, directory: str) -> None:
        self.engine.save_checkpoint(f"{directory}/actor")

    def load_checkpoint(self, directory: str) -> dict:
        return self.engine.load_checkpoint(f"{directory}/actor")


def driver(tmp_path, engine: TrainingEngine) -> RLTrainer:
    """The RLTrainer's checkpoint methods over an in-process worker (no Ray, no data)."""
    trainer = object.__new__(RLTrainer)
    trainer.output_dir, trainer.metrics, trainer.step = tmp_path / "run", None, 0
    trainer.prompt_batch = 0
    trainer.fleet = Fleet(TandemConfig(), tmp_path, StartupClock())
    trainer.fleet.workers = [InProcessWorker(engine)]
    trainer.kl_controller = algorithms.kl_controller_from_config(KLControlConfig())
    return trainer


async def test_a_nan_step_never_becomes_latest(tiny_path, tmp_path) -> None:
    engine = new_engine(tiny_path)
    trainer = driver(tmp_path, engine)
    trainer.step = 1
    await trainer.save_checkpoint()
    with torch.no_grad():
        engine.model.get_parameter("model.norm.weight")[0] = float("nan")
    trainer.step = 2
    with pytest.raises(CheckpointError, match="non-finite"):
        await trainer.save_checkpoint()
    assert checkpoint.read_latest(tmp_path / "run" / "checkpoints") == 1
    resumed = driver(tmp_path, new_engine(tiny_path))
    assert await resumed.load_latest_checkpoint() and resumed.step == 1


# -- `latest` is written atomically ---------------------------------------------------------------

KILLER = textwrap.dedent("""
    import os, signal, sys
    from tandem.training import checkpoint
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(os, sys.argv[2], die)
    checkpoint.write_latest(sys.argv[1], 2)
""")


@pytest.mark.parametrize("kill_at", ["fsync", "replace"])
async def test_a_kill_while_latest_is_written_leaves_resume_on_the_intact_step(
        tiny_path, tmp_path, kill_at) -> None:
    engine = new_engine(tiny_path)
    trainer = driver(tmp_path, engine)
    trainer.step = 1
    await trainer.save_checkpoint()
    checkpoints = tmp_path / "run" / "checkpoints"
    # A process killed (SIGKILL) inside write_latest(2): after writing the new text, before it
    # is durable ("fsync"), or right before the rename ("replace").
    child = subprocess.run([sys.executable, "-c", KILLER, str(checkpoints), kill_at],
                           env={**os.environ}, capture_output=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert (checkpoints / "latest").read_text() == "1"
    resumed = driver(tmp_path, new_engine(tiny_path))
    assert await resumed.load_latest_checkpoint() and resumed.step == 1
    for name, parameter in resumed.workers[0].engine.model.named_parameters():
        assert torch.equal(parameter, engine.model.get_parameter(name)), name
    checkpoint.write_latest(checkpoints, 1)  # the next write replaces the stale temp file
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_1"]


def test_a_garbled_latest_names_the_file_and_the_saved_steps(tmp_path) -> None:
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_3").mkdir()
    (tmp_path / "latest").write_text("")
    with pytest.raises(CheckpointError, match=r"latest holds '', not a step number; .*"
                                              r"steps saved: \[1, 3\]"):
        checkpoint.read_latest(tmp_path)
    assert checkpoint.read_latest(tmp_path / "nothing") is None


async def test_a_corrupt_trainer_state_is_named(tiny_path, tmp_path) -> None:
    trainer = driver(tmp_path, new_engine(tiny_path))
    trainer.step = 1
    directory = await trainer.save_checkpoint()
    (directory / "trainer_state.json").write_text('{"step": 7, "kl_controller": {}}')
    with pytest.raises(CheckpointError, match=r"step_1/trainer_state\.json is corrupt"):
        await driver(tmp_path, new_engine(tiny_path)).load_latest_checkpoint()


# -- non-finite loss ---------------------------------------------------------------------------

def test_a_non_finite_loss_stops_with_a_clear_error_when_configured(tiny_path) -> None:
    engine = new_engine(tiny_path, on_nonfinite_loss="stop")
    before = weights_of(engine)
    with pytest.raises(NonFiniteLossError, match=r"actor loss is nan at optimizer step 0; stopped "
                                                 r"by trainer.on_nonfinite_loss=stop"):
        engine.train_mini_batch(batch(), loss_fn(float("nan")))
    assert_unchanged(engine, before)
    assert engine.global_step == 0 and not engine.optimizer.state


def test_a_non_finite_loss_skips_its_step_even_with_finite_gradients(tiny_path) -> None:
    engine = new_engine(tiny_path)  # skip is the default
    before = weights_of(engine)
    metrics = engine.train_mini_batch(batch(), loss_fn(float("inf")))
    assert metrics["actor/nonfinite_loss"] == 1.0 and metrics["actor/step_skipped"] == 1.0
    assert metrics["actor/grad_norm"] > 0  # the gradients were finite: the norm check alone passes
    assert_unchanged(engine, before)
    assert not engine.optimizer.state  # AdamW's moments never saw the step
    metrics = engine.train_mini_batch(batch(), loss_fn())
    assert metrics["actor/nonfinite_loss"] == 0.0 and metrics["actor/step_skipped"] == 0.0
    assert any(not torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


def test_on_nonfinite_loss_is_validated_at_load_time() -> None:
    assert load_config().trainer.on_nonfinite_loss == "skip"
    assert load_config(overrides=["trainer.on_nonfinite_loss=stop"]).trainer.on_nonfinite_loss == "stop"
    with pytest.raises(ConfigError, match=r"trainer.on_nonfinite_loss: unknown value 'ignore'; "
                                          "valid values are skip, stop"):
        load_config(overrides=["trainer.on_nonfinite_loss=ignore"])


# -- two FSDP2 ranks ------------------------------------------------------------------------------

def fsdp_worker(rank: int, port: int, path: str, out_dir: str) -> None:
    from tandem.training.fsdp import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    engine = new_engine(path)
    engine.train_mini_batch(batch(rank), loss_fn())
    engine.save_checkpoint(f"{out_dir}/step_1")
    engine.load_checkpoint(f"{out_dir}/step_1")  # both ranks verify the files they read
    if rank == 1:  # a NaN in rank 1's shard only
        with torch.no_grad():
            engine.model.get_parameter("model.embed_tokens.weight").to_local()[0, 0] = float("nan")
    try:
        engine.save_checkpoint(f"{out_dir}/step_2")
        outcome = "saved"
    except CheckpointError as error:
        outcome = str(error)
    with open(f"{out_dir}/rank{rank}.txt", "w") as handle:
        handle.write(outcome)


def test_two_fsdp_ranks_checksum_both_rng_files_and_refuse_nan_together(tiny_path,
                                                                        tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(fsdp_worker, args=(port, str(tiny_path), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    files = json.loads((tmp_path / "step_1" / "manifest.json").read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt", "model.safetensors", "optimizer.pt"} <= set(files)
    # Both ranks refused (no rank hung in a barrier the other skipped); nothing was written.
    assert "non-finite values (on another rank)" in (tmp_path / "rank0.txt").read_text()
    assert "['model.embed_tokens.weight']" in (tmp_path / "rank1.txt").read_text()
    assert not (tmp_path / "step_2").exists()
    # Fewer ranks may resume it (each finds its own RNG file); more ranks may not (see above).
    assert new_engine(tiny_path).load_checkpoint(tmp_path / "step_1") == {}


def test_a_rank_without_an_rng_file_in_the_checkpoint_is_refused(saved, tiny_path,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "dp_rank_and_size", lambda: (1, 2))  # as rank 1 of 2
    engine = new_engine(tiny_path)
    with pytest.raises(CheckpointError, match=r"rng_rank1\.pt: not part of this checkpoint .* "
                                              "saved with another number of ranks"):
        engine.load_checkpoint(saved)


def test_a_checkpoint_of_another_model_names_the_file_and_the_shapes(saved, tiny_path) -> None:
    """Same weight names, other shapes (a wider MLP): the error says which file and how."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_path)
    config.intermediate_size *= 2
    engine = TrainingEngine(AutoModelForCausalLM.from_config(config), "actor", 4096,
                            optim=OptimConfig(lr=1e-2), total_steps=10)
    with pytest.raises(CheckpointError) as error:
        engine.load_checkpoint(saved)
    message = str(error.value)
    assert str(saved / "model.safetensors") in message and "holds weights of another model" in message
    assert f"model.layers.0.mlp.down_proj.weight (64, {config.intermediate_size // 2}) " \
           f"(model (64, {config.intermediate_size}))" in message


# -- issue 42: a full disk during a save --------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: less than the tiny model, its optimizer state and RNG files."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_during_a_save_says_no_space_left_naming_the_directory(tiny_path,
                                                                          small_disk) -> None:
    engine = new_engine(tiny_path)
    engine.train_mini_batch(batch(), loss_fn())
    directory = small_disk / "step_1"
    with pytest.raises(CheckpointError) as failure:
        engine.save_checkpoint(directory)
    message = str(failure.value)
    assert message.startswith(f"{directory}: no space left on device"), message
    assert "trainer.output_dir" in message
    assert not (directory / checkpoint.MANIFEST).exists()  # incomplete: never loaded


@pytest.mark.parametrize("error, free", [
    (OSError(28, "No space left on device"), 100 << 20),  # safetensors / open() say it
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7680 vs 7572"), 0),
])
def test_a_write_error_on_a_full_disk_is_named_however_the_library_words_it(
        tiny_path, tmp_path, monkeypatch, error, free) -> None:
    import shutil

    def full(*args, **kwargs):
        raise error

    usage = shutil.disk_usage(tmp_path)._replace(free=free)
    monkeypatch.setattr(checkpoint, "save_file", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage)
    engine = new_engine(tiny_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'step_1'}: no space left on device"):
        engine.save_checkpoint(tmp_path / "step_1")


def test_other_write_errors_pass_as_they_are(tiny_path, tmp_path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(PermissionError):
        new_engine(tiny_path).save_checkpoint(tmp_path / "step_1")


# -- issue 42: resuming with a changed actor.optim.lr ------------------------------------------

def test_resuming_with_a_changed_lr_trains_with_the_config_and_says_so(saved, tiny_path,
                                                                        caplog) -> None:
    """The checkpoint's optimizer state carries lr=1e-2; the resumed config says 1e-3 (and
    another weight decay): the config wins, at the restored step of its schedule, logged."""
    import logging

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=4)
    engine = TrainingEngine(model, "actor", 4096, optim=optim, total_steps=10)
    with caplog.at_level(logging.WARNING):
        engine.load_checkpoint(saved)
    assert engine.global_step == 1
    from tandem.training.optim import lr_multiplier

    [group] = engine.optimizer.param_groups
    assert group["lr"] == pytest.approx(1e-3 * lr_multiplier(1, optim, 10))  # warm-up step 2/4
    assert group["weight_decay"] == 0.1 and engine.scheduler.base_lrs == [1e-3]
    assert ("actor resumed from" in caplog.text and "with the config's optimizer settings, not "
            "the checkpoint's: actor.optim.lr 0.01 -> 0.001, actor.optim.weight_decay 0.0 -> 0.1"
            in caplog.text), caplog.text
    engine.train_mini_batch(batch(1), loss_fn())
    assert group["lr"] == pytest.approx(1e-3 * lr_multiplier(2, optim, 10))  # the schedule goes on


def test_resuming_with_the_same_settings_logs_nothing(saved, tiny_path, caplog) -> None:
    import logging

    engine = new_engine(tiny_path)
    with caplog.at_level(logging.WARNING):
        engine.load_checkpoint(saved)
    assert "optimizer settings" not in caplog.text
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
