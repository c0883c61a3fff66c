"""One vLLM serving process of the serve tests: `LLM(...)` on the CPU as a user starts it, greedy decoding.

    python serve_job.py JOB.json

JOB.json: {"out", "jobs": [{"name", "model", "load_format", "prompt", "max_tokens"}]}. Each job builds
`LLM(model, load_format, enforce_eager=True, skip_tokenizer_init=True)` (no tokenizer: token ids in and out),
decodes `max_tokens` tokens greedily from `prompt` and writes OUT/NAME.json:
- {"tokens": [T_gen], "logprobs": [[V] for each prompt position after the first, then for each generated
  token]}: every next-token log-probability vLLM computed, or
- {"type", "message", "trace"}: vLLM's error, a result the tests pin.
No workaround of tests_vllm/workarounds.py applies: this is vLLM's CPU worker with its own MoE backend choice.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

# The engine core runs in this process (vLLM's in-process client), and its OpenMP threads are not pinned to
# cores: the 2-core machines the tier runs on are shared with the test runner and other processes.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
LLM_ARGS = {"enforce_eager": True, "skip_tokenizer_init": True, "dtype": "float16", "max_model_len": 64,
            "max_num_seqs": 1, "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 64 << 20,
            "max_logprobs": -1, "seed": 0}


def serve(job: dict) -> dict:
    """Tokens and full-vocabulary log-probabilities of one greedy generation."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], load_format=job["load_format"], **LLM_ARGS)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, logprobs=-1, prompt_logprobs=-1)
    request = llm.generate([TokensPrompt(prompt_token_ids=job["prompt"])], params, use_tqdm=False)[0]
    steps = [*request.prompt_logprobs[1:], *request.outputs[0].logprobs]
    return {"tokens": list(request.outputs[0].token_ids),
            "logprobs": [[step[token].logprob for token in range(len(step))] for step in steps]}


def main(job_file: str) -> None:
    os.environ.update(ENV)
    spec = json.loads(Path(job_file).read_text())
    for job in spec["jobs"]:
        try:
            result = serve(job)
        except Exception as exc:  # vLLM refusing a checkpoint is a result the tests pin
            result = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()[-3000:]}
        (Path(spec["out"]) / f"{job['name']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
