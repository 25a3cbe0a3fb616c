"""Tokenizers for model paths: a HF folder's own tokenizer, or one converted from GGUF metadata.

Converting a GGUF vocabulary (vocab, merges, special tokens, chat template) with transformers takes
seconds, so the converted tokenizer is saved once under
`<cache root>/tokenizers/<sha256 of the .gguf file>/` and loaded from there afterwards. The cache
root is `$SERVELM_CACHE_DIR`, else `~/.cache/servelm`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

import transformers

from servelm.model_loader.model_path import resolve_model_path

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "SERVELM_CACHE_DIR"
_HASH_CHUNK = 1 << 20

# (path, size, mtime_ns) -> sha256 hex, so the API and scheduler code paths in one process hash once.
_sha256_memo: dict[tuple[str, int, int], str] = {}


def cache_root() -> str:
    """The servelm cache root: `$SERVELM_CACHE_DIR`, else `~/.cache/servelm`."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "servelm")


def file_sha256(path: str) -> str:
    """SHA-256 hex digest of a file, read in 1-MB chunks (memoised per path, size and mtime)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _sha256_memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
        _sha256_memo[key] = h.hexdigest()
    return _sha256_memo[key]


def tokenizer_cache_dir(gguf_path: str) -> str:
    """Where the tokenizer converted from `gguf_path` is (or will be) cached."""
    return os.path.join(cache_root(), "tokenizers", file_sha256(gguf_path))


def _save_to_cache(tokenizer: transformers.PreTrainedTokenizerBase, target: str) -> None:
    """Save atomically: write a temp folder next to `target`, then rename it into place.

    NOTE: several processes (API server, scheduler ranks) may convert the same file at once; the
    rename makes a half-written cache impossible and the loser just discards its copy.
    """
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError as e:
        logger.warning("Cannot create tokenizer cache under %s (%s); it will be converted again next time", parent, e)
        return
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):
            logger.warning("Cannot write tokenizer cache %s; it will be converted again next time", target)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf_tokenizer(gguf_path: str) -> transformers.PreTrainedTokenizerFast:
    cached = tokenizer_cache_dir(gguf_path)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        logger.debug("Loading tokenizer of %s from cache %s", gguf_path, cached)
        return transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
    logger.info("Converting the GGUF tokenizer of %s (cached in %s afterwards)", gguf_path, cached)
    from servelm.model_loader import gguf_bert

    if gguf_bert.architecture(gguf_path) == "bert":  # transformers does not read BERT GGUF files
        tokenizer = gguf_bert.tokenizer(gguf_path)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), local_files_only=True
        )
    _save_to_cache(tokenizer, cached)
    return tokenizer


def read_chat_template(chat_template: str) -> str:
    """Resolve a `--chat-template` value: the contents of a file, or the literal Jinja template."""
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if "{{" not in chat_template and "{%" not in chat_template:
        raise FileNotFoundError(
            f"Chat template {chat_template!r} is neither an existing file nor a Jinja template string."
        )
    return chat_template


def load_tokenizer(path: str, chat_template: str | None = None) -> transformers.PreTrainedTokenizerFast:
    """Load the fast tokenizer for a model path (HF folder or .gguf file).

    Args:
        path: a HF model folder (tokenizer.json etc.) or a .gguf file, as for `load_model_source`.
        chat_template: overrides the model's chat template: a file path or a literal Jinja string.

    GGUF tokenizers are converted by transformers from the file's metadata (vocab, merges, special
    tokens, bos/eos, `tokenizer.chat_template`) and cached by file hash (see module docstring).
    """
    resolved, fmt = resolve_model_path(path)
    if fmt == "gguf":
        tokenizer = _load_gguf_tokenizer(resolved)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolved, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer
