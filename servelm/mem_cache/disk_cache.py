"""A prefix cache that survives a restart (`--prefix-cache-dir DIR`): the KV of finished sequences in files.

The radix tree (radix_cache.py) holds prefixes in the KV pool; this is its disk tier, as SGLang's HiCache
storage tier and llama.cpp's `--slot-save-path`:

* When a request finishes, the KV of its computed tokens, rounded down to whole blocks of BLOCK tokens, is
  written to one file under DIR/<key>/ by a background thread (unless a file already holds that sequence).
  The file is written under a temporary name and renamed when complete, so a server killed mid-write leaves
  no file that could be read back; temporary names are removed at start-up.
* <key> is a digest of the model's weight files and of the cache layout (layers, KV heads, head_dim, storage
  dtype): another model, or another `--kv-cache-dtype`, never reads these files.
* At start-up the index (the chained hash of each file's first k blocks, for every k) is rebuilt from the
  files' headers. A request whose prompt continues past what the tree holds looks up the longest prefix on
  disk; those tokens' KV is read back into freshly allocated pages and inserted into the tree, instead of
  being recomputed.
* Every file carries its token ids and a CRC-32 of its KV: a torn or corrupt file is skipped with one log
  line (and removed), never served.
* DIR/<key> is capped at `--prefix-cache-size-gb`: the least recently used files go first.

TP = 1 only (each rank would keep its own shard).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from servelm.mem_cache.memory_pool import KVCache, raw_view

logger = logging.getLogger(__name__)

BLOCK = 256  # tokens per index block: a disk hit is a multiple of this
MAGIC = b"SERVELMKV1\n"
FORMAT_VERSION = 1


def model_digest(model_path: str | os.PathLike) -> str:
    """blake2b of the model's weight files (a GGUF, or a folder's safetensors / bin files and config.json)."""
    path = Path(model_path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") or p.name == "config.json")
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "blake2b").digest())
    return h.hexdigest()


def _block_hashes(ids: Sequence[int], blocks: int) -> list[bytes]:
    """The chained hash of ids' first k blocks, for k = 1 .. blocks."""
    out, h = [], b""
    for b in range(blocks):
        chunk = torch.tensor(ids[b * BLOCK:(b + 1) * BLOCK], dtype=torch.int32).numpy().tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        out.append(h)
    return out


