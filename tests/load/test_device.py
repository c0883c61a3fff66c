"""Every load path on a GPU target, through the GPU stand-in (always) and on a real CUDA/ROCm device (when present).

The stand-in (`wna16_loader.standin`) gives `cuda:N` tensors that live on the CPU, refuses ops mixing device
and host tensors, refuses any copy onto the device from a safetensors file mapping, and records pinned
allocations (with the current device), device allocations per device and synchronisations. The target is
the last of 4 stand-in GPUs (cuda:3, while cuda:0 is current), or `cuda:{count-1}` on a real machine.
Every path must be bit-identical to the CPU load, allocate on no other device and synchronise once.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from layer_helpers import dense
from safetensors import safe_open
from torch import nn

from wna16_loader import (
    FusedMoEExperts,
    ParallelConfig,
    check_model_complete,
    expert_param_mapping,
    install_load_hook,
    load_experts,
    load_model_experts,
    read_moe_config,
)
from wna16_loader.errors import DeviceError, WNA16Error
from wna16_loader.formats import Dim
from wna16_loader.load import qweights
from wna16_loader.load.device import DevicePolicy
from wna16_loader.load.fused import FusedWriter
from wna16_loader.load.ledger import Ledger
from wna16_loader.load.params import rank_spans
from wna16_loader.load.plan import LayerPlan, plan_layers
from wna16_loader.load.qweights import read_qweights
from wna16_loader.models.config import read_config_files
from wna16_loader.models.names import Proj
from wna16_loader.parallel.partition import Span
from wna16_loader.preshard import preshard_checkpoint
from wna16_loader.storage.buffers import HUGE_PAGE
from wna16_loader.storage.index import CheckpointIndex
from wna16_loader.testing.standin import StandIn
from wna16_loader.testing.synthetic import quant_config, write_checkpoint, write_family_checkpoint

FORMATS = {
    "gptq4-act-order": quant_config("gptq", bits=4, group_size=32, act_order=True),
    "gptq8": quant_config("gptq", bits=8, group_size=32),
    "awq4": quant_config("awq", bits=4, group_size=32),
    "ct4-actorder-group": quant_config("compressed-tensors", bits=4, group_size=32, act_order=True),
    "ct8-channel-sym": quant_config("compressed-tensors", bits=8, group_size=-1, symmetric=True),
    "gptq4-not-gated": quant_config("gptq", bits=4, group_size=32),  # Nemotron-H: up and down only
}
NEMOTRON = Path(__file__).parents[1] / "fixtures/configs/nemotron_h-nano-30b-a3b.json"


def write_source(folder: Path, fmt: str) -> None:
    """The test checkpoint of `fmt`: Qwen3-MoE, or Nemotron-3-Nano's published config at test sizes (MoE
    layers 1 and 4 of the pattern "MEM*E") for the non-gated case; H 64, I 128, 4 experts."""
    if fmt != "gptq4-not-gated":
        write_checkpoint(folder, FORMATS[fmt], hidden=64, intermediate=128, num_experts=4, num_layers=LAYERS)
        return
    config = {**json.loads(NEMOTRON.read_text()), "hybrid_override_pattern": "MEM*E", "num_hidden_layers": 5,
              "hidden_size": 64, "moe_intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2}
    write_family_checkpoint(folder, config, FORMATS[fmt])
PARALLEL = ParallelConfig(2, 1)  # TP 2, rank 1: every projection is cut
LAYERS = 3


@dataclass(frozen=True)
class Source:
    folder: Path  # the checkpoint
    sharded: Path  # its wna16-shard output at TP 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Source]:
    cache: dict[str, Source] = {}

    def make(fmt: str) -> Source:
        if fmt not in cache:
            folder = tmp_path_factory.mktemp(fmt)
            write_source(folder, fmt)
            sharded = tmp_path_factory.mktemp(f"{fmt}-tp2")
            preshard_checkpoint(folder, sharded, tp_size=2, progress=False)
            cache[fmt] = Source(folder, sharded)
        return cache[fmt]

    return make


@dataclass(frozen=True)
class Target:
    device: torch.device
    sim: StandIn | None  # None on a real GPU


@pytest.fixture(params=["stand-in", "cuda"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA or ROCm device")
        yield Target(torch.device("cuda", torch.cuda.device_count() - 1), None)
        return
    with StandIn(count=4) as sim:
        yield Target(torch.device("cuda", 3), sim)


# ---------------------------------------------------------------------- the load paths

Layers = dict[str, dict[str, torch.Tensor]]


def build_model(folder: Path, device: torch.device) -> nn.Module:
    """A module tree whose paths are the experts prefixes, its FusedMoEExperts built on `device`."""
    moe = read_moe_config(folder)
    root = nn.Module()
    for prefix in moe.experts_prefixes:
        parent = root
        *path, last = prefix.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        parent.add_module(last, FusedMoEExperts(moe, prefix, PARALLEL, device=device))
    return root


def module_layers(model: nn.Module) -> Layers:
    return {m.prefix: dict(m.named_parameters()) for m in model.modules() if isinstance(m, FusedMoEExperts)}


def mapped_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint as a view of its file mapping (what an engine's iterator yields)."""
    for file in sorted(folder.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():
            yield name, handle.get_tensor(name)


def via_load_experts(src: Source, device: torch.device, *, convert_on_device: bool = True) -> Layers:
    loaded = load_experts(src.folder, PARALLEL, device=device, convert_on_device=convert_on_device)
    return {prefix: layer.tensors for prefix, layer in loaded.items()}


def via_presharded(src: Source, device: torch.device) -> Layers:
    return {prefix: layer.tensors for prefix, layer in load_experts(src.sharded, PARALLEL, device=device).items()}


def via_model(src: Source, device: torch.device, *, sharded: bool = False) -> Layers:
    model = build_model(src.folder, device)
    load_model_experts(model, src.sharded if sharded else src.folder, PARALLEL)
    return module_layers(model)


def via_weight_loader(src: Source, device: torch.device) -> Layers:
    model = build_model(src.folder, device)
    params, mapping = dict(model.named_parameters()), expert_param_mapping(read_moe_config(src.folder))
    for name, tensor in mapped_tensors(src.folder):
        for t in mapping(name):
            params[t.param_name].weight_loader(params[t.param_name], tensor, name, t.shard_id.value, t.expert_id)
    check_model_complete(model)
    return module_layers(model)


def via_load_state_dict(src: Source, device: torch.device) -> Layers:
    model = build_model(src.folder, device)
    install_load_hook(model)
    model.load_state_dict({n: t for n, t in mapped_tensors(src.folder) if ".experts." in n}, strict=True)
    return module_layers(model)


PATHS: dict[str, Callable[[Source, torch.device], Layers]] = {
    "load_experts-device-conversion": via_load_experts,
    "load_experts-host-conversion": lambda src, device: via_load_experts(src, device, convert_on_device=False),
    "presharded": via_presharded,
    "load_model_experts": via_model,
    "load_model_experts-presharded": lambda src, device: via_model(src, device, sharded=True),
    "weight_loader": via_weight_loader,
    "load_state_dict": via_load_state_dict,
}


def cpu_load(src: Source) -> Layers:
    return {prefix: layer.tensors for prefix, layer in load_experts(src.folder, PARALLEL).items()}


def assert_equal_on(got: Layers, want: Layers, device: torch.device) -> None:
    assert sorted(got) == sorted(want)
    for prefix, layer in want.items():
        assert sorted(got[prefix]) == sorted(layer), prefix
        for name, tensor in layer.items():
            moved = got[prefix][name]
            assert moved.device == device, f"{prefix}.{name} on {moved.device}, not {device}"
            assert torch.equal(moved.cpu(), tensor), f"{prefix}.{name} differs from the CPU load"


def others(device: torch.device) -> dict[int, int]:
    """Bytes allocated on every device but `device`."""
    return {i: torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()) if i != device.index}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_equals_the_cpu_load(sources: Callable[[str], Source], target: Target, path: str,
                                        fmt: str) -> None:
    """Bit-identical to the CPU load, on the full target device, nothing allocated on another device,
    nothing copied from a file mapping to the device, one synchronise at the end, pinning on the target."""
    src = sources(fmt)
    want = cpu_load(src)
    before = others(target.device)
    got = PATHS[path](src, target.device)
    assert_equal_on(got, want, target.device)
    assert others(target.device) == before
    if target.sim is not None:
        assert set(target.sim.allocations) == {3}
        assert {current for _, current in target.sim.pinned} <= {3}
        assert target.sim.syncs == [3]


