"""`tandem train` of a tiny Qwen2-VL (tiny:qwen2_vl) on rows with images (issue 40): the images go
from the data file through the agent loop into the native engine and, as pixel values in the
batch, into the actor's forward; the rollout-vs-actor log-prob gap after each sync is rounding,
so both sides saw the same images at the same positions with the same weights."""

import json

import pytest
from PIL import Image

pytestmark = pytest.mark.slow


def image_rows(directory):
    """8 rows of 1-2 small coloured pictures ("How many pictures?"), files beside the data."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(8):
        names = []
        for k in range(1 + index % 2):
            name = f"img{index}_{k}.png"
            Image.new("RGB", (28 + 14 * k, 28 + 10 * index), (30 * index, 200 - 20 * k, 90)).save(
                directory / name)
            names.append(name)
        rows.append({"prompt": [{"role": "user", "content": "<image>" * len(names)
                                 + "How many pictures?"}],
                     "images": names, "data_source": "e2e_parity",
                     "reward_model": {"ground_truth": str(len(names))}})
    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("mode", ["sync", "separate_async", "sync-lora", "sync-gae"])
def test_a_vision_language_policy_trains_on_rows_with_images(tiny_runs, tmp_path_factory, mode):
    """sync-lora: LoRA on the language model (its q/k/v/o and MLP projections; never the
    vision tower's), merged into the engine's weights.
    sync-gae: a critic over the VLM's backbone, its values from the same images, and the
    vision tower frozen (left out of the syncs)."""
    data = image_rows(tmp_path_factory.mktemp("vision-data"))
    extra = {"separate_async": ("trainer.async_rollout.max_staleness=0", "rollout.nnodes=1",
                                "rollout.n_gpus_per_node=1"),
             "sync-lora": ("actor.lora.rank=4",),
             "sync-gae": ("algorithm.adv_estimator=gae", "critic.enable=true",
                          "critic.optim.lr=0.01", "actor.freeze_vision_tower=true")}.get(mode, ())
    critic = mode.endswith("-gae")
    name = f"vision-{mode}"  # one run per variant (tiny_runs keeps a run per name)
    mode = mode.removesuffix("-lora").removesuffix("-gae")
    run = tiny_runs(name, "model.path=tiny:qwen2_vl", f"data.train_files=[{data}]",
                    "data.val_files=[]", "rollout.multi_turn.enable=false",
                    "rollout.multi_turn.tools=[]", f"trainer.trainer_mode={mode}", *extra)
    assert sorted(run.training) == [1, 2]
    for record in run.training.values():
        assert record["rollout_gap/abs_diff_max"] < 1e-4  # rounding only: same images, weights
        assert record["actor/step_skipped"] == 0.0
    assert [run.training[step]["weight_version"] for step in (1, 2)] == [1, 2]
    assert run.training[1]["actor/grad_norm"] > 0
    if critic:
        for record in run.training.values():
            assert record["critic/grad_norm"] > 0 and record["critic/step_skipped"] == 0.0
