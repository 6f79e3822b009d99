"""What a recipe leaves behind: model card, plots, metrics file, and the optional Hub upload."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Optional

from .args import ConfigError, RunFailure, run_configuration
from .tracking import read_jsonl

# what upload_folder leaves out: resumable training state is not part of the published model
HUB_IGNORE_PATTERNS = ["checkpoints/*", "checkpoints/**", "base_tiny_chronos_t5/*", "source/*", "source/**", "*.pkl",
                       "run_config.json"]


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


def public_configuration(args, recipe: str) -> dict:
    """The run configuration as it may be published (tracker config, model card): the fields named in the args
    class's ``PATH_FIELDS`` keep only their file names, so no local absolute path leaves the machine."""
    configuration = run_configuration(args, recipe)
    for name in getattr(args, "PATH_FIELDS", ()):
        value = configuration["args"].get(name)
        if value is not None:
            names = [Path(v).name for v in value] if isinstance(value, list) else Path(value).name
            configuration["args"][name] = names
    return configuration


def write_model_card(output_dir: str | Path, args, *, recipe: str, title: str, summary: str, config: dict, data: str,
                     metrics: dict, usage: str, pipeline_tag: str, eval_results: list[tuple] = (),
                     dataset_type: str = "custom", datasets: Optional[list[str]] = None,
                     cost_markdown: Optional[str] = None, flops_per_token: Optional[float] = None,
                     extra_sections: Optional[dict] = None, tags: tuple = ()) -> Path:
    """README.md through ``huggingface_hub.ModelCard`` with ``ModelCardData`` metadata (license, library_name,
    pipeline_tag, tags, datasets where known, model-index from ``eval_results`` = [(task_type, metric_type,
    metric_name, value)]), then the variant/config, data, metrics, FLOPs and cache tables and a loading snippet."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    model_name = (args.hub_model_id or Path(args.output_dir).name).split("/")[-1]
    results = [EvalResult(task_type=task, dataset_type=dataset_type, dataset_name=data.split(" (")[0][:80],
                          metric_type=metric, metric_name=name, metric_value=float(value))
               for task, metric, name, value in eval_results if value is not None]
    card_data = ModelCardData(license="apache-2.0", library_name="transformers", pipeline_tag=pipeline_tag,
                              tags=["hf_structattn", "structured-attention", "custom_code", *tags],
                              datasets=datasets or None, model_name=model_name, eval_results=results or None)
    lines = [f"# {title}", "", summary, ""]
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
    lines += [f"## Recipe arguments (`recipes/{recipe}.py`)", "", "```json",
              json.dumps(public_configuration(args, recipe), indent=2, sort_keys=True, default=str), "```", ""]
    lines += ["![loss vs steps](plots/loss_vs_steps.png)", "![loss vs FLOPs](plots/loss_vs_flops.png)", ""]
    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))
    path = Path(output_dir) / "README.md"
    card.save(path)
    return path


_NETWORK_ERROR_NAMES = {"TransportError", "NetworkError", "ConnectError", "ConnectTimeout", "ReadTimeout",
                        "TimeoutException", "ConnectionError", "ProxyError", "SSLError", "RemoteProtocolError"}


def is_network_error(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a failure to reach a server at all (connection refused, DNS, timeout,
    TLS), as opposed to an answer from the Hub. Recognised by the HTTP clients' exception classes (httpx / requests
    families) and the OS's socket errors, so no particular client has to be imported."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        names = {cls.__name__ for cls in type(error).__mro__}
        if names & _NETWORK_ERROR_NAMES or isinstance(error, (ConnectionError, TimeoutError, socket.gaierror,
                                                               socket.herror)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_hub_access(repo_id: str, private: bool = False, flag: str = "--push_to_hub") -> str:
    """Before any training: the token works (``whoami``) and the repository exists or can be created
    (``create_repo(exist_ok=True)``). Offline, unreachable, without a token, with a rejected token or without write
    access this fails in seconds with a one-line :class:`ConfigError` that says which (starting with ``flag``, the
    option or command that asked). Returns the repository id."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    api = HfApi()
    try:
        user = api.whoami()
    except OfflineModeIsEnabled:
        raise ConfigError(f"{flag}: the Hub is unreachable in offline mode (HF_HUB_OFFLINE is set)") from None
    except LocalTokenNotFoundError:
        raise ConfigError(f"{flag}: no Hub token found; log in with `hf auth login` or set HF_TOKEN") from None
    except Exception as error:
        if is_network_error(error):
            raise ConfigError(f"{flag}: the Hub at {api.endpoint or constants.ENDPOINT} is unreachable "
                              f"({_one_line(error)}); check the network connection (or HF_ENDPOINT) and retry"
                              ) from None
        status = getattr(getattr(error, "response", None), "status_code", None)
        if isinstance(error, HfHubHTTPError) and status == 401:
            raise ConfigError(f"{flag}: the Hub rejected the token (401 Unauthorized); log in with `hf auth "
                              "login` or set a valid HF_TOKEN") from None
        raise ConfigError(f"{flag}: cannot authenticate with the Hub ({_one_line(error)})") from None
    try:
        repo = api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as error:
        if is_network_error(error):
            raise ConfigError(f"{flag}: the Hub became unreachable while creating {repo_id} "
                              f"({_one_line(error)})") from None
        if not isinstance(error, (HfHubHTTPError, OSError)):
            raise
        raise ConfigError(f"{flag}: cannot create or access {repo_id} as {user.get('name', '?')} "
                          f"({str(error).splitlines()[0]})") from None
    return getattr(repo, "repo_id", repo_id)


def push_to_hub(output_dir: str | Path, repo_id: str, private: bool = False,
                commit_message: str = "Upload model trained with hf_structattn") -> str:
    """``HfApi().upload_folder`` of the output folder (checkpoints and bookkeeping left out; the repository was
    created by :func:`check_hub_access` before training). Returns the repository id. A failed upload is one
    :class:`RunFailure` line (the trained run stays on disk)."""
    from huggingface_hub import HfApi

    try:
        HfApi().upload_folder(repo_id=repo_id, folder_path=str(output_dir), commit_message=commit_message,
                              ignore_patterns=HUB_IGNORE_PATTERNS, repo_type="model")
    except Exception as error:
        what = "the Hub is unreachable" if is_network_error(error) else "the Hub refused it"
        raise RunFailure(f"uploading {output_dir} to {repo_id} failed, {what} ({_one_line(error)}); the trained run "
                         f"is complete on disk: upload it again with `hf-structattn push {output_dir} --repo-id "
                         f"{repo_id}`") from None
    return repo_id


def write_metrics_json(output_dir: str | Path, metrics: dict) -> Path:
    path = Path(output_dir) / "final_metrics.json"
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))
    return path