@pytest.mark.parametrize("fmt", ["gptq4-act-order", "awq4", "ct8-channel-sym", "gptq4-not-gated"])
@pytest.mark.parametrize("path", sorted(p for p in PATHS if "presharded" not in p))
def test_padded_layout_on_the_device(sources: Callable[[str], Source], target: Target, path: str, fmt: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 3 rank 2 pads I = 128 to I' = 144 (32 real columns, 16 of padding): the padding written into device
    parameters (fills, and copies into column ranges of w2) equals the CPU load's, bit for bit."""
    monkeypatch.setattr(sys.modules[__name__], "PARALLEL", ParallelConfig(3, 2))
    src = sources(fmt)
    want = cpu_load(src)
    assert {layer.padding for layer in load_experts(src.folder, PARALLEL).values()} == {16}
    assert_equal_on(PATHS[path](src, target.device), want, target.device)
    if target.sim is not None:
        assert target.sim.syncs == [3]


# ---------------------------------------------------------------------- the review's findings, one by one

@pytest.mark.parametrize("path", ["load_model_experts", "weight_loader", "load_state_dict"])
def test_finding1_act_order_module_paths(sources: Callable[[str], Source], path: str) -> None:
    """The module paths compare w13_g_idx on the device with the g_idx read on the host."""
    src = sources("gptq4-act-order")
    want = cpu_load(src)
    with StandIn(count=4):
        assert_equal_on(PATHS[path](src, torch.device("cuda", 3)), want, torch.device("cuda", 3))


def test_finding2_presharded_never_copies_from_the_mapping(sources: Callable[[str], Source]) -> None:
    """A pre-sharded load stages every parameter in host memory before the device copy."""
    src = sources("awq4")
    want = cpu_load(src)
    with StandIn(count=4) as sim:
        assert_equal_on(via_presharded(src, torch.device("cuda", 3)), want, torch.device("cuda", 3))
    assert not sim.mapped_copies


def layer_bytes(layers: Layers) -> list[int]:
    return [sum(t.numel() * t.element_size() for t in layer.values()) for layer in layers.values()]


def test_finding3_presharded_module_load_goes_layer_by_layer(sources: Callable[[str], Source]) -> None:
    """Loading a pre-sharded folder into modules holds at most one layer in host memory at once."""
    src = sources("gptq8")
    want = cpu_load(src)
    with StandIn(count=4, forbid_mapped=False) as sim:
        assert_equal_on(via_model(src, torch.device("cuda", 3), sharded=True), want, torch.device("cuda", 3))
    assert sim.peak_host <= max(layer_bytes(want)) < sum(layer_bytes(want)), (sim.peak_host, layer_bytes(want))


def test_finding4_host_conversion_on_a_non_current_device(sources: Callable[[str], Source]) -> None:
    """convert_on_device=False on cuda:3 (cuda:0 current) pins only on cuda:3's context, and never the weights."""
    src = sources("gptq4-act-order")
    want = cpu_load(src)
    with StandIn(count=4) as sim:
        assert_equal_on(via_load_experts(src, torch.device("cuda", 3), convert_on_device=False), want,
                        torch.device("cuda", 3))
    assert sim.pinned and all(current == 3 for _, current in sim.pinned), sim.pinned
    weights = sum(t.numel() for layer in want.values() for n, t in layer.items() if n.endswith("_qweight"))
    others_ = sum(t.numel() * t.element_size() for layer in want.values() for n, t in layer.items()
                  if not n.endswith("_qweight"))
    assert sum(nbytes for nbytes, _ in sim.pinned) <= others_ < weights


@pytest.mark.parametrize("path", sorted(PATHS))
def test_finding5_one_synchronize_per_load(sources: Callable[[str], Source], path: str) -> None:
    """Every load path synchronises the target once, at its end (not per layer, not never)."""
    src = sources("ct4-actorder-group")
    with StandIn(count=4) as sim:
        PATHS[path](src, torch.device("cuda", 3))
    assert sim.syncs == [3]


def test_finding5_a_module_loaded_alone_synchronises_once(sources: Callable[[str], Source]) -> None:
    """`module.load_state_dict` on one FusedMoEExperts (the root of the load) synchronises at its end."""
    src = sources("gptq8")
    moe, want = read_moe_config(src.folder), cpu_load(src)
    prefix = moe.experts_prefixes[1]
    with StandIn(count=4) as sim:
        module = FusedMoEExperts(moe, prefix, PARALLEL, device="cuda:3")
        module.install_load_hook()
        module.load_state_dict({n[len(prefix) + 1:]: t for n, t in mapped_tensors(src.folder)
                                if n.startswith(prefix + ".")}, strict=True)
        assert sim.syncs == [3]
        assert_equal_on({prefix: dict(module.named_parameters())}, {prefix: want[prefix]}, torch.device("cuda", 3))


# ---------------------------------------------------------------------- pieces

def first_plan(folder: Path, parallel: ParallelConfig) -> LayerPlan:
    with CheckpointIndex(folder) as index:
        return plan_layers(index, read_config_files(folder), parallel, Ledger())[0]


def test_cpu_target_stages_in_ordinary_memory(sources: Callable[[str], Source]) -> None:
    layer = next(iter(load_experts(sources("gptq4-act-order").folder, ParallelConfig(2, 1)).values()))
    assert all(t.device == torch.device("cpu") and not t.is_pinned() for t in layer.tensors.values())


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("gptq", 8), ("awq", 4), ("compressed-tensors", 4)])
@pytest.mark.parametrize("tp,rank,intermediate,group", [(1, 0, 96, 32), (2, 1, 96, 32), (2, 1, 40, -1)])
def test_upload_path_equals_host_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, bits: int,
                                      tp: int, rank: int, intermediate: int, group: int) -> None:
    """Raw words stacked, sent to the (stand-in) device in chunks and converted there == host conversion
    (I = 40 at TP 2 cuts K of down at row 20: the generic unpack-and-repack path)."""
    write_checkpoint(tmp_path, quant_config(fmt, bits=bits, group_size=group), hidden=64, intermediate=intermediate,
                     num_experts=6, num_layers=1)
    moe, plan = read_config_files(tmp_path), first_plan(tmp_path, ParallelConfig(tp, rank))
    monkeypatch.setattr(qweights, "UPLOAD_CHUNK_BYTES", 1)  # one expert per upload: several chunks
    with CheckpointIndex(tmp_path) as index, StandIn(count=4):
        for proj in Proj:
            sources = [plan.sources[(e, proj)] for e in plan.fused.experts]
            spans, _ = rank_spans(sources[0], plan.geometry.slice(proj))
            host = list(read_qweights(index, moe.quant, sources, spans))
            uploaded = list(read_qweights(index, moe.quant, sources, spans, upload=DevicePolicy.of("cuda:3")))
            assert [p.experts for p in uploaded] == [slice(i, i + 1) for i in range(len(sources))]
            assert {p.n for p in host + uploaded} == {Span(0, len(spans[Dim.N]))}
            assert all(p.tensor.device == torch.device("cuda", 3) for p in uploaded)
            assert torch.equal(torch.cat([dense(p.tensor) for p in host]),
                               torch.cat([dense(p.tensor).cpu() for p in uploaded]))


