"""`--push_to_hub`: a saved model dir (training's final/, or export's merged model) uploaded to a Hugging Face Hub
model repo through `huggingface_hub` (created if missing; the login of `hf auth login` or HF_TOKEN)."""

from __future__ import annotations

from pathlib import Path

from fastdpo.errors import FastDPOError


def hub_repo(hub_model_id: str, output_dir: str) -> str:
    """The repo to push to: --hub_model_id, else the output dir's name (as HF's Trainer names it)."""
    return hub_model_id or Path(output_dir.rstrip("/\\")).name


def push_folder(folder: Path, repo_id: str, private: bool = False, what: str = "model") -> str:
    """Upload every file of `folder` to the model repo `repo_id` (created if missing); returns the repo's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=getattr(url, "repo_id", repo_id), repo_type="model",
                          commit_message=f"Upload {what} trained with fastdpo")
    except Exception as e:  # network, authentication, permissions: huggingface_hub raises many types
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FastDPOError(f"--push_to_hub: uploading {folder} to {repo_id} failed ({msg}). The {what} is saved in "
                           f"{folder}; upload it with `hf upload {repo_id} {folder}` once `hf auth login` (or "
                           "HF_TOKEN) and the network allow.") from None
    return str(url)
