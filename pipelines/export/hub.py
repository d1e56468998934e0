"""Push an artifact folder to the Hugging Face Hub: create_repo + upload_folder, with the token the Hub client finds
(HF_TOKEN, or the one `hf auth login` stored) and the endpoint it reads (HF_ENDPOINT). Files the Hub already holds
unchanged are not uploaded again, so pushing an unchanged artifact makes no commit. The token is never printed.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from tfm_runtime.io import atomic_write_json

PUSH_RECORD = "push.json"        # written into the artifact after a push, never uploaded


class PushError(RuntimeError):
    """The push failed; the local artifact is untouched."""


@dataclass
class PushResult:
    repo_id: str
    revision: str
    commit_sha: str
    commit_url: str
    new_commit: bool             # False: the Hub already held these files at this revision


def push(folder: str, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None) -> PushResult:
    """Upload every file of `folder` (but push.json) to `repo_id` at `revision` (default main), creating the
    repository (private if asked) and the branch when missing. Raises PushError with a message that says what to do.
    """
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError
    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        raise PushError("HF_HUB_OFFLINE is set: a push needs the network; unset it and push again")
    if not get_token():
        raise PushError(f"no Hugging Face token for {endpoint}: set HF_TOKEN or run `hf auth login`, then push again")
    api = HfApi()
    branch = revision or "main"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        before = api.repo_info(repo_id, revision=branch).sha
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=branch,
                                 commit_message=commit_message or f"Upload {os.path.basename(folder)}",
                                 ignore_patterns=[PUSH_RECORD])
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        detail = str(e).splitlines()[0]
        if status == 401:
            raise PushError(f"the Hub at {endpoint} refused the token for {repo_id} (HTTP 401): log in again "
                            f"(`hf auth login`) or set HF_TOKEN to a valid token") from e
        if status == 403:
            raise PushError(f"no write access to {repo_id} on {endpoint} (HTTP 403): use a token with write access "
                            f"to that namespace, or push to a repository of your own") from e
        raise PushError(f"push to {repo_id} on {endpoint} failed (HTTP {status}): {detail}") from e
    except (OSError, ConnectionError) as e:
        raise PushError(f"could not reach the Hub at {endpoint}: {type(e).__name__}: {e}") from e
    except Exception as e:                                  # the HTTP client's transport errors (httpx2)
        if type(e).__module__.startswith(("httpx", "httpcore")):
            raise PushError(f"could not reach the Hub at {endpoint}: {type(e).__name__}: {e}") from e
        raise
    result = PushResult(repo_id=repo_id, revision=branch, commit_sha=info.oid, commit_url=info.commit_url,
                        new_commit=info.oid != before)
    atomic_write_json(os.path.join(folder, PUSH_RECORD), asdict(result))
    return result