def test_cpu_writer_converts_on_the_host(sources: Callable[[str], Source]) -> None:
    plan = first_plan(sources("gptq4-act-order").folder, ParallelConfig(1, 0))
    assert FusedWriter(plan.prefix, plan.fused, "cpu").upload_to is None


@pytest.mark.parametrize("convert_on_device", [True, False])
def test_staging_places(sources: Callable[[str], Source], target: Target, convert_on_device: bool) -> None:
    """Weights converted on the device are staged there; everything else on the host."""
    plan = first_plan(sources("gptq4-act-order").folder, ParallelConfig(1, 0))
    writer = FusedWriter(plan.prefix, plan.fused, target.device, convert_on_device=convert_on_device)
    for name, buf in writer.staging.items():
        on_device = convert_on_device and name.endswith("_qweight")
        assert buf.device == (target.device if on_device else torch.device("cpu")), name
    assert writer.upload_to == (target.device if convert_on_device else None)


# ---------------------------------------------------------------------- the policy

def test_policy_resolves_devices() -> None:
    assert DevicePolicy.of("cpu") == DevicePolicy(torch.device("cpu"), convert_on_device=False)
    assert DevicePolicy.of("cpu").upload_to is None and not DevicePolicy.of("cpu").gpu
    with StandIn(count=4) as sim:
        sim.current = 2
        assert DevicePolicy.of("cuda").target == torch.device("cuda", 2)  # a bare cuda: the current device
        assert DevicePolicy.of("cuda:3", convert_on_device=False).upload_to is None
        with pytest.raises(DeviceError, match=r"device 'cuda:4': only 4 GPUs are visible \(cuda:0..cuda:3\)"):
            DevicePolicy.of("cuda:4")
    with pytest.raises(DeviceError, match=r"device 'meta': this loader writes to cpu or cuda\[:N\]"):
        DevicePolicy.of("meta")


