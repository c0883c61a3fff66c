"""vLLM serving end to end on a CPU where vLLM 0.32 has an int4 MoE kernel (AMX: `CPUExpertsInt4`):
`LLM(model, load_format=...)` as a user starts it (no --quantization flag, enforce_eager, no tokenizer),
greedy decoding of MAX_TOKENS tokens from PROMPT, with every next-token log-probability over the vocabulary
(the prompt's positions and each generated token; serve_job.py). The models (MODELS):

| model                            | vLLM's MoE method  | default loader                 | --load-format wna16       |
|----------------------------------|--------------------|--------------------------------|---------------------------|
| synthetic_gptq_w4_sym            | AutoGPTQMoEMethod  | serves                         | same tokens, same log p (checkpoint and wna16-shard) |
| awq_w4_g32 (real, GPTQModel AWQ) | AutoAWQMoEMethod   | serves; = the float forward    | same tokens, same log p   |
| synthetic_gptq_w4_sym_no_qzeros  | AutoGPTQMoEMethod  | serves unwritten zero points   | = the float forward       |
| autoround_layer_config_mixed     | INC: unquantized   | fails (pinned)                 | refused (pinned)          |
| gptq_w4_g32_zero_edge            | none               | config refused (pinned)        | config refused (pinned)   |

MTP (MTP_JOBS): model_checkpoint's Qwen3-Next model with its MTP layer (symmetric GPTQ, AutoGPTQMoEMethod)
served with `speculative_config={"method": "mtp", ...}`: vLLM builds its draft model (Qwen3NextMTP, whose
mtp.layers.0 has its own MoE layer) with the target's load format (model_loader/utils.py
get_draft_load_config), so `load_format="wna16"` fills both (from the checkpoint and from a wna16-shard
output). The plugin's serve has the default loader's
tokens, log-probabilities and draft counts, and its draft model holds the default loader's tensors, also
from the checkpoint without qzeros, whose draft MoE layer only the plugin fills (vLLM's loader leaves its
zero points unwritten: its draft then differs in the six routed-expert tensors).

"The float forward" is the quantizer's (float_reference: transformers' Qwen3-MoE in float32 with the
reference.safetensors weights), within FLOAT_TOL in every log-probability and greedy token; a wrong expert is
further off than that. Each default-loader failure is pinned by name in DEFAULT_FAILS with its cause.

Without AMX, vLLM 0.32 has no CPU kernel for these MoE layers and this module skips. On a machine with a CUDA
GPU and a CUDA build of vLLM (scripts/gpu_check), the same comparisons run on the GPU, where vLLM's Marlin
methods serve these layers and the CPU-only failures are not expected (DEFAULT_FAILS and PLUGIN_REFUSED hold
them on a CPU only).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import workarounds
from float_reference import float_logprobs, float_model
from model_checkpoint import write_mtp_model, write_model
from safetensors.torch import load_file

from wna16_loader.preshard.run import preshard_checkpoint

ON_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not (ON_CUDA or workarounds.has_amx()), reason="no AMX on this CPU: vLLM 0.32 has no "
                                "CPU kernel for int4 MoE layers without it (CPUExpertsInt4), so nothing can be served")

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SERVE_JOB = Path(__file__).resolve().parents[1] / "serve_job.py"
PROMPT = [5, 17, 42, 99]
MAX_TOKENS = 4
VOCAB = 256  # every model here: the GPTQModel fixture's config
# |log p| between vLLM's fp16 serve (its CPU int4 kernel quantises MoE inputs to int8) and the float32 forward:
# seen 0.002 (AWQ fixture) and 0.009 (synthetic model); a wrong model is further off than WRONG_OFF (seen: two
# experts' gate_up swapped 0.13, unwritten zero points 0.63)
FLOAT_TOL = 0.02
WRONG_OFF = 0.1
TIMEOUT_S = 900


@dataclass(frozen=True)
class Served:
    """A model served through vLLM's default loader ("auto") and the plugin ("wna16", "wna16-shard"):
    a real fixture (tests/fixtures/<name>), or model_checkpoint.write_model's synthetic one (`synthetic`:
    its arguments)."""

    name: str
    loads: tuple[str, ...] = ("auto", "wna16")
    synthetic: dict | None = None


@dataclass(frozen=True)
class DefaultFailure:
    """A model vLLM's default loader cannot serve on a CPU, and why: `words` in its error message, or None
    where it serves without an error and only the float forward shows the failure."""

    name: str
    why: str
    kind: str | None = None
    words: str | None = None


MODELS = [
    Served("synthetic_gptq_w4_sym", loads=("auto", "wna16", "wna16-shard"), synthetic={}),  # AutoGPTQMoEMethod
    Served("awq_w4_g32"),  # AutoAWQMoEMethod
    Served("synthetic_gptq_w4_sym_no_qzeros", synthetic={"qzeros": False}),
    Served("autoround_layer_config_mixed"),
    Served("gptq_w4_g32_zero_edge"),
]
BY_NAME = {model.name: model for model in MODELS}
CPU_DEFAULT_FAILS = {
    "synthetic_gptq_w4_sym_no_qzeros": DefaultFailure(
        "cpu_int4_kernel_reads_unwritten_qzeros",
        "a symmetric GPTQ checkpoint without qzeros tensors: AutoGPTQMoEMethod allocates w13_qzeros/w2_qzeros "
        "with torch.empty and nothing writes them, yet its CPU backend reads zero points even for symmetric "
        "layers (get_fused_moe_quant_config: use_zp ... or backend == CPU), so it serves whatever the memory "
        "held (another answer in every process)"),
    "autoround_layer_config_mixed": DefaultFailure(
        "inc_builds_every_moe_layer_unquantized_on_cpu",
        "vLLM maps quant_method auto-round to INC, whose WNA16 scheme returns UnquantizedFusedMoEMethod for "
        "every MoE layer on a CPU ('CPU does not support quantized MoE yet'): float w13_weight/w2_weight "
        "parameters meet the checkpoint's qweight/qzeros/scales",
        "AttributeError", "Layer model.layers.0.mlp.experts has no parameter 'w2_qweight' for checkpoint weight "
        "'model.layers.0.mlp.experts.0.down_proj.qweight'"),
}
DEFAULT_FAILS = {} if ON_CUDA else CPU_DEFAULT_FAILS
# The plugin's own refusals: (model, exception, words). INC's unquantized layers hold float parameters and the
# plugin fills a layer only in the layout of the method vLLM chose; it does not dequantize into it.
PLUGIN_REFUSED = {} if ON_CUDA else {
    "autoround_layer_config_mixed": ("LayoutMismatchError", "model.layers.0.mlp.experts: the engine's MoE method "
                                     "is unquantized but the checkpoint's experts here are quantized")}
# vLLM refuses the config before any loader runs, so --load-format does not matter: (exception, words)
REFUSED = {"gptq_w4_g32_zero_edge": ("ValidationError", "Unsupported quantization config: bits=4, sym=False")}


def job(model: Served, load: str, folders: dict[str, Path]) -> dict:
    source = folders[f"{model.name}-shard" if load == "wna16-shard" else model.name]
    return {"name": f"{model.name}-{load}", "model": str(source), "load_format": load.removesuffix("-shard"),
            "prompt": PROMPT, "max_tokens": MAX_TOKENS}


def failing(model: Served) -> bool:
    return model.name in DEFAULT_FAILS or model.name in REFUSED or model.name in PLUGIN_REFUSED


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint folder, and "name-reference" -> its reference.safetensors (a shard: "name-shard")."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for model in MODELS:
        if model.synthetic is None:
            out[model.name] = FIXTURES / model.name / "checkpoint"
            out[f"{model.name}-reference"] = FIXTURES / model.name / "reference.safetensors"
            continue
        out[f"{model.name}-reference"] = root / f"{model.name}-reference.safetensors"
        out[model.name] = write_model(root / model.name, reference=out[f"{model.name}-reference"],
                                      **model.synthetic)
        if "wna16-shard" in model.loads:
            out[f"{model.name}-shard"] = root / f"{model.name}-shard"
            preshard_checkpoint(out[model.name], out[f"{model.name}-shard"], tp_size=1, progress=False)
    return out


@pytest.fixture(scope="session")
def served(folders, tmp_path_factory) -> dict[str, dict]:
    """"model-load" -> serve_job.py's result, every job in one process (those expected to fail last)."""
    return run_jobs(tmp_path_factory.mktemp("serve"),
                    [job(m, load, folders) for m in sorted(MODELS, key=failing) for load in m.loads])


