"""Checkpoint folders resume the same run and never someone else's."""

from posttrain.training import checkpoints


def test_fingerprint_follows_settings_and_inputs(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("a\n")
    first = checkpoints.fingerprint({"lr": 1}, [data])
    assert checkpoints.fingerprint({"lr": 1}, [data]) == first          # same run: resume
    assert checkpoints.fingerprint({"lr": 2}, [data]) != first          # new settings: start over
    data.write_text("b\n")
    assert checkpoints.fingerprint({"lr": 1}, [data]) != first          # new data: start over


def test_run_dir_drops_stale_runs(tmp_path):
    root = tmp_path / "ckpt"
    old = checkpoints.run_dir(root, {"lr": 1}, [])
    (tmp_path / "ckpt" / "x").mkdir(parents=True)
    new = checkpoints.run_dir(root, {"lr": 2}, [])
    assert new != old and sorted(p.name for p in root.iterdir()) == []


def test_resume_skips_a_checkpoint_cut_off_mid_save(tmp_path):
    from posttrain.training.trainer import last_complete_checkpoint

    for step, complete in [(10, True), (20, True), (30, False)]:   # killed while writing checkpoint-30
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)).endswith("checkpoint-20")
    assert not (tmp_path / "checkpoint-30").exists()
    assert last_complete_checkpoint(str(tmp_path / "missing")) is None