class DiskPrefixCache:
    """The files of one model and KV layout under root/<key>, their index, and a writer thread."""

    def __init__(self, root: str | os.PathLike, model_path: str, kv: KVCache, max_bytes: int) -> None:
        self.kv = kv
        layers, _, hkv, d = kv.k.shape
        layout = {"layers": layers, "kv_heads": hkv, "head_dim": d, "storage": str(kv.k.dtype),
                  "scaled": kv.k_scale is not None, "version": FORMAT_VERSION}
        key = hashlib.blake2b((model_digest(model_path) + json.dumps(layout, sort_keys=True)).encode(),
                              digest_size=12).hexdigest()
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.per_token = self._token_bytes()
        self.index: dict[bytes, tuple[Path, int]] = {}  # chained block hash -> (file, tokens it covers)
        self.files: dict[Path, list[bytes]] = {}  # file -> its block hashes
        self._lock = threading.Lock()
        for tmp in self.dir.glob("*.tmp"):  # a write that never finished
            tmp.unlink(missing_ok=True)
        for f in sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            header = self._read_header(f)
            if header is not None:
                self._register(f, header["hashes"])
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="servelm-prefix-cache-writer", daemon=True)
        self._writer.start()
        logger.info("Prefix cache on disk: %s, %d files (%.2f GB of %.2f)", self.dir, len(self.files),
                    self._total_bytes() / 1e9, max_bytes / 1e9)

    # ------------------------------------------------------------ layout
    def _token_bytes(self) -> int:
        _, _, hkv, d = self.kv.k.shape
        scales = 2 * hkv * 2 if self.kv.k_scale is not None else 0
        return self.kv.k.shape[0] * (2 * hkv * d * self.kv.k.element_size() + scales)

    def _parts(self, layer: int) -> list[torch.Tensor]:
        """One layer's tensors in file order: K, V (and their scales), each [slots, ...]."""
        kv = self.kv.layer(layer)
        parts = [raw_view(kv.k), raw_view(kv.v)]
        if kv.k_scale is not None:
            parts += [kv.k_scale, kv.v_scale]
        return parts

    # ------------------------------------------------------------ index
    def _register(self, path: Path, hashes: list[bytes]) -> None:
        with self._lock:
            self.files[path] = hashes
            for k, h in enumerate(hashes, start=1):
                if h not in self.index or self.index[h][1] < k * BLOCK:
                    self.index[h] = (path, k * BLOCK)

    def _forget(self, path: Path) -> None:
        with self._lock:
            for h in self.files.pop(path, []):
                if self.index.get(h, (None,))[0] == path:
                    del self.index[h]
            # another file may hold the same prefixes: point them there
            for other, hashes in list(self.files.items()):
                for k, h in enumerate(hashes, start=1):
                    self.index.setdefault(h, (other, k * BLOCK))

    def _snapshot(self) -> list[Path]:
        with self._lock:  # the writer thread registers files while the scheduler may drop a bad one
            return list(self.files)

    def _total_bytes(self) -> int:
        total = 0
        for f in self._snapshot():
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def lookup(self, ids: Sequence[int]) -> tuple[Path, int] | None:
        """The file holding the longest block-aligned prefix of `ids` on disk, and its length in tokens."""
        best = None
        for h in _block_hashes(ids, len(ids) // BLOCK):
            hit = self.index.get(h)
            if hit is None:
                break
            best = hit
        return None if best is None else (best[0], min(best[1], len(ids) // BLOCK * BLOCK))

    # ------------------------------------------------------------ files
    def _read_header(self, path: Path) -> dict | None:
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise ValueError("not a servelm KV file")
                header = json.loads(f.readline())
                n = header["tokens"]
                ids = torch.frombuffer(bytearray(f.read(4 * n)), dtype=torch.int32).tolist()
                if len(ids) != n or n % BLOCK or header["per_token"] != self.per_token:
                    raise ValueError("header and layout disagree")
                header["offset"] = f.tell()
            if path.stat().st_size != header["offset"] + n * self.per_token:
                raise ValueError(f"{path.stat().st_size} bytes where {header['offset'] + n * self.per_token} "
                                 "were written")
            header["ids"] = ids
            header["hashes"] = _block_hashes(ids, n // BLOCK)
            return header
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            logger.warning("Prefix cache: skipping unreadable file %s (%s)", path.name, exc)
            path.unlink(missing_ok=True)
            return None

    def load(self, path: Path, ids: Sequence[int], start: int, end: int, slots: Sequence[int]) -> bool:
        """Read tokens [start, end) of `path` (whose first `end` ids must be ids[:end]) into `slots`. False,
        with one log line, if the file is gone, torn or corrupt (it is then dropped from disk and index)."""
        try:
            header = self._read_header(path)
            if header is None:
                raise ValueError("unreadable header")
            if header["ids"][:end] != list(ids[:end]):
                raise ValueError("its token ids differ from the index's")
            with open(path, "rb") as f:
                f.seek(header["offset"])
                payload = f.read()
            if zlib.crc32(payload) != header["crc32"]:
                raise ValueError("checksum mismatch")
        except (OSError, ValueError) as exc:
            logger.warning("Prefix cache: not serving %s (%s); it is removed", path.name, exc)
            path.unlink(missing_ok=True)
            self._forget(path)
            return False
        n = header["tokens"]
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        index = torch.tensor(list(slots), dtype=torch.long)
        at = 0
        for layer in range(self.kv.k.shape[0]):
            for part in self._parts(layer):
                row = part[0].numel() * part.element_size()
                rows = data[at + start * row: at + end * row].view(part.dtype).view(end - start, *part.shape[1:])
                part.index_copy_(0, index, rows)
                at += n * row
        os.utime(path)  # recently used: last to be evicted
        return True

    def save(self, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Queue the KV of ids' whole blocks (at `slots`) for writing, unless disk already has them."""
        n = len(ids) // BLOCK * BLOCK
        if n == 0:
            return
        hashes = _block_hashes(ids, n // BLOCK)
        hit = self.index.get(hashes[-1])
        if hit is not None and hit[1] >= n:
            return
        index = torch.tensor(list(slots[:n]), dtype=torch.long)
        # a snapshot now (the pages may be reused before the writer gets to them)
        chunks = [part.index_select(0, index) for layer in range(self.kv.k.shape[0]) for part in self._parts(layer)]
        self._queue.put((list(ids[:n]), hashes, chunks))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is on disk (tests; shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(*item)
            except Exception as exc:  # the writer must outlive any one file (a full disk, a bug)
                logger.warning("Prefix cache: could not write a file (%s: %s)", type(exc).__name__, exc)

    def _write(self, ids: list[int], hashes: list[bytes], chunks: list[torch.Tensor]) -> None:
        payload = b"".join(c.contiguous().view(torch.uint8).numpy().tobytes() for c in chunks)
        name = hashes[-1].hex()
        path, tmp = self.dir / f"{name}.kv", self.dir / f"{name}.{os.getpid()}.tmp"
        header = {"tokens": len(ids), "per_token": self.per_token, "crc32": zlib.crc32(payload),
                  "version": FORMAT_VERSION}
        with open(tmp, "wb") as f:
            f.write(MAGIC + json.dumps(header).encode() + b"\n")
            f.write(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # complete, or not there at all
        self._register(path, hashes)
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        files = sorted(self._snapshot(), key=lambda p: p.stat().st_mtime if p.exists() else 0)
        total = self._total_bytes()
        while total > self.max_bytes and len(files) > 1:
            victim = files.pop(0)
            try:
                size = victim.stat().st_size
                victim.unlink()
            except FileNotFoundError:
                size = 0
            self._forget(victim)
            total -= size