def run_jobs(root: Path, jobs: list[dict]) -> dict[str, dict]:
    """name -> serve_job.py's result of each job, all in one process writing into `root`."""
    (root / "jobs.json").write_text(json.dumps({"out": str(root), "jobs": jobs}))
    with (root / "serve.log").open("w") as log:
        code = subprocess.run([sys.executable, str(SERVE_JOB), str(root / "jobs.json")], stdout=log,
                              stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
    assert code == 0, (root / "serve.log").read_text()[-4000:]
    return {j["name"]: json.loads((root / f"{j['name']}.json").read_text()) for j in jobs}


def generation(result: dict) -> tuple[list[int], torch.Tensor]:
    """(tokens, log-probabilities [steps, V]) of a served job; vLLM's traceback when it failed."""
    assert "type" not in result, result.get("trace")
    tokens, logprobs = result["tokens"], torch.tensor(result["logprobs"])
    assert len(tokens) == MAX_TOKENS and logprobs.shape == (len(PROMPT) - 1 + MAX_TOKENS, VOCAB)
    return tokens, logprobs


def float_off(name: str, result: dict, folders: dict[str, Path]) -> tuple[float, bool]:
    """How far a serve is from the quantizer's float forward, teacher-forced on the served sequence: the
    largest |log p| difference, and whether every greedy token is the float forward's best or within
    FLOAT_TOL of it."""
    tokens, logprobs = generation(result)
    model = float_model(folders[name], folders[f"{name}-reference"])
    reference = float_logprobs(model, [*PROMPT, *tokens[:-1]])
    generated = reference[len(PROMPT) - 1:]
    chosen = generated.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (logprobs - reference).abs().max().item(), bool((chosen >= generated.max(dim=1).values - FLOAT_TOL).all())


SAME = [(m.name, load) for m in MODELS if not failing(m) for load in m.loads if load != "auto"]


@pytest.mark.parametrize("name, load", SAME, ids=[f"{n}-{load}" for n, load in SAME])
def test_plugin_serves_what_the_default_loader_serves(served, name, load):
    tokens, logprobs = generation(served[f"{name}-auto"])
    ours, our_logprobs = generation(served[f"{name}-{load}"])
    assert ours == tokens
    assert torch.equal(our_logprobs, logprobs), f"{name} ({load}): {(our_logprobs - logprobs).abs().max()}"


def test_default_serve_is_the_quantizers_model(served, folders):
    """vLLM's own load and kernel give the real AWQ fixture's float forward: the equality above is the model's."""
    off, greedy = float_off("awq_w4_g32", served["awq_w4_g32-auto"], folders)
    assert off <= FLOAT_TOL and greedy, f"{off:.4f} off the quantizer's float forward (greedy: {greedy})"


def test_a_wrong_expert_is_further_off_than_the_tolerance(served, folders):
    """The float forward with two experts swapped misses the served AWQ model by more than FLOAT_TOL."""
    tokens, logprobs = generation(served["awq_w4_g32-auto"])
    model = float_model(folders["awq_w4_g32"], folders["awq_w4_g32-reference"])
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.copy_(experts.gate_up_proj[[1, 0, 2, 3]])
    assert (logprobs - float_logprobs(model, [*PROMPT, *tokens[:-1]])).abs().max().item() > WRONG_OFF


@pytest.mark.parametrize("name", sorted(DEFAULT_FAILS))
def test_default_loader_failure_is_pinned(served, folders, name):
    """vLLM's default loader still fails here (when it stops, compare it with the plugin instead)."""
    pin, got = DEFAULT_FAILS[name], served[f"{name}-auto"]
    if pin.words is not None:
        assert got.get("type") == pin.kind and pin.words in got.get("message", ""), (pin.name, got)
    else:
        off, _ = float_off(name, got, folders)
        assert off > WRONG_OFF, f"{pin.name}: vLLM's default serve is now {off:.4f} off the float forward"


SERVED_WHERE_DEFAULT_FAILS = sorted(set(DEFAULT_FAILS) - set(PLUGIN_REFUSED))


@pytest.mark.parametrize("name", SERVED_WHERE_DEFAULT_FAILS)
def test_plugin_serves_the_quantizers_model_where_the_default_loader_fails(served, folders, name):
    off, greedy = float_off(name, served[f"{name}-wna16"], folders)
    assert off <= FLOAT_TOL and greedy, f"{name}: {off:.4f} off the quantizer's float forward (greedy: {greedy})"


def test_plugin_without_qzeros_serves_what_the_default_loader_serves_with_them(served):
    """The same seed writes the same q and scales with and without qzeros: the plugin's serve of the checkpoint
    without them is the default loader's of the one with them (the midpoint every symmetric layer means)."""
    tokens, logprobs = generation(served["synthetic_gptq_w4_sym-auto"])
    ours, our_logprobs = generation(served["synthetic_gptq_w4_sym_no_qzeros-wna16"])
    assert ours == tokens and torch.equal(our_logprobs, logprobs)


@pytest.mark.parametrize("name", sorted(PLUGIN_REFUSED))
def test_plugin_refusal_is_pinned(served, name):
    kind, words = PLUGIN_REFUSED[name]
    got = served[f"{name}-wna16"]
    assert got.get("type") == kind and words in got.get("message", ""), got


@pytest.mark.parametrize("name", sorted(REFUSED))
@pytest.mark.parametrize("load", ["auto", "wna16"])
def test_vllm_refuses_the_config_for_both_loaders(served, name, load):
    kind, words = REFUSED[name]
    got = served[f"{name}-{load}"]
    assert got.get("type") == kind and words in got.get("message", ""), got


MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 1}
# job -> (checkpoint, load format); "no-qzeros": the same model without qzeros tensors (write_model's `qzeros`),
# "shard": its wna16-shard output (TP 1, the MTP layer sharded too)
MTP_JOBS = {"auto": ("mtp", "auto"), "wna16": ("mtp", "wna16"), "wna16-no-qzeros": ("mtp-no-qzeros", "wna16"),
            "wna16-shard": ("mtp-shard", "wna16")}
