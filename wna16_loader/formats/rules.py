"""Per-module quantization rules: the spec each Linear module was written with, by its quantizer's rules.

A format's config may give modules their own spec (GPTQModel `dynamic`, AutoRound `extra_config`,
compressed-tensors `config_groups` + `ignore`, `modules_to_not_convert`). Each format module turns its
config into one `ModuleRules`: an ordered tuple of `Rule`s (the first that matches a module name wins,
in the order the quantizer applies them) and a default. A rule gives a spec (`unquantized_spec()` for
modules left in float), or refuses (a scheme that is not WNA16, e.g. FP8).

| Match    | pattern p matches module name m when                          | used for                          |
|----------|---------------------------------------------------------------|-----------------------------------|
| EXACT    | m == p                                                        | exact names (every format)        |
| START    | re.match(p, m): anchored at the start only                    | GPTQModel `dynamic`, CT `re:`     |
| SEARCH   | re.search(p, m)                                               | AutoRound regex keys              |
| CONTAINS | p is a substring of m                                         | AWQ / GPTQ `modules_to_not_convert` |
| ANY      | always (every Linear module)                                  | CT class target `Linear`          |
| OUTSIDE  | m starts with none of the comma-separated prefixes in p       | AutoRound `block_name_to_quantize` |

A SEARCH rule with `unless_module=True` (an AutoRound key) is skipped when its pattern is itself the
name of a module of the checkpoint: auto-round treats such a key as that module's exact entry only.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Container

from ..errors import ConfigError
from .spec import QuantSpec, unquantized_spec


class Match(enum.Enum):
    """How a rule's pattern is compared with a module name (module table)."""

    EXACT = "exact"
    START = "re.match"
    SEARCH = "re.search"
    CONTAINS = "substring"
    ANY = "every Linear"
    OUTSIDE = "outside the blocks"


@dataclass(frozen=True)
class Rule:
    """One rule of a config: `origin` is how the config writes it (for messages)."""

    match: Match
    pattern: str
    spec: QuantSpec | None  # None with `refusal`: the modules it covers are not WNA16
    origin: str
    refusal: str | None = None
    unless_module: bool = False

    def __post_init__(self) -> None:
        """A regex rule's pattern must compile: else a ConfigError naming the rule, the position and the fix."""
        if self.match in (Match.START, Match.SEARCH):
            try:
                _compiled(self.pattern)
            except re.error as exc:
                at = "" if exc.pos is None else f" at position {exc.pos}, after {self.pattern[:exc.pos]!r}"
                raise ConfigError(f"quantization_config: {self.origin}: {self.pattern!r} is not a valid regular "
                                  f"expression ({exc.msg}{at}); fix the pattern in the config (escape a literal "
                                  f"character with a backslash, e.g. \\. \\( \\[), or remove the rule.") from None

    def matches(self, module: str, modules: Container[str] = ()) -> bool:
        """Whether this rule applies to the Linear module named `module` (`modules`: the checkpoint's)."""
        if self.unless_module and self.pattern in modules:
            return False
        if self.match is Match.EXACT:
            return module == self.pattern
        if self.match is Match.START:
            return _compiled(self.pattern).match(module) is not None
        if self.match is Match.SEARCH:
            return _compiled(self.pattern).search(module) is not None
        if self.match is Match.CONTAINS:
            return self.pattern in module
        if self.match is Match.OUTSIDE:
            return not any(module.startswith(block) for block in self.pattern.split(","))
        return True


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    if pattern not in _PATTERNS:
        _PATTERNS[pattern] = re.compile(pattern)
    return _PATTERNS[pattern]


@dataclass(frozen=True)
class ModuleSpec:
    """What the rules give one module: its spec (or why it is not WNA16) and the rule that decided."""

    spec: QuantSpec | None
    origin: str
    refusal: str | None = None


@dataclass(frozen=True)
class ModuleRules:
    """A config's rules, first match wins; `default` applies to a module no rule matches; `base` is the
    config's top-level spec (what `MoEConfig.quant` reports)."""

    base: QuantSpec
    rules: tuple[Rule, ...] = ()
    default: ModuleSpec | None = None  # None: the base spec, "the top-level config"
    _exact: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for i, rule in enumerate(self.rules):  # exact rules by name: a config may hold thousands of them
            if rule.match is Match.EXACT:
                self._exact.setdefault(rule.pattern, i)

    @property
    def needs_modules(self) -> bool:
        """Whether `resolve` needs the checkpoint's module names (some rule is `unless_module`)."""
        return any(rule.unless_module for rule in self.rules)

    def uniform(self) -> ModuleSpec | None:
        """What every module resolves to when there is no rule (the default); None when rules decide."""
        return None if self.rules else self.resolve("")

    def resolve(self, module: str, modules: Container[str] = ()) -> ModuleSpec:
        """The spec of the Linear module named `module` (`modules`: every module name of the checkpoint)."""
        first = self._exact.get(module, len(self.rules))
        for i, rule in enumerate(self.rules[:first]):
            if rule.match is not Match.EXACT and rule.matches(module, modules):
                first = i
                break
        if first < len(self.rules):
            rule = self.rules[first]
            return ModuleSpec(rule.spec, rule.origin, rule.refusal)
        return self.default or ModuleSpec(self.base, "the top-level quantization_config")

    def specs(self) -> tuple[QuantSpec, ...]:
        """Every quantized spec these rules can give, the base first."""
        found = [self.base] + [r.spec for r in self.rules if r.spec is not None and r.spec.quantized]
        return tuple(dict.fromkeys(found))


def not_quantized(match: Match, pattern: str, origin: str, **more: bool) -> Rule:
    """A rule that leaves the modules it matches in float."""
    return Rule(match, pattern, unquantized_spec(), origin, **more)


REGEX_CHARS = frozenset(".^$*+?{}[]()|")


def literal_pattern(pattern: str) -> str | None:
    """The name a regex matches literally (escaped specials unescaped), or None when it is a real regex
    (an unescaped special character, or an escape such as \\d)."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            if pattern[i + 1].isalnum():
                return None
            out.append(pattern[i + 1])
            i += 2
            continue
        if char in REGEX_CHARS:
            return None
        out.append(char)
        i += 1
    return "".join(out)
