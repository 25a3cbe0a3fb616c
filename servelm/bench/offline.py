"""`servelm bench offline`: N random prompts through the Engine at once; output tokens per second."""

from __future__ import annotations

import json
import time

from servelm.bench.common import (
    build_parser,
    hf_generate_seconds,
    load_hf_baseline,
    median_of,
    random_prompts,
)
from servelm.bench.serving import speculation_delta, speculation_line
from servelm.config import ServerArgs
from servelm.entrypoints.engine import Engine


def main(argv: list[str]) -> int:
    parser = build_parser("servelm bench offline", __doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=1.0,
                        help="Input lengths are uniform in [input_len * ratio, input_len].")
    ns = parser.parse_args(argv)
    engine = Engine(ServerArgs.from_namespace(ns))
    prompts = random_prompts(ns.num_prompts, ns.input_len, engine.scheduler.vocab_size, ns.seed, ns.range_ratio)
    params = {"max_new_tokens": ns.output_len, "temperature": 0, "ignore_eos": True}
    out_tokens = ns.num_prompts * ns.output_len

    def once() -> dict[str, float]:
        engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        assert sum(len(o["output_ids"]) for o in outs) == out_tokens
        return {"seconds": dt, "output_tok_s": out_tokens / dt}

    engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
    before = engine.server_info()
    res = median_of(ns.runs, once)
    print(f"servelm       {ns.num_prompts} prompts x {ns.input_len} in / {ns.output_len} out: "
          f"{res['seconds']:.1f} s, {res['output_tok_s']:.1f} output tok/s", flush=True)
    spec = speculation_delta(before, engine.server_info())  # over all the measured runs
    res.update(spec)
    if line := speculation_line(spec):
        print(line, flush=True)
    if ns.baseline == "hf":
        runner = engine.scheduler.runner
        hf = load_hf_baseline(ns.model_path, runner.device, runner.dtype)
        hf_generate_seconds(hf, prompts[:2], 2)
        ref = median_of(ns.runs, lambda: {"seconds": hf_generate_seconds(hf, prompts, ns.output_len)})
        ref["output_tok_s"] = out_tokens / ref["seconds"]
        res.update({f"hf_{k}": v for k, v in ref.items()})
        res["speedup"] = res["output_tok_s"] / ref["output_tok_s"]
        print(f"transformers  {ref['seconds']:.1f} s, {ref['output_tok_s']:.1f} output tok/s "
              f"-> servelm x{res['speedup']:.2f}", flush=True)
    if ns.json:
        with open(ns.json, "a") as fh:
            fh.write(json.dumps({"bench": "offline", "num_prompts": ns.num_prompts, "input_len": ns.input_len,
                                 "output_len": ns.output_len, **res}) + "\n")
    engine.shutdown()
    return 0
