"""`make gpu-bundle`: what tests/gpu/run.sh needs on the GPU machine, written under .gpu/ (ignored by git).

* .gpu/base/wheels/: the packages of tests/gpu/requirements.txt (the Makefile downloads them);
* .gpu/base/tokenizer/: the default model's tokenizer as a HF folder (the random-weight models use it);
* .gpu/base/model/: the default model's GGUF from byte PART_A on (part-b) and the whole file's SHA-256;
* .gpu/model-a/: the GGUF's first PART_A bytes (part-a).

The device tool carries at most 64 MiB a call and the default model's GGUF alone is 94 MiB, so the file travels
in two calls: the first leaves .gpu/model-a on the machine (ignored paths stay there while it is warm), the
second carries .gpu/base and runs the check, which joins the parts (docs/gpu.md).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

PART_A = 56 << 20


def main(out: str) -> int:
    from servelm.model_loader.default_model import default_model_path
    from servelm.model_loader.tokenizer import load_tokenizer

    root = Path(out)
    gguf = Path(default_model_path())
    for folder in (root / "base" / "tokenizer", root / "base" / "model", root / "model-a"):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    load_tokenizer(str(gguf)).save_pretrained(root / "base" / "tokenizer")
    data = gguf.read_bytes()
    (root / "model-a" / "part-a").write_bytes(data[:PART_A])
    (root / "base" / "model" / "part-b").write_bytes(data[PART_A:])
    (root / "base" / "model" / "SHA256").write_text(f"{hashlib.sha256(data).hexdigest()}  {gguf.name}\n")
    for part in ("base", "model-a"):
        size = sum(f.stat().st_size for f in (root / part).rglob("*") if f.is_file())
        print(f"{root / part}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu"))
