"""Rank maths: `ParallelConfig` (the one source of TP/EP size and rank), expert placement, and each rank's
span of the intermediate dimension (`partition`: effective group size, padding)."""

from __future__ import annotations

from .config import ExpertPlacement, Node, ParallelConfig

__all__ = ["ExpertPlacement", "Node", "ParallelConfig"]
