"""Structural types shared by the argv builders, so they need not import the plan module."""

from __future__ import annotations

from typing import Protocol


class LimitsLike(Protocol):
    memory: int
    pids: int
    method: str
