"""Why a GRPO stage learned or did not, measured after it trained: where its weights moved
(the relative change of each decoder layer), how far its policy went from the model it
started from (KL on its own samples), and how much of its batches carried a gradient (the
groups TRL logged with zero reward variance). `explain` turns them into the one clause the
stage's end-of-stage line carries when its result is flat.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
ZERO_STD_FLAT = 0.5   # above this share of groups without reward variance, a flat stage is explained by it
KL_FLAT = 1e-3        # nats per token: below it the policy barely moved


def layer_of(name: str) -> str:
    """The group a weight belongs to: its decoder layer's index, else `embed`, `head` or `other`."""
    found = LAYER.search(name)
    if found:
        return found.group(1)
    return "embed" if "embed" in name else "head" if "lm_head" in name else "other"


def _tensors(folder: str | Path) -> dict[str, Path]:
    """Weight name -> the safetensors file in `folder` holding it (sharded or not)."""
    from safetensors import safe_open

    found = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            found.update({key: path for key in f.keys()})
    return found


def weight_change_by_layer(before: str | Path, after: str | Path) -> list[dict]:
    """Per layer group (decoder layers in order, then embed, head, other): the relative
    change ||W_after - W_before|| / ||W_before|| over its tensors (Frobenius norms in fp32,
    unitless), read one tensor at a time from both folders' safetensors; weights only one
    folder holds (a tied head saved once) are left out."""
    import torch
    from safetensors import safe_open

    old, new = _tensors(before), _tensors(after)
    moved: dict[str, list[float]] = {}
    for name in sorted(old.keys() & new.keys()):
        with safe_open(str(old[name]), "pt") as a, safe_open(str(new[name]), "pt") as b:
            w0, w1 = a.get_tensor(name).float(), b.get_tensor(name).float()
        if w0.shape != w1.shape:
            continue
        sums = moved.setdefault(layer_of(name), [0.0, 0.0])
        sums[0] += float(torch.sum((w1 - w0) ** 2))
        sums[1] += float(torch.sum(w0 ** 2))
    order = sorted((g for g in moved if g.isdigit()), key=int) + [g for g in ("embed", "head", "other") if g in moved]
    return [{"layer": g, "relative_change": math.sqrt(moved[g][0] / moved[g][1]) if moved[g][1] else 0.0}
            for g in order]


def change_figures(layers: list[dict]) -> dict[str, float]:
    """The stage's metrics of where it moved: the largest layer change, the decoder layer
    it is in, and the share of all the change (squared, over decoder layers) in the three
    layers that moved most (1.0: everything in three layers)."""
    decoder = [(int(l["layer"]), l["relative_change"]) for l in layers if l["layer"].isdigit()]
    if not decoder:
        return {}
    top = max(decoder, key=lambda l: l[1])
    squares = sorted((c * c for _, c in decoder), reverse=True)
    total = sum(squares)
    return {"weight_change_max": top[1], "weight_change_max_layer": float(top[0]),
            "weight_change_top3_share": sum(squares[:3]) / total if total else 0.0}


def kl_to_start(start: str, trained: str, prompts: list[str], *, samples: int, max_new_tokens: int,
                seed: int) -> float:
    """KL(trained || start) in nats per completion token, on the trained model's own samples
    of `prompts` (`samples` each, at temperature 1: its own distribution): the mean over
    sampled tokens of log p_trained - log p_start (the k1 estimator TRL's `kl` logs when
    beta > 0). Tokens after the end of sequence are not counted."""
    import torch

    from posttrain.scoring.generation import load_policy, rendered_with_bos

    model, tokenizer = load_policy(trained)
    reference, _ = load_policy(start)
    torch.manual_seed(seed)
    batch = tokenizer(prompts, return_tensors="pt", padding=True,
                      add_special_tokens=not rendered_with_bos(tokenizer, prompts))
    with torch.inference_mode():
        ids = model.generate(**batch, do_sample=True, temperature=1.0, top_p=None, top_k=None,
                             num_return_sequences=samples, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        width = batch.input_ids.shape[1]
        completion = ids[:, width:]
        eos = (completion == tokenizer.eos_token_id).int()
        counted = (torch.cumsum(eos, dim=1) - eos) == 0   # up to and with the first end of sequence
        attention = torch.cat([batch.attention_mask.repeat_interleave(samples, 0), counted.long()], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: as generate placed them
        difference = torch.zeros(())
        for rows in torch.split(torch.arange(len(ids)), 16):  # the logits of a few sequences at a time
            logp = [torch.log_softmax(m(input_ids=ids[rows], attention_mask=attention[rows],
                                        position_ids=positions[rows]).logits[:, width - 1:-1].float(), -1)
                    .gather(-1, completion[rows].unsqueeze(-1)).squeeze(-1) for m in (model, reference)]
            difference += ((logp[0] - logp[1]) * counted[rows]).sum()
    tokens = int(counted.sum())
    return float(difference) / tokens if tokens else 0.0


def gradient_share(curve: list[dict]) -> float:
    """The share of the stage's groups that carried a gradient (reward variance within the
    group), over its logged steps: 1 - TRL's `frac_reward_zero_std`, averaged."""
    shares = [1.0 - point["frac_reward_zero_std"] for point in curve if "frac_reward_zero_std" in point]
    return sum(shares) / len(shares) if shares else 0.0


def explain(metrics: dict) -> str:
    """What explains a GRPO stage's result, for its end-of-stage line: most groups without
    reward variance, or a policy that barely moved; '' when neither holds."""
    zero = metrics.get("frac_reward_zero_std_mean")
    if zero is not None and zero > ZERO_STD_FLAT:
        return (f"{zero:.0%} of groups had no reward variance: the task is solved or unsolvable for this model "
                "(see the pass-rate filter's band)")
    kl = metrics.get("kl_to_start")
    if kl is not None and kl < KL_FLAT:
        return f"the policy barely moved (KL to the start {kl:.1e} nats/token): raise the learning rate or the steps"
    return ""


def plot_layers(layers: list[dict], stage: str, recorder) -> None:
    """The relative weight change by layer, a bar per layer group, as a figure in the stage's
    run (`recorder`; DVC plots the same from the stage's JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([l["layer"] for l in layers], [l["relative_change"] for l in layers], color="tab:blue")
    ax.set(xlabel="layer", ylabel="||ΔW|| / ||W||", title=f"grpo@{stage}: where the weights moved")
    ax.tick_params(axis="x", labelsize=7, rotation=90)
    ax.grid(axis="y", alpha=0.3)
    recorder.figure(fig, f"weight_change_{stage}.png")
    plt.close(fig)
