"""The tested engine versions (layouts.serving_vllm, layouts.serving_sglang) and their verdicts in words: the serve
lines of `wna16-shard`'s summary, `--dry-run` and `--plan`, and the engines `--for` names.

| text                 | versions                          |
|----------------------|-----------------------------------|
| `vllm`, `sglang`     | every tested version of the engine |
| `vllm==0.34.0`       | that version (a tested one)       |
"""

from __future__ import annotations

from ..errors import ConfigError
from .serving import Engine, EngineVersion, Serve, Split, Verdict, verdict
from .serving_sglang import SGLANG, TESTED_SGLANG
from .serving_vllm import TESTED_VLLM, VLLM

ENGINES: tuple[Engine, ...] = (VLLM, SGLANG)
TESTED: tuple[EngineVersion, ...] = TESTED_VLLM + TESTED_SGLANG


def versions_for(text: str) -> tuple[EngineVersion, ...]:
    """The tested versions `--for TEXT` names (see the module table); a ConfigError naming the accepted values."""
    key, _, version = text.strip().lower().partition("==")
    named = tuple(v for v in TESTED if v.engine.key == key and version in ("", v.version))
    if not named:
        accepted = ", ".join([e.key for e in ENGINES] + [f"{v.engine.key}=={v.version}" for v in TESTED])
        raise ConfigError(f"--for {text}: no tested engine version of that name; use one of {accepted}.")
    return named


def of_engine(engine: Engine, versions: tuple[EngineVersion, ...] = TESTED) -> tuple[EngineVersion, ...]:
    return tuple(v for v in versions if v.engine == engine)


def where(split: Split) -> str:
    """`TP 2`, `EP 4`, `TP 2 x EP 2`."""
    return f"TP {split.tp}" if split.ep == 1 else f"EP {split.ep}" if split.tp == 1 else \
        f"TP {split.tp} x EP {split.ep}"


def serve_lines(split: Split, out: str = "OUT", versions: tuple[EngineVersion, ...] = TESTED) -> list[str]:
    """One line per engine and distinct verdict over `versions` (see layouts.serving's table)."""
    lines = []
    for engine in ENGINES:
        verdicts: dict[Verdict, list[str]] = {}
        for version in of_engine(engine, versions):
            verdicts.setdefault(verdict(version, split), []).append(version.version)
        lines += [f"{engine.name} {', '.join(on)} at {where(split)}: {say(v, engine, split, out)}"
                  for v, on in verdicts.items()]
    return lines


def command(engine: Engine, split: Split, out: str, flag: str | None = None) -> str:
    """The engine's serve command for a split's output (with `--quantization flag`)."""
    launch = engine.launch
    return launch.command.format(out=out) + (f" --quantization {flag}" if flag else "") + \
        launch.flags(split.tp, split.ep)


def say(v: Verdict, engine: Engine, split: Split, out: str) -> str:
    """A verdict in words: yes and the command, or no and why."""
    if v.serve is Serve.NO_FLAG:
        return f"yes: {command(engine, split, out)} (MoE method {', '.join(v.methods)}, no --quantization flag)"
    if v.serve is Serve.FLAG:
        return (f"yes, with --quantization {v.flag}: {command(engine, split, out, v.flag)} (MoE method "
                f"{', '.join(v.methods)}; with no flag {v.why})")
    return f"no: {v.why}"


def short_verdict(split: Split, versions: tuple[EngineVersion, ...]) -> str:
    """`--plan`'s column of one engine: `yes (auto_gptq)`, `--quantization moe_wna16` or `no`, prefixed by the
    versions when they differ."""
    said: dict[str, list[str]] = {}
    for version in versions:
        v = verdict(version, split)
        text = {Serve.NO_FLAG: f"yes ({', '.join(v.methods)})", Serve.FLAG: f"--quantization {v.flag}",
                Serve.NEVER: "no"}[v.serve]
        said.setdefault(text, []).append(version.version)
    return text if len(said) == 1 else "; ".join(f"{', '.join(on)}: {text}" for text, on in said.items())


def refusing(split: Split, versions: tuple[EngineVersion, ...]) -> tuple[EngineVersion, ...]:
    """The versions among `versions` that do not serve `split`, with or without a --quantization flag."""
    return tuple(version for version in versions if verdict(version, split).serve is Serve.NEVER)
