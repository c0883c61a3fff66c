"""One vLLM serving process of the serve tests: `LLM(...)` on the CPU as a user starts it, greedy decoding.

    python serve_job.py JOB.json

JOB.json: {"out", "jobs": [{"name", "model", "load_format", "prompt", "max_tokens"[, "speculative_config"]}]}.
Each job builds `LLM(model, load_format, enforce_eager=True, skip_tokenizer_init=True)` (no tokenizer: token
ids in and out), decodes `max_tokens` tokens greedily from `prompt` and writes OUT/NAME.json:
- {"tokens": [T_gen], "logprobs": [[V] for each prompt position after the first, then for each generated
  token]}: every next-token log-probability vLLM computed, or
- {"type", "message", "trace"}: vLLM's error, a result the tests pin.
With a `speculative_config` (e.g. MTP) the result also has "drafts": this generation's spec-decode counters
(vLLM's num_drafts, num_draft_tokens, num_accepted_tokens), and OUT/NAME.draft.safetensors holds the draft
model's state_dict as the load and vLLM's process_weights_after_loading left it.
No workaround of tests_vllm/workarounds.py applies: this is vLLM's CPU worker with its own MoE backend choice.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

# The engine core runs in this process (vLLM's in-process client), and its OpenMP threads are not pinned to
# cores: the 2-core machines the tier runs on are shared with the test runner and other processes.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
LLM_ARGS = {"enforce_eager": True, "skip_tokenizer_init": True, "dtype": "float16", "max_model_len": 64,
            "max_num_seqs": 1, "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 64 << 20,
            "max_logprobs": -1, "seed": 0}
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vllm:spec_decode_<name>


def serve(job: dict, out: Path) -> dict:
    """Tokens and full-vocabulary log-probabilities of one greedy generation (and its drafts, see above)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = job.get("speculative_config")
    extra = {} if spec is None else {"speculative_config": spec, "disable_log_stats": False}
    llm = LLM(model=job["model"], load_format=job["load_format"], **LLM_ARGS, **extra)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, logprobs=-1, prompt_logprobs=-1)
    before = spec_counters(llm) if spec is not None else {}
    request = llm.generate([TokensPrompt(prompt_token_ids=job["prompt"])], params, use_tqdm=False)[0]
    steps = [*request.prompt_logprobs[1:], *request.outputs[0].logprobs]
    result = {"tokens": list(request.outputs[0].token_ids),
              "logprobs": [[step[token].logprob for token in range(len(step))] for step in steps]}
    if spec is not None:
        result["drafts"] = {name: count - before[name] for name, count in spec_counters(llm).items()}
        save_file(llm.collective_rpc(draft_state)[0], str(out / f"{job['name']}.draft.safetensors"))
    return result


def spec_counters(llm) -> dict[str, int]:
    """vLLM's spec-decode counters so far (Prometheus, cumulative over the process)."""
    counts = {m.name.removeprefix("vllm:spec_decode_"): m for m in llm.get_metrics()}
    return {name: int(counts[name].value) for name in SPEC_COUNTERS}


def draft_state(worker) -> dict[str, torch.Tensor]:
    """The draft model's state_dict on this worker (each tensor its own contiguous copy)."""
    model = worker.model_runner.drafter.model
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}


def main(job_file: str) -> None:
    os.environ.update(ENV)
    spec = json.loads(Path(job_file).read_text())
    for job in spec["jobs"]:
        try:
            result = serve(job, Path(spec["out"]))
        except Exception as exc:  # vLLM refusing a checkpoint is a result the tests pin
            result = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()[-3000:]}
        (Path(spec["out"]) / f"{job['name']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
