"""lm-evaluation-harness beside posttrain's evaluator (`evaluate.harness`).

posttrain writes the held-out split as an lm-eval task of its own (`posttrain_heldout`): local
JSON rows (the prompt exactly as posttrain's sampler sees it, chat template applied, and the
answer), greedy `generate_until` with the evaluation's token budget, a filter that reads each
reply the way the environment's verifier does, and `exact_match` against the answer. lm-eval
(model type `hf`, the local model folder, no hub) then runs it, and the user's own task
folders (`evaluate.harness.tasks`), for each model the evaluate stage scores. The task folder
is left in `reports/harness/` with a `utils.py` that rebuilds the filter from `env.json`, so
`lm_eval --model hf --include_path reports/harness --tasks posttrain_heldout` reproduces the
figure outside posttrain (with posttrain installed: the filter is the environment's verifier).

The filter's reading: a reply the verifier accepts becomes the answer itself, any other reply
the environment's parse of it (or ""), so `exact_match` is the share the verifier accepts: the
same reading as posttrain's greedy accuracy, on the same tokens. The two greedy figures can
still differ by a prompt where float rounding in a differently shaped batch changes a greedy
token; more than `TOLERATED_PROMPTS` is a bug in one of them (`check_agreement`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

TASK = "posttrain_heldout"
FILTER = "posttrain"
TOLERATED_PROMPTS = 1  # issue 46: the two greedy accuracies within one prompt on a single-turn task

_UTILS = '''"""The posttrain_heldout task's filter: the environment in env.json reads each reply (posttrain)."""
import json
from pathlib import Path

from posttrain.scoring.harness import answer_filter

read_answers = answer_filter(json.loads((Path(__file__).parent / "env.json").read_text()))
'''


def answer_filter(data: dict):
    """lm-eval's custom filter for `data` (the config's `data` section as a dict): each reply
    the verifier accepts becomes its document's answer, any other the parse of it ("" when
    there is none), so `exact_match` against the answer counts what the verifier accepts."""
    from posttrain.config import DataSection
    from posttrain.envs import config_env

    env = config_env(DataSection.model_validate(data))

    def read(resps, docs):
        return [[doc["answer"] if env.verify(r, doc["answer"]) else str(env.parse(r) or "") for r in replies]
                for replies, doc in zip(resps, docs)]
    return read


def write_task(folder: Path, rows: list[dict], data: dict, max_new_tokens: int) -> Path:
    """The held-out split as the lm-eval task `posttrain_heldout` in `folder` (YAML, JSONL data,
    the filter's utils.py and env.json); the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data_file = (folder / "heldout.jsonl").resolve()
    data_file.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": str(r["answer"])}) + "\n"
                                 for r in rows))
    (folder / "env.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (folder / "utils.py").write_text(_UTILS)
    task = {
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test", "output_type": "generate_until",
        "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}", "target_delimiter": "",
        "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": max_new_tokens},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "written_by": "posttrain evaluate (posttrain/scoring/harness.py)"},
    }
    text = json.dumps(task, indent=2)  # JSON is YAML; the filter needs lm-eval's `!function` tag, added as text
    text = text[:-2] + (',\n  "filter_list": [{"name": "%s", "filter": [{"function": "custom", '
                        '"filter_fn": !function utils.read_answers}]}]\n}\n' % FILTER)
    (folder / f"{TASK}.yaml").write_text(text)
    return folder


def adds_bos(model_dir: str, prompt: str) -> bool:
    """Whether posttrain's sampler puts the tokenizer's special tokens before `prompt` (it does
    unless the chat template already wrote a BOS): lm-eval's `add_bos_token` to match."""
    from posttrain.chat import load_tokenizer
    from posttrain.scoring.generation import rendered_with_bos

    tokenizer = load_tokenizer(model_dir)
    if rendered_with_bos(tokenizer, [prompt]):
        return False
    return tokenizer(prompt).input_ids != tokenizer(prompt, add_special_tokens=False).input_ids


def run(model_dir: str, task_dirs: list[Path], tasks: list[str], *, batch_size: int, seed: int,
        add_bos: bool) -> tuple[dict[str, dict[str, float]], list[bool], float]:
    """lm-eval on one model folder: per task its numeric figures (`metric` for posttrain's own
    filter, `metric.filter` for others'), posttrain_heldout's per-prompt verdicts in document
    order, and the seconds it took."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    manager = TaskManager(include_path=[str(p) for p in task_dirs], include_defaults=False, verbosity="ERROR")
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": model_dir, "dtype": "float32", "device": "cpu",
                                "add_bos_token": add_bos, "trust_remote_code": False},
        tasks=tasks, task_manager=manager, batch_size=batch_size, log_samples=True, random_seed=seed,
        numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR",
        bootstrap_iters=0)
    figures = {}
    for task, values in out["results"].items():
        figures[task] = {}
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and filt:
                figures[task][metric if filt == FILTER else f"{metric}.{filt}"] = float(value)
    samples = sorted(out["samples"].get(TASK, []), key=lambda s: s["doc_id"])
    verdicts = [bool(s["exact_match"]) for s in samples]
    return figures, verdicts, time.monotonic() - started


def check_agreement(model: str, posttrain_greedy: list[bool], harness_greedy: list[bool]) -> str | None:
    """Why lm-eval's greedy accuracy and posttrain's disagree beyond TOLERATED_PROMPTS on the same
    prompts (None when they agree)."""
    if len(posttrain_greedy) != len(harness_greedy):
        return f"{model}: lm-eval scored {len(harness_greedy)} prompts, posttrain {len(posttrain_greedy)}"
    differ = sum(a != b for a, b in zip(posttrain_greedy, harness_greedy))
    gap = abs(sum(posttrain_greedy) - sum(harness_greedy))
    if gap > TOLERATED_PROMPTS:
        n = len(posttrain_greedy)
        return (f"{model}: lm-eval's greedy accuracy {sum(harness_greedy) / n:.3f} and posttrain's "
                f"{sum(posttrain_greedy) / n:.3f} differ by {gap} prompts (of {n}; {differ} prompts scored "
                f"differently), more than {TOLERATED_PROMPTS}")
    return None
