"""The findings of every lint: what kind of problem, for which key and class, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    """What is wrong with a key."""

    CONTAINER = "CONTAINER"
    NOT_A_MODULE = "NOT_A_MODULE"
    NO_MATCH = "NO_MATCH"
    INVALID_REGEX = "INVALID_REGEX"
    SHADOWED = "SHADOWED"
    BROAD = "BROAD"
    # the contract of a replacement class (lint/contract/)
    SIGNATURE = "SIGNATURE"
    UNUSED_ARGUMENT = "UNUSED_ARGUMENT"
    WEIGHT_NAMES = "WEIGHT_NAMES"
    PARALLEL_PLAN = "PARALLEL_PLAN"
    RENAMED_PARAMETER = "RENAMED_PARAMETER"  # a note: every call passes it by position, so it binds

    def __str__(self) -> str:
        return self.value


# A failing kind breaks the model (a TypeError, random weights); registration refuses it.
FAILING_KINDS = frozenset(
    {Kind.CONTAINER, Kind.NOT_A_MODULE, Kind.NO_MATCH, Kind.INVALID_REGEX, Kind.SIGNATURE, Kind.WEIGHT_NAMES}
)
# A warning kind may be deliberate or matter only elsewhere (generation, multi-GPU loading):
# registration warns with ModelPatchWarning.
WARNING_KINDS = frozenset({Kind.UNUSED_ARGUMENT, Kind.PARALLEL_PLAN})
_EXAMPLES = 3


@dataclass
class Finding:
    """One problem with one key (and, where it applies, one class it matches)."""

    kind: Kind
    key: str
    class_name: str = ""
    family: str = ""
    module: str = ""
    message: str = ""
    suggestion: str = ""
    contains: tuple[str, ...] = ()  # replaced classes inside a CONTAINER
    loses: tuple[str, ...] = ()  # unreplaced classes a CONTAINER's replacement drops
    swapped_in: tuple[str, ...] = field(default=(), repr=False)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": str(self.kind),
            "key": self.key,
            "class": self.class_name,
            "family": self.family,
            "module": self.module,
            "message": self.message,
            "suggestion": self.suggestion,
            "contains": list(self.contains),
            "loses": list(self.loses),
        }
