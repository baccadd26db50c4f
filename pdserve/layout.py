"""Which workers `pdserve serve` starts: the layout flags, or the layout that serves this host best.

On one host the prefill and decode pools share its cores and memory bandwidth, so splitting them
halves what each phase computes with. Disaggregation buys decode steps that no prompt interrupts
(a steady time per output token under long prompts); it costs throughput and first-token time
whenever a pool is too small to be worth its own cores. Measured on a 2-vCPU host (README, Speed),
one colocated worker on both cores served 1.4-1.75x the output of 1P1D with first tokens in about
half the time, while 1P1D held the decode tail lower. So a host whose cores cannot give each pool
`MIN_CORES_PER_POOL` of its own runs one colocated worker on all of them; a larger one runs one
prefill and one decode worker, each on half. One GPU: colocated; two or more: 1P1D, a GPU each.
The flags always win, and the choice and its reason are printed at start.
"""

from __future__ import annotations

from dataclasses import dataclass

# The smallest pool worth cores of its own: a judgement from the 2-core measurements, where 1-core
# pools lose clearly; hosts of 4 to 8 cores have not been measured yet.
MIN_CORES_PER_POOL = 4


@dataclass(frozen=True, slots=True)
class Layout:
    prefill: int
    decode: int
    colocated: int
    reason: str  # why: a sentence for the start-up log

    @property
    def roles(self) -> list[str]:
        return ["prefill"] * self.prefill + ["decode"] * self.decode + ["both"] * self.colocated

    def describe(self) -> str:
        parts = [f"{n} {name}" for n, name in ((self.prefill, "prefill"), (self.decode, "decode"),
                                               (self.colocated, "colocated")) if n]
        return " + ".join(parts) + f" ({self.reason})"


def from_flags(prefill: int | None, decode: int | None, colocated: int | None) -> Layout | None:
    """The layout the flags ask for; None when no layout flag was given. A pool size given alone
    makes a disaggregated cluster (`--prefill 2`: 2P1D); `--colocated N` alone, N colocated workers."""
    if prefill is None and decode is None and colocated is None:
        return None
    for name, n in (("--prefill", prefill), ("--decode", decode), ("--colocated", colocated)):
        if n is not None and n < 0:
            raise ValueError(f"{name} must not be negative, got {n}")
    disaggregated = prefill is not None or decode is not None
    layout = Layout(prefill if prefill is not None else int(disaggregated),
                    decode if decode is not None else int(disaggregated),
                    colocated or 0, "as the flags ask")
    if not layout.roles:
        raise ValueError("a cluster needs at least one worker")
    return layout


def choose(cores: int, device: str = "cpu", gpus: int = 0) -> Layout:
    """The layout for a host of `cores` CPUs (and `gpus` GPUs with device cuda)."""
    if device.startswith("cuda"):
        if gpus >= 2:
            return Layout(1, 1, 0, f"{gpus} GPUs: prefill and decode on a GPU each")
        return Layout(0, 0, 1, "one GPU: splitting it would halve each phase's share")
    if cores >= 2 * MIN_CORES_PER_POOL:
        return Layout(1, 1, 0, f"{cores} cores: each pool gets {cores // 2}, and decode steps no prompt interrupts")
    return Layout(0, 0, 1, f"{cores} cores cannot give each pool {MIN_CORES_PER_POOL}: one worker on all of them "
                           "serves more and answers sooner; --prefill 1 --decode 1 disaggregates anyway")
