"""The real quantizer fixtures (tests/fixtures/*/checkpoint: whole 1-layer Qwen3-MoE models written by GPTQModel,
llm-compressor and auto-round) as whole models SGLang 0.5.23 builds on the CPU, with no --quantization flag, in the
SGLang tier's groups (sglang_cases.GROUPS): what each loader does with each, read from SGLang's own source and pinned
by tests_sglang/test_fixture_models.py.

| outcome  | meaning                                                                                       |
|----------|-----------------------------------------------------------------------------------------------|
| EQUAL    | SGLang builds the model; the plugin's load equals SGLang's default load, parameter for parameter |
| OURS     | SGLang builds it, its loader crashes on the experts (a pinned mistake, test_plugin_layers); the plugin's experts are the quantizer's reference |
| REFUSED  | the plugin refuses it by name (its own limit), SGLang loads it                                |
| NOT_BUILT| SGLang cannot build the model here (neither loader gets one): the words of its error, and why |
"""

from __future__ import annotations

from dataclasses import dataclass

ALL = ("tp1", "tp2", "ep2")


@dataclass(frozen=True)
class Outcome:
    kind: str  # EQUAL, OURS, REFUSED or NOT_BUILT
    words: str = ""  # of the error (NOT_BUILT: SGLang's, both loaders; OURS: SGLang's; REFUSED: the plugin's)
    why: str = ""


EQUAL = Outcome("EQUAL")
GPTQ_ASYM = Outcome("NOT_BUILT", "Unknown quantization method: gptq", "asymmetric GPTQ is not Marlin-compatible and "
                    "SGLang 0.5.23 has no other GPTQ method for it (with --quantization moe_wna16 its linear layers "
                    "need the non-Marlin GPTQ kernel, removed: 'The non-Marlin GPTQ CUDA kernel has been removed')")
ONE_HEAD = Outcome("NOT_BUILT", "assert self.total_num_heads % attn_tp_size == 0",
                   "the fixture's one attention head cannot be split over 2 attention TP ranks")
# fixture -> group -> outcome
OUTCOMES: dict[str, dict[str, Outcome]] = {
    "awq_w4_g32": {"tp1": EQUAL, **{g: Outcome("NOT_BUILT", "input_size_per_partition = 64 is not divisible by "
                                                "min_thread_k = 128", "AWQ Marlin's linear kernel needs 128 input "
                                                "columns a rank; the fixture's H 128 gives o_proj 64 at attention TP 2")
                                    for g in ("tp2", "ep2")}},
    "ct_w8_channel_sym": {g: EQUAL for g in ALL},
    "ct_w4_g32_asym": {g: Outcome("OURS", "must match the size of tensor b", "SGLang's compressed-tensors MoE "
                                  "loader transposes every tensor but the zero points") for g in ALL},
    "gptq_w4_g32_zero_edge": {g: GPTQ_ASYM for g in ALL},
    "gptq_w4_g32_actorder_asym": {g: GPTQ_ASYM for g in ALL},
    "gptq_dynamic_mixed": {g: GPTQ_ASYM for g in ALL},
    "autoround_w8_g64_asym": {g: Outcome("NOT_BUILT", "Unsupported packing_format: auto_round", "SGLang reads "
                                         "auto-round's GPTQ and AWQ packings only") for g in ALL},
    "ct_multigroup_mixed": {"tp1": Outcome("NOT_BUILT", "is supported for the following bits", "SGLang's "
                                           "compressed-tensors MoE scheme refuses a MoE layer of this multi-group "
                                           "config (as it refuses the layer alone: test_plugin_layers.NOT_BUILT)"),
                            "tp2": ONE_HEAD, "ep2": ONE_HEAD},
    "autoround_layer_config_mixed": {"tp1": Outcome("REFUSED", "converting would round", "its float layer's "
                                                    "bfloat16 weights into the model's float16 parameters: SGLang "
                                                    "converts them, the plugin converts no value that could round"),
                                     "tp2": ONE_HEAD, "ep2": ONE_HEAD},
}
SHARDED = ("awq_w4_g32", "ct_w8_channel_sym", "ct_w4_g32_asym")  # also loaded from a wna16-shard output
