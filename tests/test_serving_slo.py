"""The serving stage's SLO gate stops the pipeline with one clear line."""

import subprocess
import sys
from pathlib import Path

import yaml

from posttrain.training.tiny_model import save_tiny_model

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run_serving(tmp_path, slo: dict):
    models = tmp_path / "models"
    save_tiny_model(models / "dense", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, max_positions=32, seed=0)
    config = yaml.safe_load((REPO_CONFIGS / "pipeline.yaml").read_text())
    config["serving"].update(slo=slo, vllm_check={"enabled": False}, load_test={"enabled": False})
    config["tracking"]["uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    args = ["--config", tmp_path / "pipeline.yaml", "--data-dir", tmp_path, "--models-dir", models, "--gpus-path", REPO_CONFIGS / "gpus.yaml",
            "--report-path", tmp_path / "report.json", "--metrics-path", tmp_path / "metrics.json",
            "--plot-path", tmp_path / "plot.json"]
    return subprocess.run([sys.executable, "-m", "posttrain", "stage", "serving", *map(str, args)],
                          capture_output=True, text=True, cwd=tmp_path)


def test_slo_met(tmp_path):
    done = run_serving(tmp_path, {"gpu": "L4-24GB", "context_length": 8192, "min_sessions": 100})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plot.json").is_file() and (tmp_path / "metrics.json").is_file()


def test_slo_missed_fails_the_stage_with_one_line(tmp_path):
    # 2 layers x 1 KV head x dim 16 x 2 B = 128 B/token: an L4 holds about 4,900 sessions of 32k tokens
    done = run_serving(tmp_path, {"gpu": "L4-24GB", "context_length": 32768, "min_sessions": 10**7})
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and lines[-1].startswith("posttrain: gate failed: serving SLO not met")
    assert "L4-24GB" in lines[-1] and "10,000,000" in lines[-1]
    assert not (tmp_path / "metrics.json").exists()     # nothing half-written