MTP_PLUGIN = sorted(set(MTP_JOBS) - {"auto"})
MTP_EXPERTS = "model.layers.0.mlp.experts."  # the draft model's MoE layer in its state_dict


@pytest.fixture(scope="module")
def served_mtp(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The MTP jobs' folder (their NAME.draft.safetensors) and results, one process (one LLM per job)."""
    root = tmp_path_factory.mktemp("mtp")
    folders = {"mtp": write_mtp_model(root / "mtp"),
               "mtp-no-qzeros": write_mtp_model(root / "mtp-no-qzeros", qzeros=False), "mtp-shard": root / "mtp-shard"}
    preshard_checkpoint(folders["mtp"], folders["mtp-shard"], tp_size=1, progress=False)
    jobs = [{"name": name, "model": str(folders[ckpt]), "load_format": load, "prompt": PROMPT,
             "max_tokens": MAX_TOKENS, "speculative_config": MTP_SPEC} for name, (ckpt, load) in MTP_JOBS.items()]
    return root, run_jobs(root, jobs)


def test_mtp_drafts_are_proposed(served_mtp):
    """vLLM's MTP drafter runs: one draft token proposed at each decoding step after the first."""
    generation(served_mtp[1]["auto"])
    drafts = served_mtp[1]["auto"]["drafts"]
    assert drafts["num_draft_tokens"] == drafts["num_drafts"] * MTP_SPEC["num_speculative_tokens"] > 0, drafts


@pytest.mark.parametrize("load", MTP_PLUGIN)
def test_mtp_plugin_serves_what_the_default_loader_serves(served_mtp, load):
    """Same tokens, log-probabilities and draft counts (drafted and accepted) as the default loader's serve."""
    results = served_mtp[1]
    tokens, logprobs = generation(results["auto"])
    ours, our_logprobs = generation(results[load])
    assert ours == tokens
    assert torch.equal(our_logprobs, logprobs), f"{load}: {(our_logprobs - logprobs).abs().max()}"
    assert results[load]["drafts"] == results["auto"]["drafts"]


@pytest.mark.parametrize("load", MTP_PLUGIN)
def test_plugin_fills_the_mtp_draft_models_moe_layer(served_mtp, load):
    """The draft model holds the default loader's tensors, its MoE layer's among them, as vLLM processed
    them. From the checkpoint without qzeros only the plugin writes the MoE layer's zero points (vLLM's
    loader leaves them unwritten: test_plugin_layers' UNSET_QZEROS), so this shows the plugin filled it."""
    root = served_mtp[0]
    theirs, ours = (load_file(str(root / f"{name}.draft.safetensors")) for name in ("auto", load))
    assert any(name.startswith(MTP_EXPERTS) for name in theirs), sorted(theirs)
    assert sorted(ours) == sorted(theirs)
    differ = sorted(name for name, tensor in theirs.items() if not torch.equal(tensor, ours[name]))
    assert not differ, f"{load}: the draft model differs from the default loader's in {differ}"
