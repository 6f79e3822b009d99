"""What a recipe leaves behind: model card, plots, metrics file, and the optional Hub upload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .tracking import read_jsonl

# what upload_folder leaves out: resumable training state is not part of the published model
HUB_IGNORE_PATTERNS = ["checkpoints/*", "checkpoints/**", "base_tiny_chronos_t5/*", "*.pkl"]


def write_plots(output_dir: str | Path, log_path: Optional[str | Path] = None, loss_key: str = "train/loss",
                eval_key: Optional[str] = None) -> list[Path]:
    """``plots/loss_vs_steps.png`` and ``plots/loss_vs_flops.png`` from the run's JSONL log."""
    try:
        import matplotlib
    except ImportError:  # plots are optional: pip install 'hf-structattn[plots]'
        import warnings

        warnings.warn("matplotlib is not installed: no loss plots written")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    records = read_jsonl(log_path or out / "metrics.jsonl")
    train = [r for r in records if loss_key in r]
    evals = [r for r in records if eval_key and eval_key in r]
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    for axis, xlabel, name in (("step", "optimizer step", "loss_vs_steps.png"),
                               ("flops", "training FLOPs (estimate)", "loss_vs_flops.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        keep = (lambda r: r.get(axis, 0) > 0) if axis == "flops" else (lambda r: True)  # log axis: no 0
        tr, ev = [r for r in train if keep(r)], [r for r in evals if keep(r)]
        if tr:
            ax.plot([r[axis] for r in tr], [r[loss_key] for r in tr], label=loss_key, lw=1)
        if ev:
            ax.plot([r[axis] for r in ev], [r[eval_key] for r in ev], "o-", label=eval_key)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        if axis == "flops" and any(r.get("flops", 0) > 0 for r in train):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plots / name, dpi=100)
        plt.close(fig)
        written.append(plots / name)
    return written


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_model_card(output_dir: str | Path, *, title: str, summary: str, config: dict, data: str, metrics: dict,
                     usage: str, cost_markdown: Optional[str] = None, flops_per_token: Optional[float] = None,
                     extra_sections: Optional[dict] = None, recipe_args: Optional[dict] = None,
                     tags: tuple = ("hf_structattn", "structured-attention")) -> Path:
    """README.md with a YAML header, the variant/config, data, metrics, FLOPs and cache tables, and a loading
    snippet."""
    lines = ["---", "library_name: transformers", "tags:"] + [f"- {t}" for t in tags] + ["---", "",
             f"# {title}", "", summary, ""]
    lines += ["## Loading", "", "```python", usage.strip(), "```", ""]
    lines += ["## Evaluation", "", "| metric | value |", "|---|---:|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items() if not isinstance(v, (list, dict))]
    lines += ["", "## Training data", "", data, ""]
    if flops_per_token is not None or cost_markdown:
        lines += ["## Compute and memory", ""]
        if flops_per_token is not None:
            lines += [f"Training FLOPs per token (6N + attention, `hf_structattn.flops.flops_per_token`): "
                      f"{flops_per_token:,.0f}", ""]
        if cost_markdown:
            lines += [cost_markdown, ""]
    for heading, body in (extra_sections or {}).items():
        lines += [f"## {heading}", "", body, ""]
    lines += ["## Model configuration", "", "```json", json.dumps(config, indent=2, sort_keys=True, default=str),
              "```", ""]
    if recipe_args is not None:
        lines += ["## Recipe arguments", "", "```json", json.dumps(recipe_args, indent=2, sort_keys=True,
                                                                   default=str), "```", ""]
    lines += ["![loss vs steps](plots/loss_vs_steps.png)", "![loss vs FLOPs](plots/loss_vs_flops.png)", ""]
    path = Path(output_dir) / "README.md"
    path.write_text("\n".join(lines))
    return path


def push_to_hub(output_dir: str | Path, repo_id: str, private: bool = False,
                commit_message: str = "Upload model trained with hf_structattn") -> str:
    """``HfApi().create_repo`` + ``upload_folder`` of the output folder (checkpoints left out). Returns the repo id."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    repo_id = getattr(repo, "repo_id", repo_id)
    api.upload_folder(repo_id=repo_id, folder_path=str(output_dir), commit_message=commit_message,
                      ignore_patterns=HUB_IGNORE_PATTERNS, repo_type="model")
    return repo_id


def write_metrics_json(output_dir: str | Path, metrics: dict) -> Path:
    path = Path(output_dir) / "final_metrics.json"
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    return path