def test_gpu_requested_from_a_cpu_only_torch(monkeypatch: pytest.MonkeyPatch, sources: Callable[[str], Source]) -> None:
    """A clear DeviceError (a WNA16Error), from every entry point, before anything is read."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    want = r"device 'cuda:1': this PyTorch \(.*\) sees no CUDA or ROCm device \(a CPU-only build\); install a CUDA"
    with pytest.raises(DeviceError, match=want):
        load_experts(sources("awq4").folder, PARALLEL, device="cuda:1")
    with pytest.raises(DeviceError, match=want):
        load_experts(sources("awq4").sharded, PARALLEL, device="cuda:1")
    assert issubclass(DeviceError, WNA16Error)


@pytest.mark.parametrize("convert_on_device", [True, False])
def test_policy_staging_table(convert_on_device: bool) -> None:
    """Weights on the device when converted there, else ordinary host memory; the rest pinned for a GPU."""
    with StandIn(count=4) as sim:
        policy = DevicePolicy.of("cuda:3", convert_on_device=convert_on_device)
        with policy.scope():
            weights = policy.staging((4, 8), torch.uint8, packed=True)
            scales = policy.staging((4, 2), torch.float16, packed=False)
        assert weights.device == (torch.device("cuda", 3) if convert_on_device else torch.device("cpu"))
        assert scales.device == torch.device("cpu") and sim.pinned == [(16, 3)]
        policy.synchronize()
        assert sim.syncs == [3]
    cpu = DevicePolicy.of("cpu")
    assert cpu.staging((2,), torch.uint8, packed=True).device == torch.device("cpu")
    with cpu.scope():
        cpu.synchronize()  # nothing to wait for, no CUDA call


def test_cpu_results_from_2_mib_lie_in_memory_of_their_own_unless_the_caller_drops_them() -> None:
    """`huge_results` (the default): a CPU result of 2 MiB or more is a mapping of its own advised huge pages
    (`storage.buffers.host_tensor`: not memory torch's allocator can resize); `huge_results=False` (wna16-shard,
    which drops each layer once written) and small results take `torch.empty`."""
    two_mib = (HUGE_PAGE // 4,)
    kept = DevicePolicy.of("cpu").staging(two_mib, torch.int32, packed=True)
    dropped = DevicePolicy.of("cpu", huge_results=False).staging(two_mib, torch.int32, packed=True)
    small = DevicePolicy.of("cpu").host_buffer((1024,), torch.float16)
    assert not kept.untyped_storage().resizable()
    assert dropped.untyped_storage().resizable() and small.untyped_storage().resizable()
    assert DevicePolicy.of("cpu", huge_results=False).host_buffer(two_mib, torch.int32).untyped_storage().resizable()
