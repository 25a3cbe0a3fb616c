"""`servelm bench <kind>`: benchmarks (speed is measured here, never asserted by tests)."""

from __future__ import annotations

import importlib

BENCHES = {
    "one-batch": "servelm.bench.one_batch",
    "offline": "servelm.bench.offline",
    "serving": "servelm.bench.serving",
    "allreduce": "servelm.bench.allreduce",
    "deterministic": "servelm.bench.deterministic",
    "images": "servelm.bench.images",
    "quant": "servelm.bench.quant_probe",
    "detokenize": "servelm.bench.detokenize",
    "embeddings": "servelm.bench.embeddings",
    "verify-step": "servelm.bench.verify_step",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print(f"usage: servelm bench {{{','.join(BENCHES)}}} [options]   (servelm bench KIND --help)")
        return 0 if argv and argv[0] in ("-h", "--help") else 1
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
